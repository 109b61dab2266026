"""Translation and language-model datasets: TFDS builders and random-access data sources.

`get_data_source(config.data, split)` prepares `config.data.dataset` (once per
set of source files) and returns `builder.as_data_source(split)`. The datasets
are the entries of `registry.DATASETS`.
"""

from transformer.datasets.sources import (
  dataset_dir,
  document_text,
  download_files,
  example_index,
  fingerprint,
  get_data_source,
  is_monolingual,
  local_dataset_dir,
  prepare,
  read_examples,
  split_errors,
  split_names,
  split_num_lines,
  translation_pair,
)

__all__ = [
  'dataset_dir',
  'document_text',
  'download_files',
  'example_index',
  'fingerprint',
  'get_data_source',
  'is_monolingual',
  'local_dataset_dir',
  'prepare',
  'read_examples',
  'split_errors',
  'split_names',
  'split_num_lines',
  'translation_pair',
]
