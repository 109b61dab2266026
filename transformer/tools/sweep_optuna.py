"""Optuna as a sweep's search and study store: `sweep.py --search=optuna`.

A sweep file whose `space()` returns {dotted key: sampler} (`sweeps.uniform`, `log_uniform`,
`int_uniform`, `choice`: the helpers of `random_search`) is an Optuna study of `--num_trials`
trials; its `sweep()`, if it has one, gives the first trials (enqueued). Any other sweep file
runs as a study with `--search=optuna`: its trials are enqueued and its space is each swept
key's listed values (`choice`), so the same trials run, and the pruner stops the poor ones.

The driver (`sweep_study`) asks the study for trials and tells it their results; a trial is
the project's own: its overrides checked against the config, its folder ROOT/<name> named by
its overrides (every key of the space), its train.py (then eval.py) run, resumed and recorded
by `sweep_runner`, the summary and the TensorBoard table as for any sweep. Trials never
import Optuna, so a trial may be a multi-host run.

* Samplers: TPE (`--sampler=tpe`, with the constant liar for trials running at once) or
  random. Each trial's draw is seeded with config.seed + its number: a study run again
  draws the same trials, and workers drawing at once draw different ones.
* Pruners: `--pruner=median` (after `--startup_trials` complete), `halving` (successive
  halving from the first validation) or `hyperband`; none with `--pruner=none`. Each of a
  running trial's validation rows in metrics.jsonl is reported at its step (the summary's
  target column as it stood then: the last eval_loss, or the best validation BLEU so far).
  A trial the pruner stops gets SIGTERM: train.py checkpoints and exits, the trial is
  `pruned` (resumable, like an interrupted one, by a list sweep over the same root) and is
  not ranked in the summary.
* The objective: the summary's column of `config.target_metric` (`ranking.METRICS`),
  so the study's best trial is the summary's best.
* The study: SQLite in ROOT/study.db by default (one machine, its workers in one or more
  sweep.py processes); `--storage=PATH` a journal file (`JournalFileBackend`) on a file
  system the machines share; `--storage=postgresql://...` (or mysql://, sqlite:///) a
  database (any SQLAlchemy URL). Workers on several machines run the same sweep.py command
  with the same root and storage; `--num_trials` counts the trials of the whole study. The
  storage is checked before any work (`check_storage`: a file that holds no study is refused,
  read only, and so is one that could not be written: its folder neither there nor creatable,
  or it or its lock file, PATH.lock, a file of a run, an input or the code), and a study
  records its sweep file, space and first trials: another sweep on it is refused
  (`_check_search`).
* A space's bounds are checked as the sweep file is read: low first, a choice not empty.
* Running the study (ask, run, report, tell; stale trials retried): `sweep_study`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import sqlite3
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_collections

from transformer import extras, path_checks, ranking, storage
from transformer.errors import InvalidInput
from transformer.tools import sweeps
from transformer.tools.sweeps import Overrides, Sweep, Trial

SEARCHES = ('list', 'optuna')
SAMPLERS = ('tpe', 'random')
PRUNERS = ('median', 'halving', 'hyperband', 'none')
DEFAULT_STORAGE = 'study.db'  # In the sweep root: sqlite:///ROOT/study.db.
_NEEDS_OPTUNA = 'An Optuna study (sweep.py --search=optuna)'  # What needs the sweeps extra.


@dataclasses.dataclass(frozen=True)
class Study:
  """An Optuna study over a sweep's base config: where it is kept and how it searches."""

  space: dict[str, sweeps.Sampler]  # Dotted key -> its sampler, every trial sets every key.
  num_trials: int  # Trials of the whole study (complete, pruned, failed on their own).
  sampler: str  # SAMPLERS.
  pruner: str  # PRUNERS.
  storage: str  # A database URL or a journal file's path.
  name: str  # The study's name in the storage.
  startup_trials: int  # The median pruner's: trials that complete before it prunes.
  sweep_file: str = ''  # The sweep file that made it (absolute), and the overrides of its first
  first_trials: tuple[dict[str, Any], ...] = ()  # (enqueued) trials: recorded in the study.


# --- The search space, checked against the config -------------------------------------------------


