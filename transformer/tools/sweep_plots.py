"""A sweep's figure, ROOT/summary.png: the target metric against each swept key, learning curves.

`sweep_summary.write` draws it from the rows it ranked: one point per trial
(`plot`), or per configuration its mean with ± std error bars and each seed's
value (`plot_groups`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from transformer import ranking
from transformer.tools import sweeps
from transformer.tools.sweep_results import GroupResult, TrialResult

if TYPE_CHECKING:
  from matplotlib.figure import Figure


def _numeric(values: Sequence[Any]) -> bool:
  return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def _figure(num_panels: int) -> tuple[Figure, list]:
  """A figure of `num_panels` panels, three to a row."""
  # Matplotlib is imported where a figure is drawn: not at every start of sweep.py.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  num_cols = min(num_panels, 3)
  num_rows = math.ceil(num_panels / num_cols)
  fig = Figure(figsize=(4.6 * num_cols, 3.6 * num_rows), layout='constrained')
  FigureCanvasAgg(fig)
  axes = list(fig.subplots(num_rows, num_cols, squeeze=False).ravel())
  for ax in axes[num_panels:]:
    ax.set_visible(False)
  return fig, axes


def _key_axis(ax, key: str, values: Sequence[Any]) -> Callable[[Any], Any]:
  """Sets up the x axis of a swept key's `values`; returns value -> x position."""
  numeric = _numeric(values)
  to_x = (lambda v: v) if numeric else (lambda v: values.index(v))
  if numeric and values and min(values) > 0 and max(values) >= 8 * min(values):
    ax.set_xscale('log')
    ax.minorticks_off()
  if not numeric or len(values) <= 8:  # Ticks at the values tried.
    ax.set_xticks(
      [to_x(v) for v in values],
      [sweeps.flag_value(v) for v in values],
      rotation=0 if numeric else 20,
    )
  ax.set_xlabel(key)
  ax.grid(alpha=0.3)
  return to_x


def _learning_curves(
  ax, runs: Sequence[tuple[str, bool, Sequence[TrialResult]]], title: str
) -> None:
  """Train (solid) and validation (dashed) loss of each `(name, is_best, trials)`, a colour each."""
  from matplotlib import colormaps  # pylint: disable=g-import-not-at-top

  colors = colormaps['tab10']
  for index, (name, is_best, trials) in enumerate(runs):
    color = colors(index % 10)
    width = 2.5 if is_best else 1.0
    for number, trial in enumerate(trials):
      if trial.train_curve:
        steps, losses = zip(*trial.train_curve, strict=True)
        ax.plot(
          steps,
          losses,
          color=color,
          linewidth=width,
          alpha=0.8,
          label=name if number == 0 else None,
        )
      if trial.eval_curve:
        steps, losses = zip(*trial.eval_curve, strict=True)
        ax.plot(
          steps, losses, color=color, linewidth=width, linestyle='--', marker='o', markersize=3
        )
  ax.set_xlabel('step')
  ax.set_ylabel('loss (solid: train, dashed: validation)')
  ax.set_title(title)
  ax.grid(alpha=0.3)
  if 0 < len(runs) <= 12:
    ax.legend(fontsize='x-small')


def plot(
  results: Sequence[TrialResult], swept_keys: Sequence[str], target_metric: str, path: str
) -> None:
  """The target metric against each swept key, then every trial's learning curves."""
  column = ranking.METRICS[target_metric].summary_column
  fig, axes = _figure(len(swept_keys) + 1)
  scored = [r for r in results if getattr(r, column) is not None]
  for ax, key in zip(axes, swept_keys, strict=False):
    points = [
      (r.overrides[key], getattr(r, column), r.rank == 1) for r in scored if key in r.overrides
    ]
    to_x = _key_axis(ax, key, sorted({p[0] for p in points}, key=str))
    ax.scatter([to_x(p[0]) for p in points], [p[1] for p in points], color='tab:blue')
    best = [p for p in points if p[2]]
    ax.scatter(
      [to_x(p[0]) for p in best],
      [p[1] for p in best],
      s=160,
      marker='*',
      color='tab:red',
      label='best',
      zorder=3,
    )
    ax.set_ylabel(column)
    if best:
      ax.legend(fontsize='small')
  _learning_curves(
    axes[len(swept_keys)], [(r.name, r.rank == 1, [r]) for r in results], 'learning curves'
  )
  fig.savefig(path, dpi=90)


def plot_groups(
  groups: Sequence[GroupResult],
  swept_keys: Sequence[str],
  target_metric: str,
  path: str,
  compare_to: str | None = None,
) -> Figure:
  """Per swept key: the mean of the target metric with ± std error bars and each seed's value;
  then every trial's learning curves, one colour per configuration. Returns the figure.

  The reference (`compare_to`, else a configuration without overrides, such as a
  one-at-a-time sweep's baseline) is a grey band, mean ± std, on every panel that
  does not plot it, so each switch is seen against it.
  """
  column = ranking.METRICS[target_metric].summary_column
  fig, axes = _figure(len(swept_keys) + 1)
  scored = [g for g in groups if g.values(column)]
  reference = next(
    (g for g in scored if (g.name == compare_to if compare_to else not g.overrides)), None
  )
  for ax, key in zip(axes, swept_keys, strict=False):
    members = [g for g in scored if key in g.overrides]
    if reference is not None and reference not in members:
      stats = reference.stats(column)
      spread = stats['std'] or 0.0
      ax.axhspan(stats['mean'] - spread, stats['mean'] + spread, color='gray', alpha=0.15)
      ax.axhline(
        stats['mean'], color='gray', linestyle='--', label=f'{reference.name} (mean ± std)'
      )
    to_x = _key_axis(ax, key, sorted({g.overrides[key] for g in members}, key=str))
    for g in members:
      stats = g.stats(column)
      best = g.rank == 1
      ax.errorbar(
        [to_x(g.overrides[key])],
        [stats['mean']],
        yerr=[stats['std'] or 0.0],
        fmt='*' if best else 'o',
        markersize=12 if best else 6,
        capsize=4,
        color='tab:red' if best else 'tab:blue',
        zorder=3,
        label='best (mean ± std)' if best else None,
      )
      ax.scatter(
        [to_x(g.overrides[key])] * len(g.values(column)),
        g.values(column),
        s=10,
        color='gray',
        alpha=0.7,
        zorder=2,
      )
    ax.set_ylabel(f'{column} (mean ± std; dots: seeds)')
    if ax.get_legend_handles_labels()[1]:
      ax.legend(fontsize='small')
  _learning_curves(
    axes[len(swept_keys)],
    [(g.name, g.rank == 1, g.trials) for g in groups],
    'learning curves (one colour per configuration)',
  )
  fig.savefig(path, dpi=90)
  return fig
