"""Hyperparameter sweeps: override dicts from plain Python, one train.py process per trial.

A sweep file (`configs/sweeps/*.py`) defines `sweep()`, returning a list of
override dicts with dotted config keys, e.g. `{'lr_scale': 2.0,
'model.num_layers': 3}`; `grid`, `zipped`, `one_at_a_time`, `product` and
`random_search` below build such lists. `sweep.py` loads the file, checks every
key and value against the base config before anything runs, names each trial
after its overrides and runs it as `train.py` (then, optionally, `eval.py`) in
ROOT/<name>/, recording the status, command lines and attempts in
ROOT/<name>/trial.json and the output in ROOT/<name>/train.log (eval.log).

A trial whose recorded commands equal the current ones and that finished is
skipped; any other is (re)started, and train.py resumes it from its latest
checkpoint. Importing this module imports no JAX, so sweep files and `sweep.py`
start fast.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import difflib
import glob
import hashlib
import importlib.util
import itertools
import json
import math
import numbers
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import logging

from transformer import atomic, workdir_lock
from transformer import config as config_lib

Overrides = dict[str, Any]
# The repository root, where train.py and eval.py live.
REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# config.target_metric -> (summary column, True if higher is better).
TARGET_METRICS = {'eval_bleu': ('best_eval_bleu', True), 'eval_loss': ('eval_loss', False)}
STATE_FILE = 'trial.json'
_NAME_MAX_CHARS = 120
_NAME_UNSAFE = re.compile(r'[^A-Za-z0-9._+=,-]')


# --- Building sweeps: plain lists of override dicts -----------------------------------------------


def _check_axes(axes: Mapping[str, Sequence[Any]], helper: str) -> None:
  for key, values in axes.items():
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
      raise ValueError(f'{helper}: the values of {key!r} must be a non-empty list, got {values!r}.')


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
    raise ValueError(f'zipped: the axes differ in length: {lengths}.')
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
        raise ValueError(f'product: the sweeps both set {shared}.')
      merged.update(part)
    combined.append(merged)
  return combined


Sampler = Callable[[random.Random], Any]


def uniform(low: float, high: float) -> Sampler:
  """A float drawn uniformly from [low, high]."""
  return lambda rng: rng.uniform(low, high)


def log_uniform(low: float, high: float) -> Sampler:
  """A float whose logarithm is uniform in [log low, log high] (learning rates, scales)."""
  if low <= 0 or high <= 0:
    raise ValueError(f'log_uniform needs positive bounds, got ({low}, {high}).')
  return lambda rng: math.exp(rng.uniform(math.log(low), math.log(high)))


def int_uniform(low: int, high: int) -> Sampler:
  """An integer drawn uniformly from low..high, both included."""
  return lambda rng: rng.randint(low, high)


def choice(values: Sequence[Any]) -> Sampler:
  """One of `values`, each equally likely."""
  values = list(values)
  return lambda rng: rng.choice(values)


def _round_significant(value: Any, digits: int) -> Any:
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
    draw = {key: _round_significant(sampler(rng), digits) for key, sampler in space.items()}
    signature = tuple(sorted(draw.items()))
    if signature not in seen:
      seen.add(signature)
      trials.append(draw)
  if len(trials) < num_trials:
    raise ValueError(
      f'random_search: only {len(trials)} distinct trials in the space, {num_trials} asked for.'
    )
  return trials


# --- Loading, checking and naming -----------------------------------------------------------------


def load_overrides(sweep_file: str) -> list[Overrides]:
  """Calls `sweep()` of the Python file `sweep_file`; checks that it returned override dicts."""
  path = os.path.abspath(os.path.expanduser(sweep_file))
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No sweep file at {path}.')
  module_name = 'sweep_' + re.sub(r'\W', '_', os.path.splitext(os.path.basename(path))[0])
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not callable(getattr(module, 'sweep', None)):
    raise ValueError(f'{sweep_file} defines no function sweep() returning override dicts.')
  trials = module.sweep()
  if not isinstance(trials, list | tuple) or not trials:
    raise ValueError(
      f'{sweep_file}: sweep() must return a non-empty list of dicts, got {type(trials).__name__}.'
    )
  for index, overrides in enumerate(trials):
    if not isinstance(overrides, Mapping) or not all(isinstance(k, str) for k in overrides):
      raise ValueError(
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
    raise ValueError(
      f'{key!r} is a group of config keys, not one value; override its fields '
      f'(e.g. {key}.{next(iter(node[leaf]))}).'
    )
  field_type = node.get_ref(leaf).get_type()
  if not isinstance(value, str | numbers.Real | np.bool_):  # bool is a Real too.
    raise ValueError(
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
  raise ValueError(
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
      raise ValueError(f'{key!r} is not a key of the config.{hint}')
    typed[key] = _typed_value(config, key, value)
    rule = config_lib.CONFIG_RULES.get(key)
    error = rule and rule.error(f'config.{key}', typed[key])
    if error:
      raise ValueError(error)
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
  """A copy of `config` with `{'model.d_ff': 48, ...}` set (dotted keys; the input is kept)."""
  resolved = config.copy_and_resolve_references()
  for key, value in overrides.items():
    *parents, leaf = key.split('.')
    node = resolved
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return resolved


def make_trials(
  config: ml_collections.ConfigDict,
  overrides_list: Sequence[Overrides],
  source: str = 'sweep()',
  fixed: Mapping[str, Any] | None = None,
) -> list[Trial]:
  """Checks every override against `config` and names the trials; nothing runs.

  `fixed` are the keys set for every trial on the command line; a trial may not
  set them too. Errors name `source`, the trial index and the key.
  """
  fixed = fixed or {}
  typed_list = []
  for index, overrides in enumerate(overrides_list):
    try:
      typed = check_overrides(config, overrides)
    except ValueError as e:
      raise ValueError(f'{source}: trial {index} {overrides}: {e}') from None
    both = sorted(set(typed) & set(fixed))
    if both:
      raise ValueError(
        f'{source}: trial {index} sets {both}, which the command line already sets for every trial.'
      )
    typed_list.append(typed)
  all_keys = sorted({key for typed in typed_list for key in typed})
  short_keys = _short_keys(all_keys)
  trials, first_index = [], {}
  for index, typed in enumerate(typed_list):
    name = trial_name(typed, short_keys)
    if name in first_index:
      raise ValueError(
        f'{source}: trials {first_index[name]} and {index} are the same run '
        f'({name}); give each trial different overrides.'
      )
    first_index[name] = index
    resolved = apply_overrides(config, typed)
    errors = config_lib.config_errors(resolved)
    if errors:  # Every value in its domain before any trial runs.
      raise ValueError(
        f'{source}: trial {index} {typed} gives an invalid config:\n  ' + '\n  '.join(errors)
      )
    trials.append(Trial(name=name, overrides=typed, config=resolved))
  return trials


def check_seeds(seeds: int) -> None:
  """Raises a ValueError unless `seeds` is an integer >= 1."""
  if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
    raise ValueError(
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
    raise ValueError(
      f'--seeds={seeds} sets config.seed of every trial; the command line may not set it too.'
    )
  for index, overrides in enumerate(overrides_list):
    if 'seed' in overrides:
      raise ValueError(
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
    return os.path.join(self.root, trial.name)

  def swept_keys(self) -> list[str]:
    """Keys set by any trial, in order of first appearance."""
    return list(dict.fromkeys(key for trial in self.trials for key in trial.overrides))

  def trial(self, name: str) -> Trial:
    for trial in self.trials:
      if trial.name == name:
        return trial
    raise ValueError(
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
) -> Sweep:
  """Loads and checks the sweep file against `config` (before anything runs).

  With `seeds` > 1 every trial of the file runs that many times (`with_seeds`),
  and the summary tests every configuration against `compare_to` (a
  configuration's name, e.g. 'base'; None: the best one).
  """
  config_lib.validate(config)
  check_seeds(seeds)
  config_lib.raise_if(root_errors(config, root), 'paths')
  if eval_flags is not None:
    config_lib.raise_if(eval_flag_errors(eval_flags), 'flags')
  path, colon, argument = config_file.partition(':')
  shared_overrides = dict(shared_overrides or {})
  overrides_list = load_overrides(sweep_file)
  if seeds > 1:
    trials = with_seeds(config, overrides_list, seeds, source=sweep_file, fixed=shared_overrides)
  else:
    trials = make_trials(config, overrides_list, source=sweep_file, fixed=shared_overrides)
  if compare_to is not None:
    if seeds < 2:
      raise ValueError(
        f'--compare_to={compare_to} names the configuration that the summary of a '
        'sweep with --seeds=N (N >= 2) tests the others against; add --seeds.'
      )
    names = list(dict.fromkeys(trial.group for trial in trials))
    if compare_to not in names:
      close = difflib.get_close_matches(compare_to, names, n=1)
      raise ValueError(
        f'--compare_to={compare_to} is not a configuration of {sweep_file}: '
        f'{names}.' + (f' Did you mean {close[0]!r}?' if close else '')
      )
  return Sweep(
    config_file=os.path.abspath(os.path.expanduser(path)) + colon + argument,
    config=config,
    shared_overrides=shared_overrides,
    sweep_file=os.path.abspath(os.path.expanduser(sweep_file)),
    root=os.path.abspath(os.path.expanduser(root)),
    trials=tuple(trials),
    eval_flags=None if eval_flags is None else tuple(eval_flags),
    cwd=os.getcwd(),
    seeds=seeds,
    compare_to=compare_to,
  )


def root_errors(config: ml_collections.ConfigDict, root: str) -> list[str]:
  """Errors of the sweep root `root`: a folder of its own, not a run, its files or its inputs."""
  if root and os.path.isdir(root) and config_lib.is_run(root):
    return [f'--workdir={root} is the workdir of a training run; give the sweep its own folder.']
  if root and os.path.exists(root) and not os.path.isdir(root):
    return [f'--workdir={root} is a file, not a folder.']
  inputs = {
    'the raw data (config.data.manual_dir)': config.data.manual_dir,
    'the prepared data (config.data.data_dir)': config.data.data_dir,
  }
  return config_lib.protected_path_errors(root, '--workdir', inputs)


# eval.py's flags that the sweep sets itself, or that would not score the trial's split into
# WORKDIR/eval/ (where the summary reads results), or would write one path for every trial.
_EVAL_FLAGS_OF_THE_SWEEP = (
  'workdir',
  'dry_run',
  'watch',
  'input_file',
  'output_file',
  'prompt',
  'attention_plot',
  'input_text',
)


def eval_flag_errors(eval_flags: Sequence[str]) -> list[str]:
  """Errors of `--eval_flags` that the sweep itself can tell (`check_eval_flags`: eval.py's)."""
  errors = []
  for flag in eval_flags:
    name = flag.lstrip('-').split('=', 1)[0]
    name = name[2:] if name.startswith('no') and name[2:] in _EVAL_FLAGS_OF_THE_SWEEP else name
    if not flag.startswith('-'):
      errors.append(f'--eval_flags: {flag!r} is not a flag (eval.py takes --name=value flags).')
    elif name in _EVAL_FLAGS_OF_THE_SWEEP:
      errors.append(
        f'--eval_flags: {flag} is not for a sweep: the sweep sets --workdir, and the summary '
        "reads the scores eval.py writes to each trial's WORKDIR/eval/ (no "
        + ', '.join(f'--{n}' for n in _EVAL_FLAGS_OF_THE_SWEEP[1:])
        + ').'
      )
  return errors


def check_eval_flags(sweep: Sweep) -> None:
  """eval.py checks the sweep's `--eval_flags` itself (`eval.py --dry_run`), before any trial.

  Names, types and domains of every flag, as the eval.py of each trial would read them.
  Raises `ValueError` with eval.py's error. Takes one eval.py start (a few seconds).
  """
  if sweep.eval_flags is None:
    return
  command = sweep.commands(sweep.trials[0])[-1][1] + ['--dry_run']
  result = subprocess.run(
    command, cwd=sweep.cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600
  )
  if result.returncode != 0:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    start = next(
      (
        i
        for i in range(len(lines) - 1, -1, -1)
        if lines[i].startswith(('FATAL Flags parsing error', 'Invalid flags:'))
      ),
      max(len(lines) - 3, 0),
    )
    raise ValueError(
      f'--eval_flags={shlex.join(sweep.eval_flags)}: eval.py refuses them, so no trial was '
      'run:\n  ' + '\n  '.join(lines[start:])
    )


def check_parallel(parallel: int, slurm: bool = False) -> None:
  """`--parallel`: trials at once here (1 up to the CPU cores), or with Slurm a cap (>= 1)."""
  cores = os.cpu_count() or 1
  if parallel < 1:
    raise ValueError(f'--parallel={parallel} must be at least 1.')
  if not slurm and parallel > cores:
    raise ValueError(
      f'--parallel={parallel} exceeds the {cores} CPU cores of this machine: each trial is a '
      'train.py process that uses every core it gets, so more at once than cores only slow '
      f'each other down. Use --parallel={cores} or fewer (or --emit=slurm for a cluster).'
    )


# --- Trial state: ROOT/<name>/trial.json ----------------------------------------------------------


def read_state(workdir: str) -> dict[str, Any] | None:
  path = os.path.join(workdir, STATE_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _write_state(workdir: str, state: dict[str, Any]) -> None:
  atomic.write_json(os.path.join(workdir, STATE_FILE), state, indent=2, sort_keys=True)


def _process_alive(state: Mapping[str, Any], workdir: str) -> bool | None:
  """Whether the process recorded as running the trial still runs; None if it cannot be known.

  Only a process on this host can be looked at; on Linux it must also still be
  the trial's (its command line names the workdir), not a later one that got its pid.
  """
  if not state.get('pid'):
    return False  # Between stages, or stopped cleanly.
  if state.get('host') != socket.gethostname():
    return None
  if os.path.isdir('/proc/self'):
    try:
      with open(f'/proc/{state["pid"]}/cmdline', 'rb') as f:
        return f'--workdir={workdir}'.encode() in f.read()
    except OSError:
      return False
  try:
    os.kill(state['pid'], 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


def trial_status(workdir: str) -> str:
  """'pending' (never started), 'running', 'interrupted', 'failed' or 'finished'."""
  state = read_state(workdir)
  if state is None:
    return 'pending'
  if state['status'] == 'running' and _process_alive(state, workdir) is False:
    return 'interrupted'
  return state['status']


def _is_done(state: Mapping[str, Any] | None, stage: str, command: Sequence[str]) -> bool:
  """Finished earlier with the same command line (the Python executable aside)."""
  record = (state or {}).get('stages', {}).get(stage)
  return bool(record) and record['status'] == 'finished' and record['command'][1:] == command[1:]


def _error_line(log_path: str, offset: int) -> str:
  """The exception (with its message's following lines) or last line of the log since `offset`."""
  with open(log_path, errors='replace') as f:
    f.seek(offset)
    lines = [line.rstrip() for line in f if line.strip()]
  for index in range(len(lines) - 1, -1, -1):
    if re.match(r'^(\w+\.)*\w*(Error|Exception|Interrupt)\b|^FATAL', lines[index]):
      message = [lines[index]] + list(
        itertools.takewhile(lambda line: line.startswith(' '), lines[index + 1 :])
      )
      return ' '.join(part.strip() for part in message)[:500]
  return lines[-1][:500] if lines else ''


def _now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')


# --- Running --------------------------------------------------------------------------------------


def prepare_data(trials: Sequence[Trial]) -> None:
  """Prepares each distinct dataset and vocabulary of `trials` once, in this process.

  Trials running at the same time (or as Slurm array tasks) would otherwise all
  prepare the same data at once and fail when renaming it into place.
  """
  from transformer import datasets, tokenizer  # TFDS: a slow import, only when needed.

  done = set()
  for trial in trials:
    key = (datasets.dataset_dir(trial.config.data), tokenizer.vocab_path(trial.config))
    if key not in done:
      logging.info('Preparing data and vocabulary once for all trials: %s, %s.', *key)
      datasets.prepare(trial.config.data)
      tokenizer.get_tokenizer(trial.config)
      done.add(key)


class _Runner:
  """Runs trials as subprocesses, each in its workdir, recording their state."""

  def __init__(self, sweep: Sweep):
    self.sweep = sweep
    self.stopping = threading.Event()
    self._processes: dict[str, subprocess.Popen] = {}
    self._lock = threading.Lock()

  def run_trial(self, trial: Trial) -> str:
    """'skipped', 'finished', 'failed', 'interrupted' or 'running' (by another process)."""
    workdir = self.sweep.workdir(trial)
    state = read_state(workdir)
    if state and state['status'] == 'running' and _process_alive(state, workdir):
      logging.warning('%s: already running in process %s; left alone.', trial.name, state['pid'])
      return 'running'
    holder = workdir_lock.read_holder(workdir)
    if holder is not None and workdir_lock.holder_alive(holder) is not False:
      logging.warning(
        '%s: its workdir is in use by another training run, %s; left alone.',
        trial.name,
        workdir_lock.describe(holder),
      )
      return 'running'
    commands = self.sweep.commands(trial)
    # After a stage runs, the later ones run again: they read what it wrote.
    first = next(
      (i for i, (stage, command) in enumerate(commands) if not _is_done(state, stage, command)),
      None,
    )
    if first is None:
      return 'skipped'
    os.makedirs(workdir, exist_ok=True)
    state = state or {'stages': {}}
    state.update(name=trial.name, overrides=trial.overrides)
    for stage, command in commands[first:]:
      if self.stopping.is_set():
        state['status'] = 'interrupted'
        _write_state(workdir, state)
        return 'interrupted'
      status = self._run_stage(trial, state, stage, command)
      if status != 'finished':
        return status
    return 'finished'

  def _run_stage(self, trial: Trial, state: dict[str, Any], stage: str, command: list[str]) -> str:
    workdir = self.sweep.workdir(trial)
    log_path = os.path.join(workdir, f'{stage}.log')
    previous = state['stages'].get(stage, {})
    record = {
      'command': command,
      'status': 'running',
      'started': _now(),
      'attempts': previous.get('attempts', 0) + 1,
      'log': os.path.basename(log_path),
    }
    started = time.time()
    with open(log_path, 'a') as log:
      log.write(f'\n=== {record["started"]} attempt {record["attempts"]}: {shlex.join(command)}\n')
      log.flush()
      offset = log.tell()
      with self._lock:
        if self.stopping.is_set():
          return 'interrupted'
        process = subprocess.Popen(
          command,
          stdout=log,
          stderr=subprocess.STDOUT,
          stdin=subprocess.DEVNULL,
          cwd=self.sweep.cwd,
        )
        self._processes[trial.name] = process
      state.update(status='running', host=socket.gethostname(), pid=process.pid)
      state['stages'][stage] = record
      _write_state(workdir, state)
      returncode = process.wait()
      with self._lock:
        del self._processes[trial.name]
    if self.stopping.is_set():
      # train.py exits 0 after checkpointing on SIGTERM: stopped, not finished.
      status = 'interrupted'
    else:
      status = 'finished' if returncode == 0 else 'failed'
    record.update(status=status, returncode=returncode, seconds=round(time.time() - started, 1))
    if status == 'failed':
      record['error'] = _error_line(log_path, offset)
    if stage == 'eval' and status == 'finished':
      record['result'] = _newest_eval_result(workdir, started)
    eval_follows = stage == 'train' and self.sweep.eval_flags is not None
    state['status'] = 'running' if status == 'finished' and eval_follows else status
    state['pid'] = None
    _write_state(workdir, state)
    return status

  def stop(self) -> None:
    """Stops every running trial (they resume from their checkpoints next time)."""
    with self._lock:
      self.stopping.set()
      processes = list(self._processes.values())
    for process in processes:
      process.terminate()


def _newest_eval_result(workdir: str, since: float) -> str | None:
  """The eval/*.json that eval.py wrote (relative to the workdir), or None."""
  paths = [
    p
    for p in glob.glob(os.path.join(workdir, 'eval', '*.json'))
    if os.path.getmtime(p) >= since - 1
  ]
  return os.path.relpath(max(paths, key=os.path.getmtime), workdir) if paths else None


def run(sweep: Sweep, parallel: int = 1, only: str | None = None) -> dict[str, str]:
  """Runs the trials (`parallel` at a time; only the one named `only` if given).

  Returns {trial name: 'skipped' | 'finished' | 'failed' | 'interrupted' |
  'running'}, the last for a trial that another sweep process is running. A
  failing trial does not stop the others. On KeyboardInterrupt (or SIGTERM made
  one by the caller) the running trials are stopped, marked 'interrupted' and the
  exception is raised again.
  """
  check_parallel(parallel)
  trials = [sweep.trial(only)] if only else list(sweep.trials)
  pending = [
    t
    for t in trials
    if not all(
      _is_done(read_state(sweep.workdir(t)), stage, command) for stage, command in sweep.commands(t)
    )
  ]
  if parallel > 1 and len(pending) > 1:
    prepare_data(pending)
  runner = _Runner(sweep)
  pending_names = {t.name for t in pending}
  outcomes = {t.name: 'skipped' for t in trials if t.name not in pending_names}
  for name in outcomes:
    logging.info('%s: finished earlier with the same commands, skipped.', name)
  with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
    futures = {pool.submit(runner.run_trial, t): t for t in pending}
    try:
      for future in concurrent.futures.as_completed(futures):
        trial = futures[future]
        outcomes[trial.name] = future.result()
        stages = (read_state(sweep.workdir(trial)) or {}).get('stages', {}).values()
        error = next((r['error'] for r in stages if r['status'] == 'failed'), None)
        logging.info(
          '[%d/%d] %s: %s%s',
          len(outcomes),
          len(trials),
          trial.name,
          outcomes[trial.name],
          f' ({error})' if error else '',
        )
    except KeyboardInterrupt:
      runner.stop()
      pool.shutdown(wait=True, cancel_futures=True)
      for trial in pending:
        state = read_state(sweep.workdir(trial))
        if state is not None and state['status'] == 'running':
          state['status'] = 'interrupted'
          _write_state(sweep.workdir(trial), state)
      raise
  return {t.name: outcomes[t.name] for t in trials}


def dry_run(sweep: Sweep) -> list[str]:
  """One line per command of every trial, with its current status; nothing runs or is written."""
  lines = [f'# in {sweep.cwd}']
  for trial in sweep.trials:
    workdir = sweep.workdir(trial)
    state = read_state(workdir)
    status = trial_status(workdir)
    for stage, command in sweep.commands(trial):
      if _is_done(state, stage, command):
        note = 'finished: skipped'
      else:
        note = 'new' if state is None else f'{status}: runs again, resuming its checkpoints'
      lines.append(f'# {trial.name} [{stage}, {note}]\n{shlex.join(command)}')
  return lines


# --- Slurm ----------------------------------------------------------------------------------------


def sweep_command(sweep: Sweep, *extra: str) -> list[str]:
  """The sweep.py command line that reproduces `sweep` (plus `extra` flags)."""
  command = [
    sys.executable,
    os.path.join(REPO_DIR, 'sweep.py'),
    f'--config={sweep.config_file}',
    f'--sweep={sweep.sweep_file}',
    f'--workdir={sweep.root}',
  ]
  if sweep.eval_flags is not None:
    command += ['--eval', f'--eval_flags={shlex.join(sweep.eval_flags)}']
  if sweep.seeds > 1:
    command.append(f'--seeds={sweep.seeds}')
  if sweep.compare_to is not None:
    command.append(f'--compare_to={sweep.compare_to}')
  command += [
    f'--config.{key}={flag_value(value)}' for key, value in sweep.shared_overrides.items()
  ]
  return command + list(extra)


def write_slurm(sweep: Sweep, parallel: int = 0, options: Sequence[str] = ()) -> str:
  """Writes ROOT/sweep.slurm: a job array, task i runs trial i through `sweep.py --trial`.

  Each task records its trial's state and log like a local run, skips it if it
  finished, resumes it if interrupted, and then rewrites the summary files.
  `parallel` > 0 caps the tasks running at once; `options` are extra `#SBATCH`
  lines (e.g. '--gres=gpu:1', '--time=4:00:00').
  """
  os.makedirs(sweep.root, exist_ok=True)
  throttle = f'%{parallel}' if parallel > 0 else ''
  names = '\n'.join(f'  {shlex.quote(t.name)}' for t in sweep.trials)
  task = shlex.join(sweep_command(sweep)) + ' --trial="${TRIALS[$SLURM_ARRAY_TASK_ID]}"'
  option_lines = ''.join(f'#SBATCH {option}\n' for option in options)
  script = f"""#!/bin/bash
# Sweep {sweep.sweep_file} over {sweep.config_file}: {len(sweep.trials)} trials,
# one per array task. Submit with `sbatch {sweep.root}/sweep.slurm`; the summary
# files in {sweep.root} are rewritten as tasks end, or on demand with:
#   {shlex.join(sweep_command(sweep, '--summarize'))}
#SBATCH --job-name={shlex.quote('sweep-' + os.path.basename(sweep.root))}
#SBATCH --array=0-{len(sweep.trials) - 1}{throttle}
#SBATCH --output={sweep.root}/slurm-%A_%a.out
{option_lines}set -euo pipefail
TRIALS=(
{names}
)
cd {shlex.quote(sweep.cwd)}
{task}
"""
  path = os.path.join(sweep.root, 'sweep.slurm')
  with open(path, 'w') as f:
    f.write(script)
  return path
