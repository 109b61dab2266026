"""TFDS builder for Multi30k task 1 (image-caption translation, en/de/fr/cs).

Elliott et al. 2016, "Multi30K: Multilingual English-German Image
Descriptions"; data from https://github.com/multi30k/dataset
(`data/task1/raw/{split}.{lang}.gz`).

Splits: train (29,000), validation (1,014; the raw files are named `val`),
test_2016_flickr (1,000), and where their files exist test_2017_flickr,
test_2017_mscoco and test_2018_flickr. A test split with fewer than two
languages is skipped with a log line; languages without a file in a split are
stored as empty strings (see the `split_languages` metadata).

With a manual_dir the files are read from it (gzip or plain text, named like the
release: `train.en.gz`, `val.de`, ...); without one they are downloaded.
"""

import hashlib
from collections.abc import Sequence

import tensorflow_datasets as tfds
from absl import logging

from transformer.datasets import parallel_text, text_files

URL_TEMPLATE = (
  'https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{split}.{lang}.gz'
)
LANGUAGES = ('cs', 'de', 'en', 'fr')
REQUIRED_SPLITS = ('train', 'validation', 'test_2016_flickr')
OPTIONAL_SPLITS = ('test_2017_flickr', 'test_2017_mscoco', 'test_2018_flickr')


def source_urls() -> dict[tuple[str, str], str]:
  """Returns {(split, lang): url} of every file the builder may download."""
  return {
    (split, lang): URL_TEMPLATE.format(split=text_files.raw_split_name(split), lang=lang)
    for split in REQUIRED_SPLITS + OPTIONAL_SPLITS
    for lang in LANGUAGES
  }


def download_files() -> dict[str, str]:
  """{file name: URL} of the required files, named as in a manual_dir (`train.en.gz`, ...)."""
  return {
    f'{text_files.raw_split_name(split)}.{lang}.gz': url
    for (split, lang), url in source_urls().items()
    if split in REQUIRED_SPLITS
  }


class Multi30k(parallel_text.ParallelText):
  """Multi30k task 1: en, de, fr, cs parallel image captions."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
    'Optional: put the files of https://github.com/multi30k/dataset '
    'data/task1/raw (train.en.gz, val.de.gz, test_2016_flickr.fr.gz, ...; '
    'gzip or plain text) in the manual directory.'
  )
  LANGUAGES = LANGUAGES
  REQUIRED_SPLITS = REQUIRED_SPLITS
  KNOWN_SPLITS = REQUIRED_SPLITS + OPTIONAL_SPLITS

  def __init__(self, *, manual_dir: str | None = None, **kwargs):
    """Creates the builder; without `manual_dir` the files are downloaded."""
    super().__init__(manual_dir=manual_dir, **kwargs)

  @classmethod
  def select_files(
    cls, manual_dir: str | None, languages: Sequence[str] | None = None
  ) -> tuple[text_files.SplitFiles | None, list[str]]:
    """See base class; without `manual_dir`, files are downloaded later."""
    if manual_dir is None:
      return None, list(LANGUAGES)
    return super().select_files(manual_dir, languages)

  @classmethod
  def source_fingerprint(
    cls, manual_dir: str | None, languages: Sequence[str] | None = None
  ) -> str:
    """sha256 of the local files, or of the URLs when downloading."""
    if manual_dir is not None:
      return super().source_fingerprint(manual_dir, languages)
    digest = hashlib.sha256(f'{cls.name}:{cls.VERSION}'.encode())
    for url in sorted(source_urls().values()):
      digest.update(f'\0{url}'.encode())
    return digest.hexdigest()

  def _source_files(self, dl_manager: tfds.download.DownloadManager) -> text_files.SplitFiles:
    if self._files is not None:
      return self._files
    return self._keep_parallel_splits(self._download(dl_manager), LANGUAGES)

  def _download(self, dl_manager: tfds.download.DownloadManager) -> text_files.SplitFiles:
    """Downloads the required files, then each optional file that exists."""
    urls = source_urls()
    required = {
      f'{split}.{lang}': urls[split, lang] for split in REQUIRED_SPLITS for lang in LANGUAGES
    }
    paths = dl_manager.download(required)
    files: text_files.SplitFiles = {}
    for split in REQUIRED_SPLITS:
      files[split] = {lang: str(paths[f'{split}.{lang}']) for lang in LANGUAGES}
    for split in OPTIONAL_SPLITS:
      for lang in LANGUAGES:
        try:
          path = dl_manager.download(urls[split, lang])
        except Exception as e:  # pylint: disable=broad-except
          # Not every test set exists for every language (e.g. 2017 has no cs).
          logging.info('multi30k: %s.%s is not available (%s); skipping it.', split, lang, e)
          continue
        files.setdefault(split, {})[lang] = str(path)
    return files