def search_of(sweep_file: str) -> str:
  """'optuna' for a sweep file that defines `space()`, else 'list'."""
  return 'optuna' if callable(getattr(sweeps.load_module(sweep_file), 'space', None)) else 'list'


def _value(config: ml_collections.ConfigDict, key: str) -> Any:
  node = config
  for part in key.split('.'):
    node = node[part]
  return node


def _derived_space(config: ml_collections.ConfigDict, trials: Sequence[Trial]) -> dict:
  """Each swept key's values in order of appearance (the base value where a trial keeps it)."""
  keys = list(dict.fromkeys(key for trial in trials for key in trial.overrides))
  space = {}
  for key in keys:
    values = [trial.overrides.get(key, _value(config, key)) for trial in trials]
    space[key] = sweeps.choice(list(dict.fromkeys(values)))
  return space


def _contains(sampler: sweeps.Sampler, value: Any) -> bool:
  if isinstance(sampler, sweeps.Choice):
    return value in sampler.values
  return sampler.low <= value <= sampler.high


def _check_space(
  config: ml_collections.ConfigDict, space: Mapping[str, Any], source: str, fixed: Mapping
) -> dict[str, sweeps.Sampler]:
  """`space` with its values typed as the config's fields; errors name the key."""
  if not isinstance(space, Mapping) or not space:
    raise InvalidInput(f'{source}: space() must return a non-empty dict of key: sampler.')
  checked = {}
  for key, sampler in space.items():
    if not isinstance(sampler, sweeps.Uniform | sweeps.IntUniform | sweeps.Choice):
      raise InvalidInput(
        f'{source}: space()[{key!r}] = {sampler!r} is not one of sweeps.uniform, '
        'log_uniform, int_uniform or choice.'
      )
    if key in fixed:
      raise InvalidInput(
        f'{source}: space() searches {key!r}, which the command line sets for every trial.'
      )
    if isinstance(sampler, sweeps.Choice) and not sampler.values:
      raise InvalidInput(f'{source}: space()[{key!r}] is a choice of no values.')
    if not isinstance(sampler, sweeps.Choice) and not sampler.low <= sampler.high:
      raise InvalidInput(
        f'{source}: space()[{key!r}] = {sampler}: its low bound {sampler.low!r} is above its '
        f'high bound {sampler.high!r}; give them low first.'
      )
    if isinstance(sampler, sweeps.Choice):
      values = sampler.values
    elif isinstance(sampler, sweeps.Uniform):  # Draws floats, whatever the bounds' type.
      values = (float(sampler.low), float(sampler.high))
    else:
      values = (sampler.low, sampler.high)
    try:
      typed = [sweeps.check_overrides(config, {key: value})[key] for value in values]
    except ValueError as e:
      raise InvalidInput(f'{source}: space()[{key!r}]: {e}') from None
    if isinstance(sampler, sweeps.Choice):
      checked[key] = sweeps.choice(typed)
    elif isinstance(sampler, sweeps.IntUniform):
      checked[key] = sampler
    else:
      checked[key] = dataclasses.replace(sampler, low=typed[0], high=typed[1])
  return checked


