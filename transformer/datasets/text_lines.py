"""TFDS builder for monolingual text files: the language model's local data.

The directory (the builder's manual_dir) holds one file per split for the
chosen language, named `SPLIT.LANG` or `SPLIT.LANG.gz` like the translation
files, so the English (or German, ...) side of a parallel corpus such as
Multi30k is language-model data as it is: `train.en.gz`, `val.en.gz`, ...
Files of other languages in the directory are ignored.

Each example is `{'text': line, 'index': line_index}` (`index`: 0-based line
number in the file); empty or whitespace-only lines are dropped (counted and
logged). Examples are stored in file order (TFDS shuffling disabled), so that
the input pipeline can join consecutive lines into longer documents
(`config.data.lines_per_document`).
"""

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from transformer.datasets import parallel_text, text_files
from transformer.errors import InvalidInput


class TextLines(parallel_text.ParallelText):
  """One language's `SPLIT.LANG[.gz]` files; one example per non-empty line.

  Shares file discovery, checks (UTF-8, required splits), split statistics and
  the fingerprint of the source files with `ParallelText`; only the file
  selection (one language) and the features differ.
  """

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
    'Put one file per split named SPLIT.LANG or SPLIT.LANG.gz (e.g. '
    'train.en, val.en) in the manual directory.'
  )

  @classmethod
  def select_files(
    cls, manual_dir: str | None, languages: Sequence[str] | None = None
  ) -> tuple[text_files.SplitFiles | None, list[str]]:
    """Finds the files of the one language in `languages` (see base class).

    Raises:
      ValueError: If not exactly one language is given, the directory is
        missing, or the train or validation file of the language is absent.
    """
    if languages is None or len(languages) != 1:
      raise InvalidInput(
        f'{cls.name} reads the files of one language, got {languages}: set config.data.target_lang.'
      )
    if manual_dir is None:
      raise InvalidInput(
        f'{cls.name} reads local files: set config.data.manual_dir to a '
        'directory of SPLIT.LANG or SPLIT.LANG.gz files.'
      )
    (language,) = languages
    found = text_files.discover_files(manual_dir)
    missing = text_files.missing_files(found, cls.REQUIRED_SPLITS, languages)
    if missing:
      raise InvalidInput(
        f'{manual_dir} (config.data.manual_dir) lacks required files: '
        f'{", ".join(missing)} (each may also be gzipped, with a .gz suffix).'
      )
    files = {
      split: {language: paths[language]}
      for split, paths in sorted(found.items())
      if language in paths
    }
    return files, [language]

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=(
        'Monolingual text, one example per non-empty line, in file order. '
        '`index` is the 0-based line number in the source file; metadata '
        "holds each split's line count (`num_lines`) and dropped empty "
        'lines (`num_dropped`).'
      ),
      features=tfds.features.FeaturesDict(
        {
          'text': tfds.features.Text(),
          'index': np.int64,
        }
      ),
      disable_shuffling=True,
      metadata=tfds.core.MetadataDict(),
    )

  def _generate_examples(self, paths: Mapping[str, str]) -> Iterator[tuple[int, dict[str, Any]]]:
    (language,) = self._languages
    for index, texts in text_files.iter_examples(paths, self._languages):
      yield index, {'text': texts[language], 'index': index}
