"""The named datasets (`config.data.dataset`): one entry each, the one place describing each.

An entry says which TFDS builder prepares the dataset, whether it is parallel or
monolingual text, which of its languages a run requires, how its vocabulary
file is named and what is downloaded without a `config.data.manual_dir`.
`sources.py` prepares and opens any entry the same way, config validation
accepts every name here, and the tokenizer names the vocabulary from it.

A new dataset is one file (its builder, in this package) and one entry in
`DATASETS` (docs/data.md, "Adding a dataset").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
import tensorflow_datasets as tfds

from transformer.datasets import lm1b, multi30k, parallel_text, text_lines, wmt14
from transformer.errors import InvalidInput

DataConfig = ml_collections.ConfigDict  # `config.data`.


def _all_languages(data: DataConfig) -> None:
  """None: the builder requires every language of its own (Multi30k's are fixed)."""
  return None


def source_and_target(data: DataConfig) -> list[str]:
  """The configured pair: parallel files of other languages may be missing."""
  return [data.source_lang, data.target_lang]


def target_only(data: DataConfig) -> list[str]:
  """The one language of monolingual text (`config.data.target_lang`)."""
  return [data.target_lang]


def sorted_pair(data: DataConfig) -> str:
  """'de-en' for either direction: one vocabulary serves en->de and de->en."""
  return '-'.join(sorted([data.source_lang, data.target_lang]))


@dataclasses.dataclass(frozen=True)
class Dataset:
  """How one named dataset is prepared, read and named.

  A builder of local source files (`catalog=False`) is created as
  `builder(manual_dir=..., languages=required_languages(config.data),
  data_dir=<data_dir>/<name>-<fingerprint[:16]>, file_format=..., **builder_options)`
  and must offer `builder.source_fingerprint(manual_dir, languages)` (a hex
  sha256 of its source files): changed files are prepared again, in a new
  folder. A catalog builder (`catalog=True`, the TFDS catalog's layout) is
  created as `builder(manual_dir=..., data_dir=<data_dir>, file_format=...,
  **builder_options)` and keyed by its name.
  """

  builder: type[tfds.core.DatasetBuilder]
  monolingual: bool = False  # One language's text (a language model's); else parallel text.
  catalog: bool = False  # At <data_dir>/<tfds name>/<version>/, keyed by the name (not files).
  # The languages whose files a local builder requires (None: all of its own).
  required_languages: Callable[[DataConfig], Sequence[str] | None] = _all_languages
  builder_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # The <languages> of the vocabulary's file name, spm_<languages>_<vocab_size>_....model.
  vocabulary_languages: Callable[[DataConfig], str] = sorted_pair
  # {file name: URL} of what is downloaded without a manual_dir (where the same names are read).
  download_files: Callable[[], Mapping[str, str]] = dict


DATASETS: dict[str, Dataset] = {
  'multi30k': Dataset(multi30k.Multi30k, download_files=multi30k.download_files),
  'parallel_text': Dataset(parallel_text.ParallelText, required_languages=source_and_target),
  'text_lines': Dataset(
    text_lines.TextLines,
    monolingual=True,
    required_languages=target_only,
    vocabulary_languages=lambda data: data.target_lang,
  ),
  'wmt14_translate/de-en': Dataset(
    wmt14.Wmt14Translate,
    catalog=True,
    builder_options={'config': 'de-en'},
    download_files=lambda: wmt14.archive_urls('de-en'),
  ),
  'wmt14_translate/fr-en': Dataset(
    wmt14.Wmt14Translate,
    catalog=True,
    builder_options={'config': 'fr-en'},
    download_files=lambda: wmt14.archive_urls('fr-en'),
  ),
  'lm1b': Dataset(
    lm1b.Lm1b,
    monolingual=True,
    catalog=True,
    vocabulary_languages=lambda data: 'lm1b',
    download_files=lambda: {lm1b.ARCHIVE: lm1b.DOWNLOAD_URL},
  ),
}


def get(data: DataConfig) -> Dataset:
  """The entry of `config.data.dataset`; an unknown name is an error listing the known ones."""
  if data.dataset not in DATASETS:
    raise InvalidInput(
      f'config.data.dataset={data.dataset!r} is not supported; use one of {tuple(DATASETS)}.'
    )
  return DATASETS[data.dataset]
