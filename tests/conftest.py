"""Shared pytest fixtures, the `full_data` tier and `--fail-on-skip`.

Every end-to-end test reads corpora that the fixtures write (`synthetic_multi30k_dir`: a
made-up corpus in Multi30k's raw layout), so a plain clone runs them all. The few tests that
need the real Multi30k (beside the repository, at ../shared/data/multi30k) are marked
`full_data` and skip, naming the path, where it is absent. `--fail-on-skip` (CI) fails a run
that skipped any test, except a full_data test where ../shared/data does not exist.
"""

import atexit
import gzip
import importlib
import io
import os
import pathlib
import random
import shutil
import tarfile
import tempfile
import types
from collections.abc import Callable, Sequence

# One persistent compilation cache for the whole run: the pytest process, its xdist workers
# and the train.py / sweep.py processes the tests start (they inherit the environment), so a
# tiny function compiled by one of them is read from disk by the others. It starts empty, as
# in CI, and the process that made it removes it at exit; a cache the user set is left alone.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _COMPILATION_CACHE_DIR = tempfile.mkdtemp(prefix='transformer_tests_jax_cache_')
  atexit.register(shutil.rmtree, _COMPILATION_CACHE_DIR, ignore_errors=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _COMPILATION_CACHE_DIR
  # Every compile is cached, however fast (the tests' functions compile in well under 1 s).
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'

# XLA's CPU backend compiles the tests' programs with LLVM at optimisation level 0, here and in
# every process the tests start: compiling is most of the suite's time on 2 cores, and this
# halves it (tests/test_model.py, test_decoding.py, test_attention.py and test_inference.py:
# 137 s -> 84 s). The HLO and XLA's passes over it are the same; the machine code is less
# optimised and rounds some float results (exp, log) differently in their last bits, so the
# tests compare programs compiled alike. Users, the benchmarks and docs' figures keep XLA's
# default (level 2), and so does the one test of a config's promised loss
# (test_train.py::test_tiny_on_the_real_multi30k_reaches_the_loss_its_docstring_states).
# An XLA_FLAGS that names the level already is left alone.
TESTS_XLA_FLAG = '--xla_backend_optimization_level=0'
if 'xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {TESTS_XLA_FLAG}'.strip()

# The library's start-up rule first: on a CPU host with the `tpu` extra installed, JAX stays on
# the CPU instead of loading libtpu to look for a TPU (transformer/__init__.py).
import transformer  # noqa: E402, F401, I001
import jax  # noqa: E402  (after the cache's environment, which jax reads when imported)
import ml_collections  # noqa: E402
import pytest  # noqa: E402
from absl import flags  # noqa: E402

from configs import default  # noqa: E402

# No test connects outside 127.0.0.1: the guard in tests/netguard wraps every socket's connect,
# here and, through PYTHONPATH, in every Python process the tests start (train.py, sweeps).
_NETGUARD_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'netguard')
os.environ['PYTHONPATH'] = os.pathsep.join(
  [_NETGUARD_DIR] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
)
importlib.import_module('netguard.sitecustomize').install()

# Eight CPU devices for the sharding tests (meshes of data, fsdp and tensor parallelism);
# before anything touches a device. Subprocesses started by tests keep their own default.
jax.config.update('jax_num_cpu_devices', 8)
# Grain reads its absl flags when it starts worker processes (`config.data.num_workers`);
# train.py parses them, pytest does not.
flags.FLAGS.mark_as_parsed()

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# The real corpora, beside the repository (never copied into it): the full_data tier.
SHARED_DATA_DIR = REPO_ROOT.parent / 'shared' / 'data'
SHARED_MULTI30K_DIR = SHARED_DATA_DIR / 'multi30k'

_SYLLABLES = [c + v for c in 'bdfgklmnprstvz' for v in 'aeiou']


