"""The TFDS catalog's `wmt14_translate` (de-en, fr-en), preparable from a local copy of the release.

The catalog builder downloads its archives from statmt.org. This subclass is the
catalog's builder (same name, version, configs, features, splits, parsers and
directory `<data_dir>/wmt14_translate/<pair>/<version>/`), except that with a
manual_dir every archive is read from it, by the name it has on statmt.org:

  training-parallel-europarl-v7.tgz    training/europarl-v7.de-en.{de,en}, ...fr-en...
  training-parallel-commoncrawl.tgz    commoncrawl.de-en.{de,en}, ...fr-en...
  training-parallel-nc-v9.tgz          training/news-commentary-v9.de-en.{de,en}, ...
  training-parallel-un.tgz             un/undoc.2000.fr-en.{fr,en} (fr-en only)
  training-giga-fren.tar               giga-fren.release2.fixed.{fr,en}.gz (fr-en only)
  dev.tgz                              dev/newstest2013.{de,en}, dev/newstest2014-deen-*.sgm, ...

(`archive_urls(pair)` lists those a pair needs, with their URLs; a manual_dir that lacks
any is an error listing every one missing). Without one, the archives are downloaded as
the catalog does.
"""

import inspect
import os
import shutil
import tarfile
import tempfile

import tensorflow_datasets as tfds
import tree
from absl import logging
from etils import epath
from tensorflow_datasets.translate import wmt, wmt14

from transformer.errors import InvalidInput


def archive_urls(pair: str) -> dict[str, str]:
  """{statmt.org file name: URL} of the release archives `pair` (e.g. 'de-en') is built from."""
  builder_config = next(c for c in wmt14.Wmt14Translate.BUILDER_CONFIGS if c.name == pair)
  source = builder_config.language_pair[0]
  urls = {}
  for split_subsets in wmt14.Wmt14Translate._subsets.fget(None).values():  # pylint: disable=protected-access
    for name in split_subsets:
      subset = wmt.DATASET_MAP[name]
      if subset.target == builder_config.language_pair[1] and source in subset.sources:
        urls.update((os.path.basename(url), url) for url in subset.get_url(source))
  return dict(sorted(urls.items()))


def archive_names(pair: str) -> list[str]:
  """The release archives (statmt.org file names) that `pair` (e.g. 'de-en') is built from."""
  return list(archive_urls(pair))


class _LocalArchives:
  """The part of a `DownloadManager` the WMT builder uses: URLs -> local archives, extracted.

  Extracts with `tarfile` (TFDS's extractor opens files through TensorFlow)
  into `<extract_dir>/<archive name>/` (under `<data_dir>/downloads/`), once.
  """

  def __init__(self, manual_dir: str, extract_dir: str):
    self.manual_dir = manual_dir
    self._extract_dir = extract_dir

  def _extracted(self, url: str) -> str:
    name = os.path.basename(url)
    archive = os.path.join(self.manual_dir, name)
    if not os.path.exists(archive):
      raise InvalidInput(
        f'config.data.manual_dir={self.manual_dir} lacks {name} (the file at {url}); '
        'unset config.data.manual_dir to download WMT14.'
      )
    target = os.path.join(self._extract_dir, name)
    if not os.path.isdir(target):
      logging.info('Extracting %s to %s.', archive, target)
      tmp = tempfile.mkdtemp(dir=self._extract_dir, prefix=f'.tmp-{name}-')
      try:
        with tarfile.open(archive) as tar:
          tar.extractall(tmp, filter='data')
        os.rename(tmp, target)
      except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target

  def download_and_extract(self, urls):
    os.makedirs(self._extract_dir, exist_ok=True)
    return tree.map_structure(self._extracted, urls)

  def extract(self, paths):
    return paths  # Only the manually downloaded files of other years' subsets come here.


class Wmt14Translate(wmt14.Wmt14Translate, skip_registration=True):
  """The catalog's wmt14_translate builder; reads the release archives from a manual_dir."""

  name = 'wmt14_translate'
  SPLITS = ('train', 'validation', 'test')  # The catalog's (newstest2013, newstest2014).

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:  # pylint: disable=invalid-overridden-method
    # As in ParallelText: TFDS's default needs the `importlib_resources` backport.
    return epath.Path(inspect.getfile(cls))

  def __init__(self, *, manual_dir: str | None = None, **kwargs):
    """`manual_dir`: a directory holding the release archives, or None (download)."""
    self._source_dir = os.path.expanduser(manual_dir) if manual_dir else None
    super().__init__(**kwargs)

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    if self._source_dir is not None:
      pair = self.builder_config.name
      missing = {
        name: url
        for name, url in archive_urls(pair).items()
        if not os.path.exists(os.path.join(self._source_dir, name))
      }
      if missing:
        raise InvalidInput(
          f'config.data.manual_dir={self._source_dir} lacks {len(missing)} of the '
          f'{len(archive_urls(pair))} release archives of wmt14_translate/{pair}; put them '
          'there (or unset config.data.manual_dir to download them):\n'
          + '\n'.join(f'  {name}  ({url})' for name, url in missing.items())
        )
      extract_dir = os.path.join(os.fspath(dl_manager.download_dir), 'extracted')
      dl_manager = _LocalArchives(self._source_dir, extract_dir)
    return super()._split_generators(dl_manager)
