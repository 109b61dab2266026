"""The TFDS catalog's `lm1b` (One Billion Word benchmark), prepared without TensorFlow.

Chelba et al. 2013. The catalog builder finds its files with `tf.io.gfile.glob`,
which needs TensorFlow; this subclass globs with `etils.epath` and is otherwise
the catalog's builder: the same name, version (1.1.0), features
(`{'text': sentence}`), splits (`train`, about 30M sentences; `test`, about
300k) and directory (`<data_dir>/lm1b/1.1.0/`).

With a manual_dir the release is read from it, either extracted (the
`1-billion-word-language-modeling-benchmark-r13output/` folder) or as the
`.tar.gz` archive; without one it is downloaded from statmt.org (1.7 GB).
"""

import inspect
import os

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.datasets.lm1b import lm1b_dataset_builder as catalog

from transformer.errors import InvalidInput

# The catalog's release layout (its module-level constants).
DOWNLOAD_URL = catalog._DOWNLOAD_URL
TOP_LEVEL_DIR = catalog._TOP_LEVEL_DIR
ARCHIVE = os.path.basename(DOWNLOAD_URL)
TRAIN_GLOB = os.path.join(TOP_LEVEL_DIR, 'training-monolingual.tokenized.shuffled', 'news.en-*')
TEST_GLOB = os.path.join(
  TOP_LEVEL_DIR, 'heldout-monolingual.tokenized.shuffled', 'news.en.heldout-*'
)


class Lm1b(catalog.Builder, skip_registration=True):
  """The catalog's lm1b builder without TensorFlow; reads a local copy if given."""

  name = 'lm1b'
  SPLITS = ('train', 'test')  # Those `_split_generators` writes.

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:  # pylint: disable=invalid-overridden-method
    # As in ParallelText: TFDS's default needs the `importlib_resources` backport.
    return epath.Path(inspect.getfile(cls))

  def __init__(self, *, manual_dir: str | None = None, **kwargs):
    """`manual_dir`: a directory holding the release (extracted or archived), or None."""
    self._source_dir = os.path.expanduser(manual_dir) if manual_dir else None
    super().__init__(**kwargs)

  def _release_root(self, dl_manager: tfds.download.DownloadManager) -> epath.Path:
    """The directory that contains `TOP_LEVEL_DIR`."""
    if self._source_dir is not None:
      local = epath.Path(self._source_dir)
      if (local / TOP_LEVEL_DIR).is_dir():
        return local
      if (local / ARCHIVE).exists():
        return epath.Path(dl_manager.extract(local / ARCHIVE))
      raise InvalidInput(
        f'config.data.manual_dir={self._source_dir} holds neither {TOP_LEVEL_DIR}/ nor '
        f'{ARCHIVE} ({DOWNLOAD_URL}); put one of them there, or unset it to download lm1b.'
      )
    return epath.Path(dl_manager.download_and_extract(DOWNLOAD_URL))

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    root = self._release_root(dl_manager)
    generators = []
    for split, pattern in (('train', TRAIN_GLOB), ('test', TEST_GLOB)):
      paths = sorted(str(path) for path in root.glob(pattern))
      if not paths:
        raise InvalidInput(f'lm1b: no {split} files match {root / pattern}.')
      generators.append(tfds.core.SplitGenerator(name=split, gen_kwargs={'files': paths}))
    return generators
