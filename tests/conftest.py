"""Shared pytest fixtures."""

import gzip
import io
import pathlib
import random
import tarfile
from collections.abc import Callable, Sequence

import jax
import ml_collections
import pytest
from absl import flags

from configs import default

# Eight CPU devices for the sharding tests (meshes of data, fsdp and tensor parallelism);
# before anything touches a device. Subprocesses started by tests keep their own default.
jax.config.update('jax_num_cpu_devices', 8)
# Grain reads its absl flags when it starts worker processes (`config.data.num_workers`);
# train.py parses them, pytest does not.
flags.FLAGS.mark_as_parsed()

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# The real Multi30k corpus, beside the repository (never copied into it).
SHARED_MULTI30K_DIR = REPO_ROOT.parent / 'shared' / 'data' / 'multi30k'

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
  return [f'<{kind}set setid="newstest2014" srclang="any" trglang="{lang}">',
          '<doc sysid="ref" docid="1012-bbc" genre="news" origlang="en">',
          *(f'<seg id="{i}">{line}</seg>' for i, line in enumerate(lines, 1)),
          '</doc>', f'</{kind}set>']


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
      _add_to_tar(tar, pattern.format('en'), [en for en, _ in pairs[k * n:(k + 1) * n]])
      _add_to_tar(tar, pattern.format('de'), [de for _, de in pairs[k * n:(k + 1) * n]])
  dev, test = pairs[3 * n:3 * n + n // 2], pairs[3 * n + n // 2:]
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


@pytest.fixture(scope='session')
def multi30k_dir() -> pathlib.Path:
  """The shared Multi30k raw files; skips the test when they are absent."""
  if not (SHARED_MULTI30K_DIR / 'train.en.gz').exists():
    pytest.skip(f'Multi30k corpus not found at {SHARED_MULTI30K_DIR}.')
  return SHARED_MULTI30K_DIR


@pytest.fixture(scope='session')
def multi30k_data_dir(
    tmp_path_factory: pytest.TempPathFactory, multi30k_dir: pathlib.Path
) -> pathlib.Path:
  """A session data_dir where the real Multi30k is prepared once (about 5 s)."""
  from transformer import datasets  # pylint: disable=g-import-not-at-top

  data_dir = tmp_path_factory.mktemp('multi30k_tfds')
  datasets.prepare(make_config(data_dir, multi30k_dir, 'multi30k').data)
  return data_dir

