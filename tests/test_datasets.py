"""Tests of the TFDS builders (parallel_text, multi30k) and data preparation."""

import io
import logging
import os
import pathlib
import re
import urllib.request

import pytest
import tensorflow_datasets as tfds
from conftest import synthetic_pairs, write_lines

from transformer import datasets
from transformer.datasets import multi30k, parallel_text, text_files


def _texts(source, lang):
  return {ex['index']: ex['translation'][lang].decode() for ex in source}


def test_parallel_text_splits_counts_and_val_renamed(tmp_path, write_parallel_corpus, config_for):
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 40, 'val': 9, 'test': 7})
  # Mix plain and gzip files.
  os.remove(corpus / 'test.de')
  pairs = synthetic_pairs(7, seed=2000)
  write_lines(corpus / 'test.de.gz', [p[1] for p in pairs])
  config = config_for(tmp_path / 'tfds', corpus)

  builder = datasets.prepare(config.data)

  assert {s: builder.info.splits[s].num_examples for s in builder.info.splits} == {
    'train': 40,
    'validation': 9,
    'test': 7,
  }
  assert datasets.sources.languages(builder) == ['de', 'en']
  test = datasets.get_data_source(config.data, 'test')
  assert _texts(test, 'de') == {i: p[1] for i, p in enumerate(pairs)}
  validation = datasets.get_data_source(config.data, 'validation')
  lines = (corpus / 'val.en').read_text().splitlines()
  assert _texts(validation, 'en') == dict(enumerate(lines))
  assert datasets.split_num_lines(config.data, 'validation') == 9


def test_differing_line_counts_name_both_files_and_counts(
  tmp_path, write_parallel_corpus, config_for
):
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 12, 'val': 5})
  write_lines(corpus / 'train.de', (corpus / 'train.de').read_text().splitlines()[:11])
  config = config_for(tmp_path / 'tfds', corpus)

  with pytest.raises(ValueError) as error:
    datasets.prepare(config.data)

  message = str(error.value)
  assert str(corpus / 'train.de') in message and str(corpus / 'train.en') in message
  assert re.search(r'train\.de has 11 lines', message)
  assert re.search(r'train\.en has 12 lines', message)
  assert not (tmp_path / 'tfds').exists()  # Nothing written.


def test_missing_required_files_are_all_listed(tmp_path, config_for):
  corpus = tmp_path / 'raw'
  write_lines(corpus / 'train.en', ['a'])
  write_lines(corpus / 'test.de', ['b'])
  config = config_for(tmp_path / 'tfds', corpus)

  with pytest.raises(ValueError, match='lacks required files') as error:
    datasets.prepare(config.data)

  listed = str(error.value).split('files: ')[1].split(' (')[0]
  assert listed.split(', ') == ['train.de', 'val.en', 'val.de']
  assert not (tmp_path / 'tfds').exists()


def test_invalid_utf8_names_file_and_line(tmp_path, write_parallel_corpus, config_for):
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 6, 'val': 3})
  write_lines(corpus / 'val.de', b'gut\nauch gut\nkaputt \xff\xfe\n')
  config = config_for(tmp_path / 'tfds', corpus)

  with pytest.raises(ValueError, match=re.escape(f'{corpus / "val.de"}: line 3 ')):
    datasets.prepare(config.data)
  assert not (tmp_path / 'tfds').exists()  # Nothing written.


def test_empty_pairs_are_dropped_and_counted(tmp_path, config_for, caplog):
  corpus = tmp_path / 'raw'
  pairs = synthetic_pairs(10)
  en = [p[0] for p in pairs]
  de = [p[1] for p in pairs]
  en[2], de[5], en[7], de[7] = '', '   \t', ' ', ''
  write_lines(corpus / 'train.en', en)
  write_lines(corpus / 'train.de', de)
  write_lines(corpus / 'val.en', en[:3])
  write_lines(corpus / 'val.de', de[:3])
  config = config_for(tmp_path / 'tfds', corpus)

  with caplog.at_level(logging.INFO):
    builder = datasets.prepare(config.data)

  assert builder.info.splits['train'].num_examples == 7
  assert builder.info.metadata['num_dropped'] == {'train': 3, 'validation': 1}
  assert builder.info.metadata['num_lines'] == {'train': 10, 'validation': 3}
  train = datasets.get_data_source(config.data, 'train')
  assert sorted(_texts(train, 'en')) == [0, 1, 3, 4, 6, 8, 9]
  assert _texts(train, 'de')[6] == de[6]
  assert any('dropped 3 of 10' in r.getMessage() for r in caplog.records)


