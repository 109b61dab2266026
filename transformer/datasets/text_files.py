"""Parallel text files named `SPLIT.LANG` or `SPLIT.LANG.gz`.

Shared by the `parallel_text` and `multi30k` builders: file discovery, checks
(parallel line counts, UTF-8, required files), reading examples, and the
fingerprint of the source files that keys prepared data on disk.

One sentence per line; lines are split on `\\n` only (a trailing `\\r` is
removed), so the line numbering matches `wc -l` and editors. A file is read as
gzip when it starts with the gzip magic bytes, whatever its name.
"""

import dataclasses
import gzip
import hashlib
import itertools
import os
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import BinaryIO

from absl import logging

from transformer.errors import InvalidInput

# Raw split names mapped to TFDS split names (the Multi30k release says `val`).
SPLIT_ALIASES = {'val': 'validation'}

_FILE_RE = re.compile(r'^(?P<split>\w+)\.(?P<lang>[A-Za-z][\w-]*?)(?:\.gz)?$')
_GZIP_MAGIC = b'\x1f\x8b'

# {split: {lang: path}}.
SplitFiles = dict[str, dict[str, str]]


@dataclasses.dataclass(frozen=True)
class SplitStats:
  """What the check of one split found.

  Attributes:
    num_lines: Lines in each file of the split (they are all equal).
    num_dropped: Lines dropped because some language's line is empty or
      whitespace only.
  """

  num_lines: int
  num_dropped: int


def split_name(raw_name: str) -> str:
  """Maps a raw split name (e.g. `val`) to its TFDS split name."""
  return SPLIT_ALIASES.get(raw_name, raw_name)


def raw_split_name(name: str) -> str:
  """Inverse of `split_name`: the file stem of a TFDS split (e.g. `val`)."""
  for raw, mapped in SPLIT_ALIASES.items():
    if mapped == name:
      return raw
  return name


def discover_files(directory: str) -> SplitFiles:
  """Finds `SPLIT.LANG` / `SPLIT.LANG.gz` files in `directory` (not recursive).

  Args:
    directory: Directory to scan.

  Returns:
    {split: {lang: path}}, split names mapped through `SPLIT_ALIASES`.

  Raises:
    ValueError: If the directory does not exist, or if two files give the same
      split and language (e.g. `val.en` and `val.en.gz`, or `val.en` and
      `validation.en`).
  """
  if not os.path.isdir(directory):
    raise InvalidInput(
      f'Parallel text directory {directory!r} (config.data.manual_dir) does not exist.'
    )
  files: SplitFiles = {}
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    match = _FILE_RE.match(name)
    if not match or not os.path.isfile(path):
      continue
    split, lang = split_name(match['split']), match['lang']
    previous = files.setdefault(split, {}).get(lang)
    if previous is not None:
      raise InvalidInput(
        f'Both {previous} and {path} give split {split!r}, language '
        f'{lang!r}; keep only one of them.'
      )
    files[split][lang] = path
  return files


def missing_files(files: SplitFiles, splits: Iterable[str], languages: Iterable[str]) -> list[str]:
  """Lists the `SPLIT.LANG` names (raw split names) absent from `files`."""
  return [
    f'{raw_split_name(split)}.{lang}'
    for split in splits
    for lang in languages
    if lang not in files.get(split, {})
  ]


def _open(path: str) -> BinaryIO:
  """Opens `path` for binary reading, decompressing gzip transparently."""
  with open(path, 'rb') as f:
    magic = f.read(2)
  if magic == _GZIP_MAGIC:
    return gzip.open(path, 'rb')  # type: ignore[return-value]
  return open(path, 'rb')


def _lines_of_gzip_or_plain(path: str, f: BinaryIO) -> Iterator[bytes]:
  """The raw lines of `f`; corrupt or truncated gzip data is an error naming the file and line."""
  line_number = 0
  while True:
    try:
      raw = f.readline()
    except (EOFError, OSError, zlib.error) as e:  # BadGzipFile is an OSError.
      raise InvalidInput(
        f'{path}: corrupt or truncated gzip data at line {line_number + 1} '
        f'({type(e).__name__}: {e}); lines 1-{line_number} read. Replace the file.'
      ) from e
    if not raw:
      return
    line_number += 1
    yield raw


