"""Hyperparameter sweeps defined: override dicts from plain Python, checked, named, one per trial.

A sweep file (`configs/sweeps/*.py`) defines `sweep()`, returning a list of
override dicts with dotted config keys, e.g. `{'lr_scale': 2.0,
'model.num_layers': 3}`; `grid`, `zipped`, `one_at_a_time`, `product` and
`random_search` below build such lists. `sweep.py` loads the file, checks every
key and value against the base config before anything runs, names each trial
after its overrides and runs it as `train.py` (then, optionally, `eval.py`) in
ROOT/<name>/, recording the status, command lines and attempts in
ROOT/<name>/trial.json and the output in ROOT/<name>/train.log (eval.log).

Running the trials, and what each recorded, is `sweep_runner`'s. Importing this
module loads no data code (TFDS), so sweep files and `sweep.py` start fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.machinery
import importlib.util
import itertools
import math
import numbers
import os
import random
import re
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

import transformer
from transformer import config as config_lib
from transformer import config_fields, config_rules, storage
from transformer.errors import InvalidInput, MissingInput
from transformer.tools import sweep_flags

Overrides = dict[str, Any]
REPO_DIR = transformer.CODE_DIR  # Where train.py and eval.py live.
_NAME_MAX_CHARS = 120
_NAME_UNSAFE = re.compile(r'[^A-Za-z0-9._+=,-]')


# --- Building sweeps: plain lists of override dicts -----------------------------------------------


def _check_axes(axes: Mapping[str, Sequence[Any]], helper: str) -> None:
  for key, values in axes.items():
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
      raise InvalidInput(
        f'{helper}: the values of {key!r} must be a non-empty list, got {values!r}.'
      )


def grid(axes: Mapping[str, Sequence[Any]]) -> list[Overrides]:
  """Every combination of the axes' values; the first axis varies slowest.

  `grid({'lr_scale': [1.0, 2.0], 'warmup_steps': [10, 20]})` gives 4 trials.
  """
  _check_axes(axes, 'grid')
  return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


def zipped(axes: Mapping[str, Sequence[Any]]) -> list[Overrides]:
  """Trial i takes value i of every axis (the axes must be equally long).

  `zipped({'model.d_model': [32, 64], 'model.d_ff': [64, 128]})` gives 2 trials.
  """
  _check_axes(axes, 'zipped')
  lengths = {key: len(values) for key, values in axes.items()}
  if len(set(lengths.values())) > 1:
    raise InvalidInput(f'zipped: the axes differ in length: {lengths}.')
  return [dict(zip(axes, values, strict=True)) for values in zip(*axes.values(), strict=True)]


def one_at_a_time(axes: Mapping[str, Sequence[Any]]) -> list[Overrides]:
  """The base config (`{}`), then each value of each axis alone: an ablation around the base."""
  _check_axes(axes, 'one_at_a_time')
  return [{}] + [{key: value} for key, values in axes.items() for value in values]


def product(*sweeps: Sequence[Overrides]) -> list[Overrides]:
  """Every combination of one dict from each sweep, merged; e.g. a grid times a zipped list."""
  combined = []
  for parts in itertools.product(*sweeps):
    merged: Overrides = {}
    for part in parts:
      shared = sorted(set(merged) & set(part))
      if shared:
        raise InvalidInput(f'product: the sweeps both set {shared}.')
      merged.update(part)
    combined.append(merged)
  return combined


class Sampler:
  """Draws one value of a key: `sampler(rng)` with a `random.Random`; `random_search`'s, and
  an Optuna study's search space (`space()` of a sweep file: `sweep_optuna`)."""

  def __call__(self, rng: random.Random) -> Any:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Uniform(Sampler):
  """A float uniform in [low, high], or with `log` one whose logarithm is."""

  low: float
  high: float
  log: bool = False

  def __call__(self, rng: random.Random) -> float:
    if self.log:
      return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
    return rng.uniform(self.low, self.high)


@dataclasses.dataclass(frozen=True)
class IntUniform(Sampler):
  """An integer uniform in low..high, both included."""

  low: int
  high: int

  def __call__(self, rng: random.Random) -> int:
    return rng.randint(self.low, self.high)


@dataclasses.dataclass(frozen=True)
class Choice(Sampler):
  """One of `values`, each equally likely."""

  values: tuple[Any, ...]

  def __call__(self, rng: random.Random) -> Any:
    return rng.choice(self.values)


