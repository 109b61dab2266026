"""TFDS builder for a user's own parallel text files.

The directory (the builder's manual_dir) holds one file per split and language,
named `SPLIT.LANG` or `SPLIT.LANG.gz` (for example `train.en`, `train.de.gz`,
`val.en`, `val.de`, `test.en`, `test.de`), one sentence per line, UTF-8. The raw
split name `val` becomes the TFDS split `validation`.

Each example is `{'translation': {lang: text, ...}, 'index': line_index}` where
`index` is the 0-based line number in the original files, so that evaluation
can restore input order. Lines that are empty or whitespace only in some
language are dropped (counted and logged). All checks (required files, parallel
line counts, UTF-8) run before any example is written and raise `ValueError`.
"""

import inspect
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from absl import logging
from etils import epath

from transformer.datasets import text_files
from transformer.errors import InvalidInput


class ParallelText(tfds.core.GeneratorBasedBuilder):
  """Parallel text read from `SPLIT.LANG[.gz]` files in a directory.

  Subclasses (e.g. `Multi30k`) may fix the languages (`LANGUAGES`), restrict the
  accepted splits (`KNOWN_SPLITS`) and override `_source_files` to download.
  """

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
    'Put one file per split and language named SPLIT.LANG or SPLIT.LANG.gz '
    '(e.g. train.en, train.de, val.en, val.de) in the manual directory.'
  )

  # Fixed feature languages; None: the languages that have a train file.
  LANGUAGES: tuple[str, ...] | None = None
  # Splits that must exist for every required language.
  REQUIRED_SPLITS: tuple[str, ...] = ('train', 'validation')
  # Accepted splits (TFDS names); None: any split found.
  KNOWN_SPLITS: tuple[str, ...] | None = None

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:  # pylint: disable=invalid-overridden-method
    # TFDS's default resolves the package with `importlib_resources`, a
    # backport that is not installed on Python >= 3.9; the file is enough.
    return epath.Path(inspect.getfile(cls))

  def __init__(
    self,
    *,
    manual_dir: str | None,
    languages: Sequence[str] | None = None,
    **kwargs: Any,
  ):
    """Creates the builder.

    Args:
      manual_dir: Directory with the `SPLIT.LANG[.gz]` files.
      languages: Languages whose train and validation files are required (e.g.
        the source and target language). Default: all languages that have a
        train file. The features always hold every language with a train file.
      **kwargs: Passed to `tfds.core.GeneratorBasedBuilder` (`data_dir`,
        `file_format`, ...).

    Raises:
      ValueError: If required files are missing (all of them are listed).
    """
    self._source_dir = os.path.expanduser(manual_dir) if manual_dir else None
    self._files, self._languages = self.select_files(self._source_dir, languages)
    self._stats: dict[str, text_files.SplitStats] = {}
    super().__init__(**kwargs)

  @classmethod
  def select_files(
    cls, manual_dir: str | None, languages: Sequence[str] | None = None
  ) -> tuple[text_files.SplitFiles | None, list[str]]:
    """Finds and checks the source files of a directory.

    Args:
      manual_dir: Directory with the `SPLIT.LANG[.gz]` files.
      languages: Languages whose required splits must exist (default: all).

    Returns:
      ({split: {lang: path}} of the splits to prepare, feature languages).

    Raises:
      ValueError: If the directory is missing, required files are absent (all
        of them are listed), or fewer than two languages are found.
    """
    if manual_dir is None:
      raise InvalidInput(
        f'{cls.name} reads local files: set config.data.manual_dir to a '
        'directory of SPLIT.LANG or SPLIT.LANG.gz files.'
      )
    files = text_files.discover_files(manual_dir)
    if cls.KNOWN_SPLITS is not None:
      for split in sorted(set(files) - set(cls.KNOWN_SPLITS)):
        logging.info('%s: ignoring unknown split %r in %s.', cls.name, split, manual_dir)
        del files[split]
    feature_languages = list(cls.LANGUAGES or sorted(files.get('train', {})))
    required = list(languages) if languages else feature_languages
    missing = text_files.missing_files(files, cls.REQUIRED_SPLITS, required)
    if missing:
      raise InvalidInput(
        f'{manual_dir} (config.data.manual_dir) lacks required files: '
        f'{", ".join(missing)} (each may also be gzipped, with a .gz suffix).'
      )
    if len(feature_languages) < 2:
      raise InvalidInput(
        f'{manual_dir}: need train files for at least two languages, found '
        f'{feature_languages} (files are named SPLIT.LANG or SPLIT.LANG.gz).'
      )
    return cls._keep_parallel_splits(files, feature_languages), (feature_languages)

  @classmethod
  def _keep_parallel_splits(
    cls, files: text_files.SplitFiles, languages: Sequence[str]
  ) -> text_files.SplitFiles:
    """Keeps the feature languages, and splits with at least two of them."""
    kept_files = {}
    for split, paths in sorted(files.items()):
      kept = {lang: p for lang, p in paths.items() if lang in languages}
      for lang in sorted(set(paths) - set(kept)):
        logging.info(
          '%s: ignoring %s (language %r has no train file).', cls.name, paths[lang], lang
        )
      if len(kept) < 2:
        logging.warning(
          '%s: skipping split %r: it has files for %s, need two languages of %s.',
          cls.name,
          split,
          sorted(kept),
          list(languages),
        )
        continue
      absent = sorted(set(languages) - set(kept))
      if absent:
        logging.info(
          '%s: split %r has no files for %s (stored as empty strings).', cls.name, split, absent
        )
      kept_files[split] = kept
    return kept_files

  @classmethod
  def source_fingerprint(
    cls, manual_dir: str | None, languages: Sequence[str] | None = None
  ) -> str:
    """Returns the sha256 of the source files (names and bytes) and version.

    Args:
      manual_dir: Directory with the `SPLIT.LANG[.gz]` files.
      languages: As in the constructor (checks the required files).
    """
    files, _ = cls.select_files(manual_dir, languages)
    named = {
      os.path.basename(path): path for paths in (files or {}).values() for path in paths.values()
    }
    return text_files.fingerprint(named, salt=f'{cls.name}:{cls.VERSION}')

  @property
  def languages(self) -> list[str]:
    """The languages of the `translation` feature."""
    return list(self._languages)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=(
        'Parallel text. `index` is the 0-based line number in the source '
        "files; metadata holds each split's line count (`num_lines`), "
        'dropped empty lines (`num_dropped`) and languages with files '
        '(`split_languages`).'
      ),
      features=tfds.features.FeaturesDict(
        {
          'translation': tfds.features.Translation(languages=self._languages),
          'index': np.int64,
        }
      ),
      metadata=tfds.core.MetadataDict(),
    )

  def download_and_prepare(self, **kwargs: Any) -> None:
    """Checks local source files, then prepares (see TFDS).

    Local files are checked before TFDS creates any directory, so that a bad
    file leaves nothing behind; downloaded files are checked after download.
    """
    if self._files is not None and not self.data_path.exists():
      self._check_files(self._files)
    super().download_and_prepare(**kwargs)

  def _check_files(self, files: text_files.SplitFiles) -> None:
    """Reads every split once; raises on bad files (see `check_split`)."""
    for split, paths in sorted(files.items()):
      if split in self._stats:
        continue
      stats = self._stats[split] = text_files.check_split(split, paths)
      text_files.log_split_stats(self.name, split, stats)
      if split in self.REQUIRED_SPLITS and stats.num_lines == stats.num_dropped:
        raise InvalidInput(f'{self.name}: split {split!r} has no non-empty lines: {dict(paths)}.')

  def _source_files(self, dl_manager: tfds.download.DownloadManager) -> text_files.SplitFiles:
    """Returns {split: {lang: path}} to prepare (subclasses may download)."""
    del dl_manager  # Local files only.
    assert self._files is not None
    return self._files

  def _split_generators(
    self, dl_manager: tfds.download.DownloadManager
  ) -> dict[str, Iterator[tuple[int, dict[str, Any]]]]:
    files = dict(self._source_files(dl_manager))
    self._check_files(files)  # Every split, before any example is written.
    stats = {split: self._stats[split] for split in files}
    for split, split_stats in sorted(stats.items()):
      if split_stats.num_lines == split_stats.num_dropped:
        logging.warning('%s: skipping split %r: no non-empty lines.', self.name, split)
        del files[split], stats[split]
    self.info.metadata.update(
      {
        'num_lines': {s: st.num_lines for s, st in stats.items()},
        'num_dropped': {s: st.num_dropped for s, st in stats.items()},
        'split_languages': {s: sorted(files[s]) for s in stats},
      }
    )
    return {split: self._generate_examples(files[split]) for split in sorted(stats)}

  def _generate_examples(self, paths: Mapping[str, str]) -> Iterator[tuple[int, dict[str, Any]]]:
    for index, texts in text_files.iter_examples(paths, self._languages):
      yield index, {'translation': texts, 'index': index}