def create(
  config_file: str,
  config: ml_collections.ConfigDict,
  sweep_file: str,
  root: str,
  shared_overrides: Overrides | None = None,
  eval_flags: Sequence[str] | None = None,
  *,
  num_trials: int = 0,
  sampler: str = 'tpe',
  pruner: str = 'median',
  storage_spec: str = '',
  study_name: str = '',
  startup_trials: int = 5,
  seeds: int = 1,
) -> tuple[Sweep, Study]:
  """The sweep of a study's first (enqueued) trials, and the study; checked, nothing runs.

  The sweep file's `space()` (or the values its `sweep()` lists) is checked against the
  config: every key, both bounds and every choice, as a trial's overrides are.
  """
  if problem := extras.missing('optuna', 'sweeps', _NEEDS_OPTUNA):  # First: before any check.
    raise InvalidInput(problem)
  if seeds != 1:
    raise InvalidInput(
      f'--seeds={seeds}: an Optuna study runs each configuration once. Run the configurations '
      'it found best with seeds as a sweep of their own (a sweep file listing them, --seeds).'
    )
  if sampler not in SAMPLERS or pruner not in PRUNERS:
    raise InvalidInput(f'--sampler must be one of {SAMPLERS}, --pruner one of {PRUNERS}.')
  if startup_trials < 0 or num_trials < 0:
    raise InvalidInput('--num_trials and --startup_trials must be >= 0.')
  shared_overrides = dict(shared_overrides or {})
  module = sweeps.load_module(sweep_file)
  listed = sweeps.load_overrides(sweep_file) if callable(getattr(module, 'sweep', None)) else []
  sweep = sweeps.create(
    config_file, config, sweep_file, root, shared_overrides, eval_flags, overrides_list=listed
  )
  if callable(getattr(module, 'space', None)):
    try:
      space = module.space()
    except InvalidInput as e:  # A sampler's own check (`sweeps.uniform(2, 1)`).
      raise InvalidInput(f'{sweep_file}: space(): {e}') from None
    space = _check_space(config, space, sweep_file, shared_overrides)
  elif listed:
    space = _derived_space(config, sweep.trials)
  else:
    raise InvalidInput(f'{sweep_file} defines neither space() nor sweep().')
  enqueued = []
  for index, trial in enumerate(sweep.trials):
    outside = sorted(set(trial.overrides) - set(space))
    if outside:
      raise InvalidInput(
        f'{sweep_file}: trial {index} of sweep() sets {outside}, which space() does not search.'
      )
    values = {key: trial.overrides.get(key, _value(config, key)) for key in space}
    wrong = [key for key, value in values.items() if not _contains(space[key], value)]
    if wrong:
      raise InvalidInput(
        f'{sweep_file}: trial {index} of sweep() {trial.overrides} is outside space() in {wrong}.'
      )
    enqueued.append(values)
  trials = sweeps.make_trials(
    config, enqueued, source=sweep_file, fixed=shared_overrides, keys=list(space)
  )
  sweep = dataclasses.replace(sweep, trials=tuple(trials))
  if num_trials == 0:
    if not trials:
      raise InvalidInput(f'{sweep_file} defines a space(): give the study --num_trials.')
    num_trials = len(trials)
  inputs = {  # What the sweep reads: never its study's files.
    'the sweep file (--sweep)': sweep_file,
    'the config file (--config)': config_file,
    'the raw data (config.data.manual_dir)': config.data.manual_dir,
    'the prepared data (config.data.data_dir)': config.data.data_dir,
  }
  if not storage_spec:
    if storage.is_url(sweep.root):
      raise InvalidInput(
        f'An Optuna study of a sweep in {sweep.root} needs --storage: a database URL '
        '(postgresql://...) or a journal file on a file system the workers share.'
      )
    storage_spec = 'sqlite:///' + os.path.join(sweep.root, DEFAULT_STORAGE)
    storage_spec = check_storage(storage_spec, 'the study (--storage, by default)', inputs)
  else:
    storage_spec = check_storage(storage_spec, f'--storage={storage_spec}', inputs)
  study = Study(
    space=space,
    num_trials=num_trials,
    sampler=sampler,
    pruner=pruner,
    storage=storage_spec,
    name=study_name or storage.basename(sweep.root.rstrip('/')),
    startup_trials=startup_trials,
    sweep_file=os.path.abspath(sweep_file),
    first_trials=tuple(dict(trial.overrides) for trial in trials),
  )
  return sweep, study


# --- The study's storage, checked before anything is written -----------------------------------

# SQLAlchemy's dialects (Optuna's RDBStorage takes any SQLAlchemy URL; a `+driver` may follow).
DATABASE_SCHEMES = ('sqlite', 'postgresql', 'postgres', 'mysql', 'mariadb', 'oracle', 'mssql')
_SCHEME = re.compile(r'^([A-Za-z][A-Za-z0-9+.-]*)://')
_SQLITE_HEADER = b'SQLite format 3\x00'


def database_scheme(spec: str) -> str | None:
  """The dialect of a database URL (`postgresql+psycopg2://` -> 'postgresql'), else None."""
  match = _SCHEME.match(spec)
  if match is None:
    return None
  dialect = match.group(1).split('+')[0].lower()
  return dialect if dialect in DATABASE_SCHEMES else None