def _check_bounds(name: str, low: Any, high: Any) -> None:
  """Refuses bounds given high first (Optuna's distributions would, only when a trial is asked)."""
  if not low <= high:
    raise InvalidInput(
      f'{name}({low!r}, {high!r}): the low bound {low!r} is above the high bound {high!r}; '
      f'give them low first: {name}({high!r}, {low!r}).'
    )


def uniform(low: float, high: float) -> Uniform:
  """A float drawn uniformly from [low, high]."""
  _check_bounds('uniform', low, high)
  return Uniform(low, high)


def log_uniform(low: float, high: float) -> Uniform:
  """A float whose logarithm is uniform in [log low, log high] (learning rates, scales)."""
  if low <= 0 or high <= 0:
    raise InvalidInput(f'log_uniform needs positive bounds, got ({low}, {high}).')
  _check_bounds('log_uniform', low, high)
  return Uniform(low, high, log=True)


def int_uniform(low: int, high: int) -> IntUniform:
  """An integer drawn uniformly from low..high, both included."""
  _check_bounds('int_uniform', low, high)
  return IntUniform(low, high)


def choice(values: Sequence[Any]) -> Choice:
  """One of `values`, each equally likely."""
  if not values:
    raise InvalidInput('choice([]): give it at least one value.')
  return Choice(tuple(values))


def round_significant(value: Any, digits: int = 3) -> Any:
  """A float rounded to `digits` significant digits (others as they are)."""
  if isinstance(value, float) and value != 0 and math.isfinite(value):
    return float(f'{value:.{digits}g}')
  return value


def random_search(
  space: Mapping[str, Sampler], num_trials: int, seed: int, digits: int = 3
) -> list[Overrides]:
  """`num_trials` distinct draws from `space` ({key: sampler}), the same for the same seed.

  Floats are rounded to `digits` significant digits, so that trial names and
  command lines stay short and a draw can be typed back in by hand.
  """
  rng = random.Random(seed)
  trials: list[Overrides] = []
  seen = set()
  for _ in range(100 * num_trials):
    if len(trials) == num_trials:
      break
    draw = {key: round_significant(sampler(rng), digits) for key, sampler in space.items()}
    signature = tuple(sorted(draw.items()))
    if signature not in seen:
      seen.add(signature)
      trials.append(draw)
  if len(trials) < num_trials:
    raise InvalidInput(
      f'random_search: only {len(trials)} distinct trials in the space, {num_trials} asked for.'
    )
  return trials


# --- Loading, checking and naming -----------------------------------------------------------------


def load_module(sweep_file: str) -> types.ModuleType:
  """The Python file `sweep_file`, imported."""
  path = os.path.abspath(os.path.expanduser(sweep_file))
  if not os.path.isfile(path):
    raise MissingInput(f'No sweep file at {path}.')
  module_name = 'sweep_' + re.sub(r'\W', '_', os.path.splitext(os.path.basename(path))[0])
  # Any file name: a .md file is read as Python too, and refused below if it is not.
  loader = importlib.machinery.SourceFileLoader(module_name, path)
  spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise InvalidInput(
      f'{sweep_file} is not a Python sweep file ({e.msg}, line {e.lineno}): name one that '
      'defines sweep() (e.g. configs/sweeps/tiny_schedule.py).'
    ) from None
  return module


def load_overrides(sweep_file: str) -> list[Overrides]:
  """Calls `sweep()` of the Python file `sweep_file`; checks that it returned override dicts."""
  module = load_module(sweep_file)
  if not callable(getattr(module, 'sweep', None)):
    raise InvalidInput(f'{sweep_file} defines no function sweep() returning override dicts.')
  trials = module.sweep()
  if not isinstance(trials, list | tuple) or not trials:
    raise InvalidInput(
      f'{sweep_file}: sweep() must return a non-empty list of dicts, got {type(trials).__name__}.'
    )
  for index, overrides in enumerate(trials):
    if not isinstance(overrides, Mapping) or not all(isinstance(k, str) for k in overrides):
      raise InvalidInput(
        f'{sweep_file}: trial {index} is not a dict with dotted string keys: {overrides!r}.'
      )
  return [dict(overrides) for overrides in trials]


