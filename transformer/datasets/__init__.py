"""Translation datasets: TFDS builders and random-access data sources.

`get_data_source(config.data, split)` prepares `config.data.dataset` (once per
set of source files) and returns `builder.as_data_source(split)`.
"""

from transformer.datasets.sources import (
    DATASETS,
    dataset_dir,
    example_index,
    fingerprint,
    get_data_source,
    prepare,
    split_num_lines,
    translation_pair,
)

__all__ = [
    'DATASETS',
    'dataset_dir',
    'example_index',
    'fingerprint',
    'get_data_source',
    'prepare',
    'split_num_lines',
    'translation_pair',
]