def _sqlite_errors(path: str, name: str) -> list[str]:
  """Why the file at `path` is no Optuna study in SQLite ([] when absent, empty or one)."""
  if os.path.isdir(path):
    return [f'{name}: {path} is a folder, not an SQLite file; name a file in it.']
  if not os.path.exists(path) or os.path.getsize(path) == 0:
    return []
  with open(path, 'rb') as f:
    header = f.read(len(_SQLITE_HEADER))
  if header != _SQLITE_HEADER:
    return [
      f'{name}: {path} is not an SQLite database (it does not begin as one), so it holds no '
      'study; name a new file, or the study.db of a study. A journal file is given without '
      "'sqlite:///' (--storage=PATH)."
    ]
  try:
    with contextlib.closing(sqlite3.connect(f'file:{path}?mode=ro', uri=True, timeout=60)) as db:
      [(check,)] = db.execute('PRAGMA quick_check(1)').fetchall()
      tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
  except sqlite3.OperationalError as e:
    if 'locked' in str(e) or 'busy' in str(e):
      return []  # Another worker writes it for over a minute: Optuna's own open will tell.
    return [f'{name}: {path} is a damaged SQLite database ({e}); it cannot be read as a study.']
  except sqlite3.Error as e:
    return [f'{name}: {path} is a damaged SQLite database ({e}); it cannot be read as a study.']
  if check != 'ok':
    return [f'{name}: {path} is a damaged SQLite database ({check}); it cannot be read as a study.']
  if tables and 'studies' not in tables:
    return [
      f'{name}: {path} is an SQLite database of something else (tables '
      f'{", ".join(sorted(tables))}), not an Optuna study; name a new file or a study.db.'
    ]
  return []


def _journal_errors(path: str, name: str) -> list[str]:
  """Why the file at `path` is no Optuna journal ([] when absent, empty or one)."""
  if os.path.isdir(path):
    return [f'{name}: {path} is a folder, not a journal file; name a file in it.']
  if not os.path.exists(path):
    return []
  with open(path, 'rb') as f:
    head = f.read(len(_SQLITE_HEADER))
    f.seek(0)
    content = f.read()
  if head == _SQLITE_HEADER:
    return [f'{name}: {path} is an SQLite database; give it as --storage=sqlite:///{path}.']
  lines = content.split(b'\n')[:-1]  # Whole lines: the last may be being written.
  for number, line in enumerate(lines, 1):
    try:
      entry = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
      entry = None
    if not isinstance(entry, dict) or not isinstance(entry.get('op_code'), int):
      return [
        f'{name}: {path} is not an Optuna journal file (line {number} is not a journal entry), '
        'so it holds no study; name a new file, or the journal of a study.'
      ]
  return []


def _written_errors(path: str, name: str, inputs: Mapping[str, str | None] | None) -> list[str]:
  """Errors of the study's local file `path` and of the lock file beside it (PATH.lock: the
  SQLite file's, `_creating`; the journal's, Optuna's), both written: their folder must exist
  or be creatable, and be writable; neither may be a file of a run, one of `inputs` or the
  code (`path_checks.output_errors`)."""
  folder = os.path.dirname(path)
  if errors := path_checks.writable_dir_errors(folder, name):
    return errors
  for written in (path, path + '.lock'):
    if os.path.isdir(folder):
      errors = path_checks.output_errors(written, '--storage', inputs)
    else:  # Created with the study: nothing in it to overwrite, and writable (above).
      errors = path_checks.protected_path_errors(written, '--storage', inputs)
    if errors:
      return errors
  return []