def test_fingerprint_reuses_unchanged_files_and_prepares_changed_ones(
  tmp_path, write_parallel_corpus, config_for, monkeypatch
):
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 8, 'val': 4})
  config = config_for(tmp_path / 'tfds', corpus)
  first_dir = datasets.dataset_dir(config.data)
  datasets.prepare(config.data)
  assert pathlib.Path(first_dir, 'parallel_text', '1.0.0', 'dataset_info.json').exists()

  def fail(*args, **kwargs):
    raise AssertionError('unchanged files must not be prepared again')

  with monkeypatch.context() as patch:
    patch.setattr(parallel_text.ParallelText, '_split_generators', fail)
    assert datasets.prepare(config.data).data_dir.startswith(first_dir)

  lines = (corpus / 'train.de').read_text().splitlines()
  lines[3] = 'GEAENDERT .'
  write_lines(corpus / 'train.de', lines)
  second_dir = datasets.dataset_dir(config.data)
  assert second_dir != first_dir
  assert datasets.fingerprint(config.data)[:16] in second_dir
  train = datasets.get_data_source(config.data, 'train')
  assert _texts(train, 'de')[3] == 'GEAENDERT .'
  assert pathlib.Path(first_dir).exists()  # The old data is left alone.


def test_two_processes_preparing_the_same_data_at_once_both_read_it(
  tmp_path, write_parallel_corpus, config_for, monkeypatch
):
  # Two runs started at once on one data_dir: the other prepares the same folder while this one
  # prepares, and renames its copy into place first (the rename of this one then finds it).
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 8, 'val': 4})
  config = config_for(tmp_path / 'tfds', corpus)
  original = parallel_text.ParallelText._split_generators
  raced = []

  def racing(self, *args, **kwargs):
    if not raced:
      raced.append(True)
      datasets.prepare(config.data)  # The other process, done before this one renames.
    return original(self, *args, **kwargs)

  monkeypatch.setattr(parallel_text.ParallelText, '_split_generators', racing)
  builder = datasets.prepare(config.data)
  assert raced and builder.info.splits['train'].num_examples == 8
  assert len(_texts(datasets.get_data_source(config.data, 'train'), 'en')) == 8
  leftovers = [p.name for p in pathlib.Path(builder.data_dir).parent.iterdir()]
  assert leftovers == ['1.0.0'], leftovers  # This copy's temporary folder is gone.


def test_languages_are_validated(tmp_path, write_parallel_corpus, config_for):
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 5, 'val': 2}, langs=('en', 'de', 'fr'))
  config = config_for(tmp_path / 'tfds', corpus, source_lang='fr', target_lang='en')
  source = datasets.get_data_source(config.data, 'train')
  assert datasets.translation_pair(source[0], 'fr', 'en')[0].startswith('fr: ')

  config.data.source_lang = 'xx'
  with pytest.raises(ValueError, match='lacks required files: train.xx, val.xx'):
    datasets.prepare(config.data)

  m30k = config_for(tmp_path / 'tfds', None, 'multi30k', source_lang='xx')
  with pytest.raises(ValueError, match=r"config.data.source_lang='xx'.*\['cs', 'de', 'en', 'fr'\]"):
    datasets.prepare(m30k.data)


def test_wmt14_is_wired_and_checks_languages_before_downloading(tmp_path, config_for):
  config = config_for(tmp_path / 'tfds', None, 'wmt14_translate/de-en', source_lang='fr')
  assert datasets.dataset_dir(config.data) == str(tmp_path / 'tfds' / 'wmt14_translate-de-en')
  with pytest.raises(ValueError, match=r"source_lang='fr' .* available: \['de', 'en'\]"):
    datasets.prepare(config.data)
  assert not (tmp_path / 'tfds' / 'wmt14_translate').exists()


def test_unknown_split_and_dataset(tmp_path, write_parallel_corpus, config_for):
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 5, 'val': 2})
  config = config_for(tmp_path / 'tfds', corpus)
  with pytest.raises(ValueError, match=r"Split 'test' .* available: \['train', 'validation'\]"):
    datasets.get_data_source(config.data, 'test')
  config.data.dataset = 'nope'
  with pytest.raises(ValueError, match="config.data.dataset='nope'"):
    datasets.prepare(config.data)


def test_split_with_a_missing_language_keeps_empty_strings(
  tmp_path, write_parallel_corpus, config_for
):
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 5, 'val': 2}, langs=('en', 'de', 'fr'))
  write_lines(corpus / 'test.en', ['a', 'b'])
  write_lines(corpus / 'test.fr', ['c', 'd'])
  config = config_for(tmp_path / 'tfds', corpus)
  builder = datasets.prepare(config.data)
  assert builder.info.metadata['split_languages']['test'] == ['en', 'fr']
  with pytest.raises(ValueError, match=r"target_lang='de' .* split 'test'; available: \['en'"):
    datasets.get_data_source(config.data, 'test')