def _typed_value(config: ml_collections.ConfigDict, key: str, value: Any) -> Any:
  """`value` as the type of config field `key` (int -> float only); raises naming the key."""
  *parents, leaf = key.split('.')
  node = config
  for parent in parents:
    node = node[parent]
  if isinstance(node[leaf], ml_collections.ConfigDict):
    raise InvalidInput(
      f'{key!r} is a group of config keys, not one value; override its fields '
      f'(e.g. {key}.{next(iter(node[leaf]))}).'
    )
  field_type = node.get_ref(leaf).get_type()
  if not isinstance(value, str | numbers.Real | np.bool_):  # bool is a Real too.
    raise InvalidInput(
      f'{key}={value!r}: only str, int, float and bool values can be passed to '
      'train.py on its command line.'
    )
  is_bool = isinstance(value, bool | np.bool_)
  # NumPy scalars become Python ones; an int may stand for a float, never a bool for a number.
  if field_type is float and isinstance(value, numbers.Real) and not is_bool:
    return float(value)
  if field_type is int and isinstance(value, numbers.Integral) and not is_bool:
    return int(value)
  if field_type is bool and is_bool:
    return bool(value)
  if field_type is str and isinstance(value, str):
    return value
  raise InvalidInput(
    f'{key}={value!r} has type {type(value).__name__}, but config.{key} has '
    f'type {field_type.__name__}.'
  )


def check_overrides(config: ml_collections.ConfigDict, overrides: Overrides) -> Overrides:
  """`overrides` with values typed as their config fields; an unknown key is an error naming it.

  Each value must lie in its domain (`config_lib.CONFIG_RULES`); rules
  across keys are checked on the whole trial config (`make_trials`).
  """
  keys = list(config_lib.flatten(config))
  groups = {key.rsplit('.', 1)[0] for key in keys if '.' in key}
  typed = {}
  for key, value in overrides.items():
    if key not in keys and key not in groups:
      close = difflib.get_close_matches(key, keys, n=3)
      hint = f' Did you mean {" or ".join(map(repr, close))}?' if close else ''
      raise InvalidInput(f'{key!r} is not a key of the config.{hint}')
    typed[key] = _typed_value(config, key, value)
    rule = config_lib.CONFIG_RULES.get(key)
    error = rule and rule.error(f'config.{key}', typed[key])
    if error:
      raise InvalidInput(error)
  return typed


def flag_value(value: Any) -> str:
  """How `value` is written after `--config.KEY=` so that train.py reads back the same value."""
  return repr(value) if isinstance(value, float) else str(value)


def _short_keys(keys: Sequence[str]) -> dict[str, str]:
  """Each key's last component where that is unambiguous among `keys`, else the dotted key."""
  leaves = [key.rsplit('.', 1)[-1] for key in keys]
  return {
    key: leaf if leaves.count(leaf) == 1 else key for key, leaf in zip(keys, leaves, strict=True)
  }


def trial_name(overrides: Overrides, short_keys: Mapping[str, str]) -> str:
  """`key=value,key=value` (keys sorted), filesystem-safe; 'base' for no overrides."""
  parts = [f'{short_keys[key]}={flag_value(overrides[key])}' for key in sorted(overrides)]
  name = _NAME_UNSAFE.sub('_', ','.join(parts)) or 'base'
  if len(name) > _NAME_MAX_CHARS:  # Keep it readable, and unique through a hash of the whole.
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    name = f'{name[: _NAME_MAX_CHARS - 11]}-{digest}'
  return name


@dataclasses.dataclass(frozen=True)
class Trial:
  """One run of a sweep."""

  name: str  # Its directory under the sweep root.
  overrides: Overrides  # Dotted key -> value, typed as the config's fields.
  config: ml_collections.ConfigDict  # The base config with every override applied.
  group: str | None = None  # With --seeds: its configuration (the name without the seed).


def apply_overrides(
  config: ml_collections.ConfigDict, overrides: Overrides
) -> ml_collections.ConfigDict:
  """A copy of `config` with `{'model.d_ff': 48, ...}` set (dotted keys; the input is kept):
  `config_fields.with_values`, which keeps following defaults following."""
  return config_fields.with_values(config, overrides)


