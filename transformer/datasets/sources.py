"""Prepares the datasets of the registry (`registry.DATASETS`) and opens their splits for reading.

Every dataset is prepared and opened the same way, from its registry entry.

Prepared data lives under `config.data.data_dir` (with `~` expanded). For the
builders of local files (`multi30k`, `parallel_text`, `text_lines`) it is keyed by its source files:
`<data_dir>/<name>-<fingerprint[:16]>/`, where the fingerprint is the sha256 of
the source files' names and bytes (of the URLs when Multi30k is downloaded).
Changed files therefore get a new directory and are prepared again; unchanged
files reuse the prepared data. The catalog builders (WMT14, lm1b) live at the usual TFDS
place `<data_dir>/wmt14_translate/<pair>/<version>/` (`<data_dir>/lm1b/<version>/`)
and are keyed by their TFDS name and version.

Without `config.data.manual_dir`, a dataset that is not prepared yet is downloaded;
first one connection to each server (`download_files`) is tried, and if it fails the
run stops within seconds with one error listing every file to put in a manual_dir
instead, with its URL (TFDS would retry each file for minutes).
"""

import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_collections
import tensorflow_datasets as tfds
from absl import logging
from tensorflow_datasets.proto import tf_example_pb2

from transformer import storage
from transformer.datasets import bucket_mirror, registry
from transformer.errors import InvalidInput, Unreachable

FILE_FORMAT = 'array_record'
# Seconds to wait for a server to answer before the download is given up as offline.
CONNECT_TIMEOUT_SECONDS = 10.0


def _manual_dir(data_config: ml_collections.ConfigDict) -> str | None:
  manual_dir = data_config.manual_dir
  return os.path.abspath(os.path.expanduser(manual_dir)) if manual_dir else None


def _data_root(data_config: ml_collections.ConfigDict) -> str:
  """`config.data.data_dir`: absolute, or a bucket URL as it is."""
  return storage.resolve(data_config.data_dir)


def local_dataset_dir(data_config: ml_collections.ConfigDict) -> str:
  """`dataset_dir` on this host's disk: itself, or for a bucket its local mirror."""
  path = dataset_dir(data_config)
  return bucket_mirror.local_path(path) if storage.is_url(path) else path


def is_monolingual(data_config: ml_collections.ConfigDict) -> bool:
  """Whether `config.data.dataset` is monolingual text (a language model's)."""
  return registry.get(data_config).monolingual


def fingerprint(data_config: ml_collections.ConfigDict) -> str:
  """Returns the key of the dataset's source (hex sha256 of its files, or its TFDS name).

  Args:
    data_config: `config.data`.

  Raises:
    ValueError: For an unknown dataset, or missing required source files.
  """
  entry = registry.get(data_config)
  if entry.catalog:
    return data_config.dataset.replace('/', '-')
  return entry.builder.source_fingerprint(
    _manual_dir(data_config), entry.required_languages(data_config)
  )


def dataset_dir(data_config: ml_collections.ConfigDict) -> str:
  """Returns the directory keyed by the source files (holds data, vocab).

  `<data_dir>/<name>-<fingerprint[:16]>` for the local builders,
  `<data_dir>/<name>-<pair>` for catalog datasets (vocabularies only; TFDS keeps
  their data in `<data_dir>/<name>/<pair>/`).

  Args:
    data_config: `config.data`.
  """
  key = fingerprint(data_config)
  if registry.get(data_config).catalog:
    return storage.join(_data_root(data_config), key)
  return storage.join(_data_root(data_config), f'{data_config.dataset}-{key[:16]}')