def check_storage(spec: str, name: str, inputs: Mapping[str, str | None] | None = None) -> str:
  """The study's storage `spec` made absolute, or InvalidInput saying why it holds no study.

  Read only: a database URL Optuna can open (its driver installed), an SQLite file or a journal
  file that is absent, empty or a study's, in a folder that exists or can be created, and
  writable; the file and its lock file (PATH.lock) not a file of a run, one of `inputs` ({what:
  path}, what the sweep reads) or the code (`path_checks.output_errors`). Buckets and other URLs
  are refused.
  """
  scheme = database_scheme(spec)
  if scheme == 'sqlite':
    prefix, _, rest = spec.partition('://')
    path = rest[1:] if rest.startswith('/') else ''
    if path in ('', ':memory:') or path.startswith('file:') or '?' in path:
      raise InvalidInput(
        f'{name}: an SQLite study needs a file, sqlite:///RELATIVE/PATH or '
        'sqlite:////ABSOLUTE/PATH (a study in memory ends with the process).'
      )
    path = os.path.abspath(os.path.expanduser(path))
    found = _sqlite_errors(path, name) or _written_errors(path, name, inputs)
    if found:
      raise InvalidInput(found[0])
    return f'{prefix}:///{path}'
  if scheme is not None:
    from sqlalchemy.engine import make_url  # pylint: disable=g-import-not-at-top

    try:
      make_url(spec).get_dialect().import_dbapi()
    except ImportError as e:
      raise InvalidInput(
        f'{name}: its database driver is not installed ({e}); install it (e.g. pip install '
        'psycopg2-binary for postgresql+psycopg2://, pymysql for mysql+pymysql://) or name '
        'the one installed in the URL.'
      ) from None
    except Exception as e:  # noqa: BLE001  (SQLAlchemy's parse errors: ValueError, ArgumentError)
      raise InvalidInput(
        f'{name} is not a database URL SQLAlchemy can read ({e}); e.g. '
        'postgresql://USER:PASSWORD@HOST/DB.'
      ) from None
    return spec
  if storage.is_url(spec):
    raise InvalidInput(
      f'{name}: a bucket or {spec.split("://")[0]}:// URL holds no study; give a database URL '
      f'({", ".join(s + "://" for s in DATABASE_SCHEMES[:3])}...) or a journal file on a file '
      'system the workers share.'
    )
  path = os.path.abspath(os.path.expanduser(spec))
  found = _journal_errors(path, name) or _written_errors(path, name, inputs)
  if found:
    raise InvalidInput(found[0])
  return path


def describe(study: Study) -> list[str]:
  """The study's settings, one line each (the dry run's header)."""
  space = ', '.join(f'{key}: {sampler}' for key, sampler in study.space.items())
  return [
    f'# Optuna study {study.name!r} in {study.storage}: {study.num_trials} trials, '
    f'{study.sampler} sampler, {study.pruner} pruner',
    f'# space: {space}',
  ]


# --- The Optuna study ---------------------------------------------------------------------------


def import_optuna():
  """Optuna; without it, `InvalidInput` naming the sweeps extra."""
  optuna = extras.require('optuna', 'sweeps', _NEEDS_OPTUNA)
  # The constant liar and the retry callback are experimental; the driver relies on both.
  warnings.filterwarnings('ignore', category=optuna.exceptions.ExperimentalWarning)
  return optuna


def distribution(sampler: sweeps.Sampler):
  optuna = import_optuna()
  if isinstance(sampler, sweeps.Choice):
    return optuna.distributions.CategoricalDistribution(sampler.values)
  if isinstance(sampler, sweeps.IntUniform):
    return optuna.distributions.IntDistribution(sampler.low, sampler.high)
  return optuna.distributions.FloatDistribution(sampler.low, sampler.high, log=sampler.log)