def make_trials(
  config: ml_collections.ConfigDict,
  overrides_list: Sequence[Overrides],
  source: str = 'sweep()',
  fixed: Mapping[str, Any] | None = None,
  keys: Sequence[str] = (),
) -> list[Trial]:
  """Checks every override against `config` and names the trials; nothing runs.

  `fixed` are the keys set for every trial on the command line; a trial may not
  set them too. Errors name `source`, the trial index and the key. Names shorten
  each key to its last component where that is unambiguous among the keys the
  trials set and `keys` (a study's search space, whose trials come one by one).
  """
  fixed = fixed or {}
  typed_list = []
  for index, overrides in enumerate(overrides_list):
    try:
      typed = check_overrides(config, overrides)
    except ValueError as e:
      raise InvalidInput(f'{source}: trial {index} {overrides}: {e}') from None
    both = sorted(set(typed) & set(fixed))
    if both:
      raise InvalidInput(
        f'{source}: trial {index} sets {both}, which the command line already sets for every trial.'
      )
    typed_list.append(typed)
  all_keys = sorted({key for typed in typed_list for key in typed} | set(keys))
  short_keys = _short_keys(all_keys)
  trials, first_index = [], {}
  for index, typed in enumerate(typed_list):
    name = trial_name(typed, short_keys)
    if name in first_index:
      raise InvalidInput(
        f'{source}: trials {first_index[name]} and {index} are the same run '
        f'({name}); give each trial different overrides.'
      )
    first_index[name] = index
    resolved = apply_overrides(config, typed)
    # Every value in its domain before any trial runs, and a target metric that ranks it.
    errors = (
      config_lib.config_errors(resolved)
      or config_rules.sweep_target_errors(resolved)
      or config_lib.ignored_override_errors(resolved, {*fixed, *typed})
    )
    if errors:
      raise InvalidInput(
        f'{source}: trial {index} {typed} gives an invalid config:\n  ' + '\n  '.join(errors)
      )
    trials.append(Trial(name=name, overrides=typed, config=resolved))
  return trials


def check_seeds(seeds: int) -> None:
  """Raises a ValueError unless `seeds` is an integer >= 1."""
  if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
    raise InvalidInput(
      f'seeds={seeds!r} must be an integer >= 1 (the runs of each trial, with '
      'config.seed, config.seed + 1, ...).'
    )


def with_seeds(
  config: ml_collections.ConfigDict,
  overrides_list: Sequence[Overrides],
  seeds: int,
  source: str = 'sweep()',
  fixed: Mapping[str, Any] | None = None,
) -> list[Trial]:
  """`make_trials` of every override dict run with `seeds` seeds, grouped by configuration.

  Trial k of a configuration sets `seed` to config.seed + k; the seed varies
  slowest, so that the first seed of every configuration runs (and compiles) first.
  Each trial's `group` names its configuration: its name without the seed ('base'
  for no other override). A sweep that sets `seed` itself cannot be run with seeds.
  """
  check_seeds(seeds)
  if 'seed' in (fixed or {}):
    raise InvalidInput(
      f'--seeds={seeds} sets config.seed of every trial; the command line may not set it too.'
    )
  for index, overrides in enumerate(overrides_list):
    if 'seed' in overrides:
      raise InvalidInput(
        f'{source}: trial {index} {overrides} sets seed, which --seeds={seeds} '
        'sets for every trial.'
      )
  seeded = [
    {**overrides, 'seed': config.seed + k} for k in range(seeds) for overrides in overrides_list
  ]
  trials = make_trials(config, seeded, source=source, fixed=fixed)
  short_keys = _short_keys(sorted({key for overrides in seeded for key in overrides}))
  return [
    dataclasses.replace(
      trial,
      group=trial_name(
        {key: value for key, value in trial.overrides.items() if key != 'seed'}, short_keys
      ),
    )
    for trial in trials
  ]