def prepare(data_config: ml_collections.ConfigDict) -> tfds.core.DatasetBuilder:
  """Prepares the dataset if needed and returns its builder.

  Prepares into `dataset_dir(data_config)` (array_record files) unless that
  directory already holds prepared data for the same source files. Checks that
  `config.data.source_lang` and `config.data.target_lang` are languages of a
  translation dataset.

  Args:
    data_config: `config.data`.

  Returns:
    The prepared `tfds.core.DatasetBuilder`.

  Raises:
    ValueError: For an unknown dataset, bad source files (see `ParallelText`),
      or languages the dataset does not have.
  """
  entry, name = registry.get(data_config), data_config.dataset
  manual_dir = _manual_dir(data_config)
  # A bucket's prepared data is read from this host's copy (`bucket_mirror`): the catalog
  # builders' TFDS folder (<data_dir>/<tfds name>), the others' dataset_dir.
  root, remote = _data_root(data_config), None
  if storage.is_url(root):
    config_name = entry.builder_options.get('config')
    remote = (
      storage.join(root, entry.builder.name, *([config_name] if config_name else []))
      if entry.catalog
      else dataset_dir(data_config)
    )
    bucket_mirror.pull(remote)
  if entry.catalog:
    builder = entry.builder(
      manual_dir=manual_dir,
      data_dir=bucket_mirror.local_path(root) if remote else root,
      file_format=FILE_FORMAT,
      **entry.builder_options,
    )
  else:
    builder = entry.builder(
      manual_dir=manual_dir,
      languages=entry.required_languages(data_config),
      data_dir=local_dataset_dir(data_config),
      file_format=FILE_FORMAT,
      **entry.builder_options,
    )
  if not entry.monolingual:
    _check_languages(data_config, available=languages(builder))
  if manual_dir is None and not builder.data_path.exists():
    _check_servers_reachable(name, download_files(data_config))
  try:
    builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=manual_dir, try_download_gcs=False)
    )
  except FileExistsError:
    # Another process prepared the same data meanwhile (two runs started at once on one
    # data_dir): TFDS's rename of this copy into place found that one there. Read it.
    if not os.path.isfile(os.path.join(builder.data_dir, 'dataset_info.json')):
      raise
    logging.info('%s was prepared by another process meanwhile; reading it.', builder.data_dir)
    return prepare(data_config)
  if remote is not None and jax.process_index() == 0:
    bucket_mirror.push(remote)  # Prepared here first: the other hosts copy it.
  logging.info('Dataset %s ready in %s.', name, builder.data_dir)
  return builder


def download_files(data_config: ml_collections.ConfigDict) -> dict[str, str]:
  """{file name: URL} of what `config.data.dataset` downloads without a manual_dir.

  The same names in a folder passed as `config.data.manual_dir` are read instead.
  Empty for the datasets of local files only.
  """
  return dict(registry.get(data_config).download_files())


def _check_servers_reachable(name: str, files: Mapping[str, str]) -> None:
  """Connects once to each server of `files`; if one does not answer, lists every file.

  Any HTTP answer (even an error status) counts as reachable: only a failed
  connection (no network, DNS, a proxy that refuses) stops the run, within
  `CONNECT_TIMEOUT_SECONDS`.
  """
  by_server = {}
  for url in files.values():
    by_server.setdefault(urllib.parse.urlsplit(url)[:2], url)
  for url in by_server.values():
    try:
      urllib.request.urlopen(
        urllib.request.Request(url, method='HEAD'), timeout=CONNECT_TIMEOUT_SECONDS
      ).close()
    except urllib.error.HTTPError:
      continue  # The server answered.
    except (OSError, ValueError) as e:  # URLError, timeouts and refused connections.
      reason = getattr(e, 'reason', e)
      raise Unreachable(
        f'Cannot download {name}: {url} cannot be reached ({reason}). Without a network, put '
        f'these {len(files)} files in a folder and pass it as --config.data.manual_dir:\n'
        + '\n'.join(f'  {file}  ({file_url})' for file, file_url in files.items())
      ) from None


def languages(builder: tfds.core.DatasetBuilder) -> list[str]:
  """Returns the languages of a translation builder."""
  features = builder.info.features
  if isinstance(features, tfds.features.Translation):  # Catalog (WMT).
    return list(features.languages)
  return list(features['translation'].languages)


def _check_languages(
  data_config: ml_collections.ConfigDict,
  available: Sequence[str],
  where: str = '',
) -> None:
  for key in ('source_lang', 'target_lang'):
    lang = data_config[key]
    if lang not in available:
      raise InvalidInput(
        f'config.data.{key}={lang!r} is not a language of dataset '
        f'{data_config.dataset!r}{where}; available: {sorted(available)}.'
      )
  if data_config.source_lang == data_config.target_lang:
    raise InvalidInput(
      f'config.data.source_lang and config.data.target_lang are both {data_config.source_lang!r}.'
    )


def split_languages(builder: tfds.core.DatasetBuilder, split: str) -> list[str]:
  """Languages with source files in `split` (all, for catalog datasets)."""
  metadata = builder.info.metadata or {}
  by_split = metadata.get('split_languages', {})
  return list(by_split.get(split, languages(builder)))