def _lexicon(rng: random.Random, size: int) -> list[str]:
  words = set()
  while len(words) < size:
    words.add(''.join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
  return sorted(words)


def synthetic_pairs(
  num: int, seed: int = 0, min_words: int = 3, max_words: int = 14
) -> list[tuple[str, str]]:
  """Distinct made-up (en, de) sentence pairs; de is a word-by-word mapping."""
  rng = random.Random(seed)
  en_words = _lexicon(random.Random(1), 300)
  de_words = [w.upper()[::-1] for w in _lexicon(random.Random(2), 300)]
  mapping = dict(zip(en_words, de_words, strict=True))
  pairs, seen = [], set()
  while len(pairs) < num:
    words = [rng.choice(en_words) for _ in range(rng.randint(min_words, max_words))]
    en = ' '.join(words).capitalize() + '.'
    if en in seen:
      continue
    seen.add(en)
    pairs.append((en, ' '.join(mapping[w] for w in reversed(words)) + ' .'))
  return pairs


# Word classes of made-up captions (nouns that start a sentence and nouns that end it, as in
# "A man ... on the street."), and the class sequences of their sentences ('?': optional).
_CLASS_SIZES = {'det': 4, 'adj': 70, 'subject': 60, 'verb': 90, 'prep': 16, 'object': 140}
_CAPTION_PATTERNS = (
  ('det', 'adj?', 'subject', 'verb', 'prep', 'det', 'adj?', 'object'),
  ('det', 'adj?', 'subject', 'verb', 'det', 'adj?', 'object'),
  ('det', 'subject', 'prep', 'det', 'adj?', 'object', 'verb', 'prep', 'det', 'object'),
)


def synthetic_captions(num: int, seed: int = 0) -> list[tuple[str, str]]:
  """Distinct made-up (en, de) captions of Multi30k's shape; de maps en word by word, in order.

  Like real captions they follow a few sentence patterns and their words are Zipf-distributed
  within each class (det, subject, ...), so a tiny model soon learns to write whole sentences
  (beam search writes more than a word, BLEU above 0).
  """
  rng = random.Random(seed)
  size = sum(_CLASS_SIZES.values())
  en_words = _lexicon(random.Random(1), size)
  de_words = [w.upper()[::-1] for w in _lexicon(random.Random(2), size)]
  mapping = dict(zip(en_words, de_words, strict=True))
  shuffled = random.Random(3).sample(en_words, len(en_words))
  classes, start = {}, 0
  for name, count in _CLASS_SIZES.items():
    classes[name] = shuffled[start : start + count]
    start += count
  weights = {
    name: [1 / (rank + 1) for rank in range(len(words))] for name, words in classes.items()
  }
  pairs, seen = [], set()
  while len(pairs) < num:
    words = []
    for slot in rng.choice(_CAPTION_PATTERNS):
      name = slot.rstrip('?')
      if slot.endswith('?') and rng.random() < 0.5:
        continue
      words.append(rng.choices(classes[name], weights[name])[0])
    en = ' '.join(words).capitalize() + '.'
    if en in seen:
      continue
    seen.add(en)
    pairs.append((en, ' '.join(mapping[w] for w in words) + ' .'))
  return pairs


def write_lines(path: pathlib.Path, lines: Sequence[str] | bytes) -> pathlib.Path:
  """Writes lines (or raw bytes) to `path`, gzipped when it ends in `.gz`."""
  data = lines if isinstance(lines, bytes) else ''.join(f'{x}\n' for x in lines).encode()
  path.parent.mkdir(parents=True, exist_ok=True)
  if path.suffix == '.gz':
    with gzip.open(path, 'wb') as f:
      f.write(data)
  else:
    path.write_bytes(data)
  return path


def tensorboard_scalars(directory: pathlib.Path | str) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} of the event files in `directory` as TensorBoard reads them.

  TensorBoard's own loader (`EventAccumulator`, every event kept), with its purge of the
  steps that a later file's SessionLog.START supersedes. A tag whose every point was purged
  (a validation row of a start that was cut short) keeps an empty list in the loader, and
  TensorBoard draws nothing for it: it is left out.
  """
  from tensorboard.backend.event_processing import event_accumulator

  accumulator = event_accumulator.EventAccumulator(str(directory), size_guidance={'scalars': 0})
  accumulator.Reload()
  scalars = {
    tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
    for tag in accumulator.Tags()['scalars']
  }
  return {tag: points for tag, points in scalars.items() if points}


def tensorboard_hparams(logdir: pathlib.Path | str) -> tuple[dict, dict[str, dict]]:
  """The HPARAMS tab of `tensorboard --logdir LOGDIR`, from TensorBoard's own plugin code.

  Returns ({'hparams': [column names], 'metrics': [tags]}, {session (run) name: {'group':
  its session group, 'hparams': {name: value}, 'metrics': {tag: value}, 'status': name}}).
  """
  from tensorboard import context
  from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
  from tensorboard.plugins import base_plugin
  from tensorboard.plugins.hparams import (
    api_pb2,
    backend_context,
    get_experiment,
    list_session_groups,
  )

  multiplexer = plugin_event_multiplexer.EventMultiplexer()
  multiplexer.AddRunsFromDirectory(str(logdir))
  multiplexer.Reload()
  provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
  backend = backend_context.Context(
    base_plugin.TBContext(logdir=str(logdir), data_provider=provider, multiplexer=multiplexer)
  )
  request = context.RequestContext()
  experiment = get_experiment.Handler(request, backend, '', api_pb2.GetExperimentRequest()).run()
  statuses = list(api_pb2.Status.values())
  groups = list_session_groups.Handler(
    request,
    backend,
    '',
    api_pb2.ListSessionGroupsRequest(start_index=0, slice_size=1000, allowed_statuses=statuses),
  ).run()
  sessions = {}
  for group in groups.session_groups:
    for session in group.sessions:
      sessions[session.name] = {
        'group': group.name,
        # The group's: those of its sessions (of the first, should they differ).
        'hparams': {k: getattr(v, v.WhichOneof('kind')) for k, v in group.hparams.items()},
        'metrics': {m.name.tag: m.value for m in session.metric_values},
        'status': api_pb2.Status.Name(session.status),
      }
  columns = {
    'hparams': [info.name for info in experiment.hparam_infos],
    'metrics': [info.name.tag for info in experiment.metric_infos],
  }
  return columns, sessions


@pytest.fixture(scope='session')
def write_parallel_corpus() -> Callable[..., pathlib.Path]:
  """Returns `write(directory, sizes={'train': 50, 'val': 10}, langs=('en', 'de'),
  compress=False, seed=0)`: writes synthetic `SPLIT.LANG[.gz]` files, returns directory."""

  def write(
    directory: pathlib.Path,
    sizes: dict[str, int] | None = None,
    langs: Sequence[str] = ('en', 'de'),
    compress: bool = False,
    seed: int = 0,
  ) -> pathlib.Path:
    sizes = sizes or {'train': 50, 'val': 10}
    for offset, (split, size) in enumerate(sorted(sizes.items())):
      pairs = synthetic_pairs(size, seed=seed + 1000 * offset)
      for i, lang in enumerate(langs):
        lines = [p[0] if i == 0 else p[1] for p in pairs]
        if i >= 2:
          lines = [f'{lang}: {x}' for x in lines]
        write_lines(directory / f'{split}.{lang}{".gz" if compress else ""}', lines)
    return directory

  return write


def _add_to_tar(tar: tarfile.TarFile, name: str, lines: Sequence[str]) -> None:
  data = ''.join(f'{x}\n' for x in lines).encode()
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


def _sgm(lines: Sequence[str], lang: str, kind: str) -> list[str]:
  """A newstest SGML file of `lines` (one document), as statmt.org ships them."""
  return [
    f'<{kind}set setid="newstest2014" srclang="any" trglang="{lang}">',
    '<doc sysid="ref" docid="1012-bbc" genre="news" origlang="en">',
    *(f'<seg id="{i}">{line}</seg>' for i, line in enumerate(lines, 1)),
    '</doc>',
    f'</{kind}set>',
  ]


def write_wmt14_release(directory: pathlib.Path, pairs_per_file: int = 40) -> pathlib.Path:
  """Writes small WMT14 En-De release archives in statmt.org's names and layout.

  Training: europarl-v7, commoncrawl, news-commentary-v9 (plain parallel files,
  `pairs_per_file` pairs each); dev.tgz: newstest2013 (plain, validation) and
  newstest2014 (SGML, test), `pairs_per_file // 2` pairs each.
  """
  n = pairs_per_file
  pairs = synthetic_pairs(4 * n, seed=14)
  directory.mkdir(parents=True, exist_ok=True)
  training = {
    'training-parallel-europarl-v7.tgz': 'training/europarl-v7.de-en.{}',
    'training-parallel-commoncrawl.tgz': 'commoncrawl.de-en.{}',
    'training-parallel-nc-v9.tgz': 'training/news-commentary-v9.de-en.{}',
  }
  for k, (archive, pattern) in enumerate(training.items()):
    with tarfile.open(directory / archive, 'w:gz') as tar:
      _add_to_tar(tar, pattern.format('en'), [en for en, _ in pairs[k * n : (k + 1) * n]])
      _add_to_tar(tar, pattern.format('de'), [de for _, de in pairs[k * n : (k + 1) * n]])
  dev, test = pairs[3 * n : 3 * n + n // 2], pairs[3 * n + n // 2 :]
  with tarfile.open(directory / 'dev.tgz', 'w:gz') as tar:
    _add_to_tar(tar, 'dev/newstest2013.en', [en for en, _ in dev])
    _add_to_tar(tar, 'dev/newstest2013.de', [de for _, de in dev])
    _add_to_tar(tar, 'dev/newstest2014-deen-src.de.sgm', _sgm([de for _, de in test], 'de', 'src'))
    _add_to_tar(tar, 'dev/newstest2014-deen-ref.en.sgm', _sgm([en for en, _ in test], 'en', 'ref'))
  return directory


def make_config(
  data_dir: pathlib.Path,
  manual_dir: pathlib.Path | None,
  dataset: str = 'parallel_text',
  **data_overrides,
) -> ml_collections.ConfigDict:
  """The default config pointed at local files, with small sizes for tests."""
  config = default.get_config()
  config.vocab_size = data_overrides.pop('vocab_size', 300)
  config.data.dataset = dataset
  config.data.data_dir = str(data_dir)
  config.data.manual_dir = str(manual_dir) if manual_dir else None
  config.data.max_len = 32
  config.data.max_eval_len = 64
  config.data.tokens_per_batch = 256
  for key, value in data_overrides.items():
    config.data[key] = value
  return config


@pytest.fixture
def config_for() -> Callable[..., ml_collections.ConfigDict]:
  """Returns `make_config(data_dir, manual_dir, dataset='parallel_text', **data)`."""
  return make_config


def abstract_run(
  config: ml_collections.ConfigDict, devices: Sequence[jax.Device], rows: int, length: int
) -> types.SimpleNamespace:
  """A run of `config` on `devices` as shapes: nothing allocated, nothing compiled.

  Its mesh, rules, task, models and optimizer; the train state's shapes and shardings; a
  batch of [rows, length] for each of the task's batch keys, split over the batch axes; and
  the train and eval steps jitted as train.py jits them (`jit_train_step`, `jit_eval_step`).
  """
  from transformer import optim, sharding, tasks, train_steps  # pylint: disable=g-import-not-at-top
  from transformer.config import ModelConfig  # pylint: disable=g-import-not-at-top

  mesh = sharding.create_mesh(config.mesh, devices)
  rules = sharding.axis_rules(config.mesh)
  task = tasks.get_task(config.model.architecture)
  model, eval_model = train_steps.create_models(ModelConfig.from_config(config))
  optimizer = optim.create_optimizer(optim.OptimizerConfig.from_config(config))
  state, state_shardings = train_steps.abstract_state_and_shardings(
    model, optimizer, task, mesh, rules
  )
  batch_sharding = sharding.batch_sharding(mesh, rules)
  shardings = dict(state_shardings=state_shardings, mesh=mesh, rules=rules)
  return types.SimpleNamespace(
    config=config,
    mesh=mesh,
    rules=rules,
    task=task,
    model=model,
    eval_model=eval_model,
    optimizer=optimizer,
    state=state,
    state_shardings=state_shardings,
    batch={
      k: jax.ShapeDtypeStruct((rows, length), jax.numpy.int32, sharding=batch_sharding)
      for k in task.batch_keys
    },
    train_step=train_steps.jit_train_step(
      train_steps.StepConfig.from_config(config),
      model=model,
      optimizer=optimizer,
      task=task,
      **shardings,
    ),
    eval_step=train_steps.jit_eval_step(
      train_steps.StepConfig.from_config(config), eval_model=eval_model, task=task, **shardings
    ),
  )


# --- The full_data tier and --fail-on-skip -----------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
  """Adds --fail-on-skip."""
  parser.addoption(
    '--fail-on-skip',
    action='store_true',
    help='Fail a run that skipped a test (CI); full_data tests may skip only '
    f'where {SHARED_DATA_DIR} does not exist.',
  )


# --- The order of the files: the longest first ------------------------------------------------

# `--dist loadfile` hands each xdist worker one whole file at a time, in the order of the
# collection. xdist's own order (most tests first) put files of few long tests last, such as
# test_bucket_runs.py (8 tests, almost 4 min): one worker ran them alone at the end while the
# other had finished. Longest first (the longest-processing-time rule) leaves only short files
# for the end. The files that took 60 s or more of a whole run (`--durations=0` at 42917ec, 2
# cores, before the compiles went to level 0), longest first; the others follow in pytest's
# order. A file missing here only runs later than it could; `tests/test_docs.py` checks that
# each name is a test file and that the order holds.
LONGEST_FILES = (
  'test_sharding.py',
  'test_interop.py',
  'test_reliability.py',
  'test_variants.py',
  'test_tpu_compile.py',
  'test_train.py',
  'test_bucket_endurance.py',
  'test_sweeps.py',
  'test_bucket_runs.py',
  'test_eval.py',
  'test_misuse.py',
  'test_sweep_optuna.py',
  'test_sweep_slurm.py',
  'test_finetune.py',
  'test_lowering.py',
  'test_inference.py',
  'test_lm.py',
)


def pytest_configure(config: pytest.Config) -> None:
  """Keeps the collection's order (`pytest_collection_modifyitems`) for xdist's workers."""
  if hasattr(config.option, 'loadscopereorder'):  # pytest-xdist's --no-loadscope-reorder.
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  """Orders the files longest first; skips the full_data tier without the real corpus (only
  that tier may read it)."""
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # Stable: else pytest's.
  unmarked = [
    item.nodeid
    for item in items
    if 'multi30k_dir' in getattr(item, 'fixturenames', ())
    and item.get_closest_marker('full_data') is None
  ]
  if unmarked:
    raise pytest.UsageError(
      'Tests that read the real Multi30k (fixture multi30k_dir) must be marked '
      f'@pytest.mark.full_data: {", ".join(unmarked)}'
    )
  if (SHARED_MULTI30K_DIR / 'train.en.gz').exists():
    return
  skip = pytest.mark.skip(reason=f'full_data: the Multi30k corpus is not at {SHARED_MULTI30K_DIR}')
  for item in items:
    if item.get_closest_marker('full_data') is not None:
      item.add_marker(skip)


# 'nodeid: reason' of each skip that --fail-on-skip fails, in this session.
_SKIPPED: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
  """Records each skip but that of a full_data test without ../shared/data (--fail-on-skip)."""
  excused = 'full_data' in report.keywords and not SHARED_DATA_DIR.exists()
  if report.skipped and not hasattr(report, 'wasxfail') and not excused:
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    _SKIPPED.append(f'{report.nodeid}: {reason}')


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
  """With --fail-on-skip, a run that passed but skipped a test it may not skip fails."""
  if session.config.getoption('fail_on_skip') and _SKIPPED and exitstatus == pytest.ExitCode.OK:
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(
  terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
  """With --fail-on-skip, lists the skips that failed the run, and why they skipped."""
  if config.getoption('fail_on_skip') and _SKIPPED:
    terminalreporter.section('--fail-on-skip', red=True)
    terminalreporter.line(f'{len(_SKIPPED)} test(s) were skipped, which this run forbids:')
    for line in _SKIPPED:
      terminalreporter.line(f'  {line}')


@pytest.fixture(scope='session')
def multi30k_dir() -> pathlib.Path:
  """The real Multi30k raw files (full_data tests only; they skip without them)."""
  return SHARED_MULTI30K_DIR


@pytest.fixture(scope='session')
def multi30k_data_dir(
  tmp_path_factory: pytest.TempPathFactory, multi30k_dir: pathlib.Path
) -> pathlib.Path:
  """A session data_dir where the real Multi30k is prepared once (about 5 s)."""
  return _prepared_multi30k(tmp_path_factory.mktemp('multi30k_tfds'), multi30k_dir)


def _prepared_multi30k(data_dir: pathlib.Path, manual_dir: pathlib.Path) -> pathlib.Path:
  """`data_dir` with the multi30k builder prepared from the raw files in `manual_dir`."""
  from transformer import datasets  # pylint: disable=g-import-not-at-top

  datasets.prepare(make_config(data_dir, manual_dir, 'multi30k').data)
  return data_dir


# Lines per split of the made-up corpus in Multi30k's raw layout (the real one has 29,000,
# 1,014 and 1,000): enough for the tiny configs' loss to fall and for BLEU above 0.
SYNTHETIC_MULTI30K_SIZES = {'train': 1000, 'val': 200, 'test_2016_flickr': 100}


@pytest.fixture(scope='session')
def synthetic_multi30k_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
  """A made-up corpus in Multi30k's raw layout, for every end-to-end test.

  `{train,val,test_2016_flickr}.{en,de,fr,cs}.gz` of `synthetic_captions` with
  SYNTHETIC_MULTI30K_SIZES lines (fr and cs: en with a prefix), read through the multi30k
  builder's manual_dir like the real release.
  """
  directory = tmp_path_factory.mktemp('synthetic_multi30k')
  for offset, (split, size) in enumerate(SYNTHETIC_MULTI30K_SIZES.items()):
    en, de = zip(*synthetic_captions(size, seed=1000 * offset), strict=True)
    texts = {'en': en, 'de': de, 'fr': [f'fr: {x}' for x in en], 'cs': [f'cs: {x}' for x in en]}
    for lang, lines in texts.items():
      write_lines(directory / f'{split}.{lang}.gz', lines)
  return directory


@pytest.fixture(scope='session')
def synthetic_multi30k_data_dir(
  tmp_path_factory: pytest.TempPathFactory, synthetic_multi30k_dir: pathlib.Path
) -> pathlib.Path:
  """A session data_dir where `synthetic_multi30k_dir` is prepared once (multi30k builder)."""
  return _prepared_multi30k(
    tmp_path_factory.mktemp('synthetic_multi30k_tfds'), synthetic_multi30k_dir
  )


@pytest.fixture(scope='session')
def object_stores():
  """fake-gcs-server and moto's S3 server on 127.0.0.1, every client pointed at them.

  Once per test process (xdist worker); `object_stores.bucket('gs')` makes a new bucket.
  """
  import object_stores as stores_lib

  stores = stores_lib.start()
  yield stores
  stores.stop()