# --- A sweep: what runs where ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sweep:
  """Trials of a sweep file over a base config, run in subdirectories of `root`."""

  config_file: str  # train.py's --config: an absolute path (with ':arg' if given).
  config: ml_collections.ConfigDict  # The base config with the command-line overrides.
  shared_overrides: Overrides  # Command-line overrides, passed to every trial.
  sweep_file: str  # Absolute path of the sweep file.
  root: str  # Absolute; trial i runs in root/<trials[i].name>.
  trials: tuple[Trial, ...]
  eval_flags: tuple[str, ...] | None = None  # eval.py's flags after train.py; None: no eval.
  cwd: str = '.'  # Where the commands run: relative paths in overrides mean what they meant here.
  seeds: int = 1  # Runs of each configuration (config.seed, +1, ...); > 1: grouped summaries.
  compare_to: str | None = None  # With seeds: the paired tests' reference configuration (best).

  def workdir(self, trial: Trial) -> str:
    return storage.join(self.root, trial.name)

  def swept_keys(self) -> list[str]:
    """Keys set by any trial, in order of first appearance."""
    return list(dict.fromkeys(key for trial in self.trials for key in trial.overrides))

  def trial(self, name: str) -> Trial:
    for trial in self.trials:
      if trial.name == name:
        return trial
    raise InvalidInput(
      f'No trial named {name!r} in {self.sweep_file}; its trials are '
      f'{[t.name for t in self.trials]}.'
    )

  def commands(self, trial: Trial) -> list[tuple[str, list[str]]]:
    """[(stage, argv)]: train.py, then eval.py when `eval_flags` is set."""
    flags = [
      f'--config.{key}={flag_value(value)}'
      for key, value in {**self.shared_overrides, **trial.overrides}.items()
    ]
    stages = [
      (
        'train',
        [
          sys.executable,
          os.path.join(REPO_DIR, 'train.py'),
          f'--config={self.config_file}',
          f'--workdir={self.workdir(trial)}',
          *flags,
        ],
      )
    ]
    if self.eval_flags is not None:
      stages.append(
        (
          'eval',
          [
            sys.executable,
            os.path.join(REPO_DIR, 'eval.py'),
            f'--workdir={self.workdir(trial)}',
            *self.eval_flags,
          ],
        )
      )
    return stages


def create(
  config_file: str,
  config: ml_collections.ConfigDict,
  sweep_file: str,
  root: str,
  shared_overrides: Overrides | None = None,
  eval_flags: Sequence[str] | None = None,
  seeds: int = 1,
  compare_to: str | None = None,
  overrides_list: Sequence[Overrides] | None = None,
) -> Sweep:
  """Loads and checks the sweep file against `config` (before anything runs).

  With `seeds` > 1 every trial of the file runs that many times (`with_seeds`),
  and the summary tests every configuration against `compare_to` (a
  configuration's name, e.g. 'base'; None: the best one). `overrides_list`: the
  trials, if not the file's `sweep()` (an Optuna study's first ones: `sweep_optuna`).
  """
  config_lib.validate(config)
  config_lib.raise_if(config_rules.sweep_target_errors(config))  # Before the trials' own.
  check_seeds(seeds)
  config_lib.raise_if(sweep_flags.root_errors(config, root), 'paths')
  if eval_flags is not None:
    config_lib.raise_if(sweep_flags.eval_flag_errors(eval_flags), 'flags')
  path, colon, argument = config_file.partition(':')
  shared_overrides = dict(shared_overrides or {})
  if overrides_list is None:
    overrides_list = load_overrides(sweep_file)
  if seeds > 1:
    trials = with_seeds(config, overrides_list, seeds, source=sweep_file, fixed=shared_overrides)
  else:
    trials = make_trials(config, overrides_list, source=sweep_file, fixed=shared_overrides)
  if compare_to is not None:
    if seeds < 2:
      raise InvalidInput(
        f'--compare_to={compare_to} names the configuration that the summary of a '
        'sweep with --seeds=N (N >= 2) tests the others against; add --seeds.'
      )
    names = list(dict.fromkeys(trial.group for trial in trials))
    if compare_to not in names:
      close = difflib.get_close_matches(compare_to, names, n=1)
      raise InvalidInput(
        f'--compare_to={compare_to} is not a configuration of {sweep_file}: '
        f'{names}.' + (f' Did you mean {close[0]!r}?' if close else '')
      )
  return Sweep(
    config_file=os.path.abspath(os.path.expanduser(path)) + colon + argument,
    config=config,
    shared_overrides=shared_overrides,
    sweep_file=os.path.abspath(os.path.expanduser(sweep_file)),
    root=storage.resolve(root),
    trials=tuple(trials),
    eval_flags=None if eval_flags is None else tuple(eval_flags),
    cwd=os.getcwd(),
    seeds=seeds,
    compare_to=compare_to,
  )