def _sampler(study: Study, seed: int):
  """The study's sampler, seeded per trial: config.seed + the trial's number."""
  optuna = import_optuna()

  def make(trial_seed: int):
    if study.sampler == 'random':
      return optuna.samplers.RandomSampler(seed=trial_seed)
    return optuna.samplers.TPESampler(seed=trial_seed, constant_liar=True)

  class PerTrialSeed(optuna.samplers.BaseSampler):
    """`make(seed + trial number)`'s sampler for each trial (`Study`'s docstring: why)."""

    def __init__(self):
      self._samplers: dict[int, Any] = {}

    def _of(self, trial):
      if trial.number not in self._samplers:
        self._samplers[trial.number] = make(seed + trial.number)
      return self._samplers[trial.number]

    def infer_relative_search_space(self, study, trial):
      return self._of(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
      return self._of(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
      return self._of(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial):
      self._of(trial).before_trial(study, trial)

    def after_trial(self, study, trial, state, values):
      self._of(trial).after_trial(study, trial, state, values)
      self._samplers.pop(trial.number, None)

  return PerTrialSeed()


def _pruner(study: Study, config: ml_collections.ConfigDict):
  optuna = import_optuna()
  first = config.eval_every_steps  # The first validation: the first step a trial reports.
  if study.pruner == 'median':
    return optuna.pruners.MedianPruner(n_startup_trials=study.startup_trials)
  if study.pruner == 'halving':
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=first, reduction_factor=3)
  if study.pruner == 'hyperband':
    return optuna.pruners.HyperbandPruner(
      min_resource=first, max_resource=config.num_train_steps, reduction_factor=3
    )
  return optuna.pruners.NopPruner()


@contextlib.contextmanager
def _creating(study: Study) -> Iterator[None]:
  """A local SQLite file is created by one process at a time (workers started together)."""
  if database_scheme(study.storage) != 'sqlite':
    yield
    return
  path = study.storage.partition(':///')[2]  # Absolute (`check_storage`).
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + '.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _search_record(study: Study) -> dict[str, Any]:
  """What the study searches, as recorded in its user attrs: its space and first trials."""
  record = {
    'sweep_file': study.sweep_file,
    'space': {key: str(sampler) for key, sampler in study.space.items()},
    'trials': list(study.first_trials),
  }
  return json.loads(json.dumps(record, default=str))  # As the storage gives it back.


def _check_search(loaded, study: Study) -> None:
  """Refuses a study made by another sweep file or over another space (its trials would be
  ranked with this sweep's); records this one's in a study that has no record yet."""
  record = _search_record(study)
  recorded = loaded.user_attrs.get('search')
  if recorded is None:
    loaded.set_user_attr('search', record)
    return
  if (recorded.get('space'), recorded.get('trials')) == (record['space'], record['trials']):
    return
  describe_record = lambda r: (
    f'{r.get("sweep_file")} (space {r.get("space")}, first trials {r.get("trials")})'
  )
  raise InvalidInput(
    f'Study {study.name!r} in {study.storage} was made by {describe_record(recorded)}, not by '
    f'this sweep, {describe_record(record)}: their trials would be ranked together. Give this '
    'sweep a study of its own (--study_name=NAME, or another --workdir or --storage), or run the '
    "study's own sweep file."
  )


def _open_errors() -> tuple[type[BaseException], ...]:
  """What Optuna raises on a storage it cannot open or read (one message: `load`)."""
  import sqlalchemy.exc  # pylint: disable=g-import-not-at-top

  return (sqlalchemy.exc.SQLAlchemyError, json.JSONDecodeError, KeyError, OSError, RuntimeError)


def load(sweep: Sweep, study: Study, create_if_missing: bool = True):
  """The `optuna.Study` (created if it does not exist yet)."""
  optuna = import_optuna()
  metric = ranking.METRICS[sweep.config.target_metric]
  column = metric.summary_column
  with _creating(study):
    try:
      backend = _backend(study)
      if not create_if_missing:
        return optuna.load_study(study_name=study.name, storage=backend)
      loaded = optuna.create_study(
        storage=backend,
        study_name=study.name,
        sampler=_sampler(study, sweep.config.seed),
        pruner=_pruner(study, sweep.config),
        direction=metric.direction,
        load_if_exists=True,
      )
    except _open_errors() as e:
      reason = str(e).strip().splitlines()[0] if str(e).strip() else ''
      raise InvalidInput(
        f"The study's storage {study.storage} cannot be opened as an Optuna study "
        f"({type(e).__name__}: {reason}); check that it is a study's database or journal and "
        'that its server answers, or name a new one with --storage.'
      ) from None
    if loaded.user_attrs.get('objective') not in (None, column):
      raise InvalidInput(
        f'Study {study.name!r} in {study.storage} optimises {loaded.user_attrs["objective"]}, '
        f'not {column} (config.target_metric); give this sweep a study of its own.'
      )
    _check_search(loaded, study)
    loaded.set_user_attr('objective', column)
  return loaded


def _backend(study: Study):
  optuna = import_optuna()
  if '://' in study.storage:
    return optuna.storages.RDBStorage(
      study.storage,
      engine_kwargs={'connect_args': {'timeout': 60}}
      if database_scheme(study.storage) == 'sqlite'
      else None,
    )
  os.makedirs(os.path.dirname(study.storage), exist_ok=True)
  return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(study.storage))


# --- Running the study --------------------------------------------------------------------------