def read_lines(path: str) -> Iterator[str]:
  """Yields the lines of a UTF-8 text file, without line terminators.

  Args:
    path: Plain or gzip text file.

  Yields:
    One decoded line per `\\n`-terminated line (a final line without `\\n`
    counts too). A UTF-8 byte order mark at the start is removed.

  Raises:
    ValueError: On invalid UTF-8 or corrupt gzip data, naming the file and the
      1-based line number.
  """
  with _open(path) as f:
    for line_number, raw in enumerate(_lines_of_gzip_or_plain(path, f), start=1):
      raw = raw.rstrip(b'\n').rstrip(b'\r')
      try:
        text = raw.decode('utf-8')
      except UnicodeDecodeError as e:
        raise InvalidInput(
          f'{path}: line {line_number} is not valid UTF-8 ({e.reason} at '
          f'byte {e.start} of the line).'
        ) from e
      if line_number == 1:
        text = text.removeprefix('\ufeff')
      yield text


def _is_blank(text: str | None) -> bool:
  return text is not None and not text.strip()


def check_split(split: str, paths: Mapping[str, str]) -> SplitStats:
  """Reads every file of a split once and checks that they are parallel.

  Args:
    split: Split name (for messages).
    paths: {lang: path} of the split.

  Returns:
    Line count and the number of lines that will be dropped as empty.

  Raises:
    ValueError: On invalid UTF-8 (file and line), or when the files' line
      counts differ (one message naming both files and both counts).
  """
  langs = sorted(paths)
  counts = dict.fromkeys(langs, 0)
  dropped = 0
  readers = [read_lines(paths[lang]) for lang in langs]
  for lines in itertools.zip_longest(*readers):
    for lang, line in zip(langs, lines, strict=True):
      if line is not None:
        counts[lang] += 1
    if any(_is_blank(line) for line in lines):
      dropped += 1
  first = langs[0]
  for lang in langs[1:]:
    if counts[lang] != counts[first]:
      raise InvalidInput(
        f'Parallel files of split {split!r} have different line counts: '
        f'{paths[first]} has {counts[first]} lines but {paths[lang]} has '
        f'{counts[lang]} lines.'
      )
  return SplitStats(num_lines=counts[first], num_dropped=dropped)


def iter_examples(
  paths: Mapping[str, str], languages: Sequence[str]
) -> Iterator[tuple[int, dict[str, str]]]:
  """Yields `(line_index, {lang: text})` for the non-empty lines of a split.

  Args:
    paths: {lang: path} of a split, already checked with `check_split`.
    languages: All languages of the dataset; those without a file in `paths`
      get the empty string.

  Yields:
    The 0-based line index and the text of every language. Lines where some
    present language is empty or whitespace only are skipped.
  """
  present = sorted(paths)
  readers = [read_lines(paths[lang]) for lang in present]
  for index, lines in enumerate(zip(*readers, strict=True)):
    if any(not line.strip() for line in lines):
      continue
    texts = dict.fromkeys(languages, '')
    texts.update(zip(present, lines, strict=True))
    yield index, texts


def fingerprint(paths: Mapping[str, str], salt: str = '') -> str:
  """Returns the sha256 (hex) of the files' names and bytes, plus `salt`.

  Args:
    paths: {name: path}; the name (e.g. `train.en`), not the directory, enters
      the hash, so moving a directory keeps its fingerprint.
    salt: Extra text hashed first (e.g. the builder name and version).
  """
  digest = hashlib.sha256(salt.encode('utf-8'))
  for name in sorted(paths):
    digest.update(f'\0{name}\0{os.path.getsize(paths[name])}\0'.encode())
    with open(paths[name], 'rb') as f:
      for block in iter(lambda: f.read(1 << 20), b''):
        digest.update(block)
  return digest.hexdigest()


def log_split_stats(name: str, split: str, stats: SplitStats) -> None:
  """Logs a split's line count and dropped empty pairs."""
  logging.info('%s: split %s has %d lines.', name, split, stats.num_lines)
  if stats.num_dropped:
    logging.warning(
      '%s: split %s: dropped %d of %d lines that are empty or whitespace only in some language.',
      name,
      split,
      stats.num_dropped,
      stats.num_lines,
    )