def split_names(data_config: ml_collections.ConfigDict) -> list[str] | None:
  """The splits `config.data` has, known without preparing it; None where that takes reading.

  A catalog dataset's are fixed (its builder's `SPLITS`); a local one's are those of its
  source files in `config.data.manual_dir` (Multi30k's to download: its known ones). None
  when they cannot be listed (no such folder, required files missing: the run that prepares
  the data says so).
  """
  entry = registry.get(data_config)
  if entry.catalog:
    splits = getattr(entry.builder, 'SPLITS', None)
    return None if splits is None else sorted(splits)
  try:
    files, _ = entry.builder.select_files(
      _manual_dir(data_config), entry.required_languages(data_config)
    )
  except (InvalidInput, OSError):
    return None
  if files is None:  # Downloaded later.
    known = getattr(entry.builder, 'KNOWN_SPLITS', None)
    return None if known is None else sorted(known)
  return sorted(files)


def split_errors(
  data_config: ml_collections.ConfigDict, split: str, name: str, note: str = ''
) -> list[str]:
  """[An error] if `config.data` has no split `split` (`split_names`).

  `name` names the value (`--split`), `note` follows it (e.g. where a default comes from).
  """
  splits = split_names(data_config)
  if splits is None or split in splits:
    return []
  where = f' in {data_config.manual_dir} (config.data.manual_dir)' if data_config.manual_dir else ''
  return [
    f'{name}={split!r}{note} is not a split of dataset {data_config.dataset!r}{where}; '
    f'its splits are {splits}.'
  ]


def split_num_lines(data_config: ml_collections.ConfigDict, split: str) -> int | None:
  """Lines in the split's source files, counting dropped empty lines.

  Args:
    data_config: `config.data`.
    split: Split name.

  Returns:
    The line count, or None for catalog datasets (which have no line index).
  """
  metadata = prepare(data_config).info.metadata or {}
  return metadata.get('num_lines', {}).get(split)


def get_data_source(data_config: ml_collections.ConfigDict, split: str) -> Any:
  """Returns a random-access source of `split` (prepares the data if needed).

  Elements are dicts: `{'translation': {lang: bytes}, 'index': int}` for the
  local translation builders, `{lang: bytes}` for the catalog ones; use
  `translation_pair` / `example_index` to read them. Language-model datasets
  give `{'text': bytes, 'index': int}` (`text_lines`) or `{'text': bytes}`
  (`lm1b`); use `document_text`.

  Args:
    data_config: `config.data`.
    split: Split name, e.g. 'train', 'validation', 'test_2016_flickr'.

  Raises:
    ValueError: For an unknown split, or a split without the configured source
      or target language.
  """
  builder = prepare(data_config)
  if split not in builder.info.splits:
    raise InvalidInput(
      f'Split {split!r} is not in dataset {data_config.dataset!r}; '
      f'available: {sorted(builder.info.splits)}.'
    )
  if not is_monolingual(data_config):
    _check_languages(data_config, split_languages(builder, split), f' split {split!r}')
  return builder.as_data_source(split)


def read_examples(source: Any, positions: list[int]) -> list[dict[str, Any]]:
  """The examples at `positions` of a TFDS data source: nested dicts of their byte strings.

  Only the text (bytes) features are kept, so `translation_pair` and
  `document_text` read them as they read `source[i]`. Parses the stored
  `tf.train.Example` protos directly: TFDS's generic decoding (`source[i]`)
  would take most of the preparation's time (vocabulary training, encoding;
  docs/benchmarks.md, "Input pipeline"). Other sources are read as they are.
  """
  raw = getattr(source, 'data_source', None)
  if raw is None:
    return [source[i] for i in positions]
  examples = []
  for record in raw.__getitems__(positions):
    example: dict[str, Any] = {}
    for key, feature in tf_example_pb2.Example.FromString(record).features.feature.items():
      if feature.WhichOneof('kind') != 'bytes_list':
        continue
      *parents, name = key.split('/')
      node = example
      for parent in parents:
        node = node.setdefault(parent, {})
      values = feature.bytes_list.value
      node[name] = values[0] if values else b''
    examples.append(example)
  return examples


def translation_pair(
  example: Mapping[str, Any], source_lang: str, target_lang: str
) -> tuple[str, str]:
  """Returns the (source, target) strings of a data source element."""
  texts = example.get('translation', example)
  return _text(texts[source_lang]), _text(texts[target_lang])


def document_text(example: Mapping[str, Any]) -> str:
  """Returns the text of a language-model data source element."""
  return _text(example['text'])


def example_index(example: Mapping[str, Any], position: int) -> int:
  """Returns the original line index, or `position` when there is none."""
  if 'index' in example:
    return int(example['index'])
  return position


def _text(value: bytes | str) -> str:
  return value.decode('utf-8') if isinstance(value, bytes) else value