@pytest.mark.full_data  # The real corpus' line counts and first line.
def test_multi30k_real_corpus(multi30k_data_dir, multi30k_dir, config_for):
  config = config_for(multi30k_data_dir, multi30k_dir, 'multi30k')
  builder = datasets.prepare(config.data)
  counts = {s: builder.info.splits[s].num_examples for s in builder.info.splits}
  assert counts == {'train': 29_000, 'validation': 1_014, 'test_2016_flickr': 1_000}
  assert datasets.sources.languages(builder) == ['cs', 'de', 'en', 'fr']
  test = datasets.get_data_source(config.data, 'test_2016_flickr')
  first = next(ex for ex in test if ex['index'] == 0)
  assert (
    first['translation']['en'].decode()
    == text_files.read_lines(str(multi30k_dir / 'test_2016_flickr.en.gz')).__next__()
  )


def _fake_release(directory: pathlib.Path) -> dict[str, pathlib.Path]:
  """Writes a tiny Multi30k release; returns {file name: path}."""
  files = {}
  sizes = {'train': 12, 'val': 4, 'test_2016_flickr': 3}
  for split, size in sizes.items():
    pairs = synthetic_pairs(size, seed=len(split))
    for lang in multi30k.LANGUAGES:
      text = [f'{lang} {p[0]}' for p in pairs]
      files[f'{split}.{lang}.gz'] = write_lines(directory / f'{split}.{lang}.gz', text)
  for lang in ('en', 'de', 'fr'):  # 2017 has no Czech; 2018 only English here.
    files[f'test_2017_flickr.{lang}.gz'] = write_lines(
      directory / f'test_2017_flickr.{lang}.gz', [f'{lang} x', f'{lang} y']
    )
  files['test_2018_flickr.en.gz'] = write_lines(directory / 'test_2018_flickr.en.gz', ['z'])
  return files


def test_multi30k_download_path_with_fake_download(tmp_path, config_for, monkeypatch, caplog):
  files = _fake_release(tmp_path / 'remote')
  requested = []

  def fake_download(self, url_or_urls):
    del self

    def one(url):
      requested.append(url)
      assert url.startswith(
        'https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/'
      )
      name = url.rsplit('/', 1)[1]
      if name not in files:
        raise OSError(f'404 Not Found: {url}')
      return files[name]

    if isinstance(url_or_urls, dict):
      return {k: one(u) for k, u in url_or_urls.items()}
    return one(url_or_urls)

  monkeypatch.setattr(tfds.download.DownloadManager, 'download', fake_download)
  # The server answers the connection made before any download (`sources.download_files`).
  monkeypatch.setattr(urllib.request, 'urlopen', lambda request, timeout: io.BytesIO())
  config = config_for(tmp_path / 'tfds', None, 'multi30k')

  with caplog.at_level(logging.INFO):
    builder = datasets.prepare(config.data)

  counts = {s: builder.info.splits[s].num_examples for s in builder.info.splits}
  assert counts == {'train': 12, 'validation': 4, 'test_2016_flickr': 3, 'test_2017_flickr': 2}
  assert builder.info.metadata['split_languages']['test_2017_flickr'] == ['de', 'en', 'fr']
  assert any(u.endswith('/val.de.gz') for u in requested)
  assert any("skipping split 'test_2018_flickr'" in r.getMessage() for r in caplog.records)
  source = datasets.get_data_source(config.data, 'test_2017_flickr')
  assert sorted(datasets.translation_pair(ex, 'en', 'de') for ex in source) == [
    ('en x', 'de x'),
    ('en y', 'de y'),
  ]
  # The key of downloaded data is the URLs: preparing again downloads nothing.
  requested.clear()
  datasets.prepare(config.data)
  assert requested == []


def test_multi30k_manual_dir_plain_text_and_missing_files(tmp_path, config_for):
  files = _fake_release(tmp_path / 'gz')
  manual = tmp_path / 'plain'
  for name, path in files.items():
    if not name.startswith('test_2016_flickr.cs'):
      lines = list(text_files.read_lines(str(path)))
      write_lines(manual / name.removesuffix('.gz'), lines)
  config = config_for(tmp_path / 'tfds', manual, 'multi30k')
  with pytest.raises(ValueError, match=r'lacks required files: test_2016_flickr\.cs \('):
    datasets.prepare(config.data)

  write_lines(manual / 'test_2016_flickr.cs', ['a', 'b', 'c'])
  builder = datasets.prepare(config.data)
  assert builder.info.splits['test_2016_flickr'].num_examples == 3
  assert builder.info.splits['test_2017_flickr'].num_examples == 2
