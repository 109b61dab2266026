"""Input pipeline throughput, preparation time and peak memory at a config's batch.

  python bench/input_pipeline.py --pairs=1015000 --workers=0,1,2

writes (once) a corpus of `--pairs` training pairs under `--root` (Multi30k's
training set repeated, each copy's lines tagged `[k]` so that every pair is
distinct, plus Multi30k's validation and test sets, as `train/val/test.{en,de}`
for `parallel_text`), prepares it with `--config`'s batch (default
`configs/wmt14_ende_base.py`: 24,576 tokens a side, rows of 256; vocabulary
`--vocab_size`), then, in a fresh process per worker count, reads
`--batches` batches of `tasks.get_task(config.model.architecture).train_iterator` after the
first one. Reports:

  * preparation: TFDS build, SentencePiece training, encoding into ids (each
    timed; encoding is 0 where the pipeline has no such step, e.g. on main);
  * first-batch latency, batches/s, real (non-pad) source + target tokens/s in
    all and per worker (per core of the main process when workers=0), the real
    share of the target slots;
  * peak resident memory of the reading process (VmHWM) and, with
    workers, the resident memory of the workers at the end.

Figures are comparable only side by side on one machine: report `uptime` with them.
"""

import argparse
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from transformer import path_checks  # noqa: E402

MULTI30K = REPO.parent / 'shared' / 'data' / 'multi30k'


def write_corpus(directory: Path, pairs: int, multi30k: Path) -> Path:
  """Writes `train/val/test.{en,de}` with `pairs` training pairs, once."""
  done = directory / 'DONE'
  if done.exists():
    return directory
  directory.mkdir(parents=True, exist_ok=True)
  for lang in ('en', 'de'):
    with gzip.open(multi30k / f'train.{lang}.gz', 'rt', encoding='utf-8') as f:
      base = f.read().splitlines()
    with open(directory / f'train.{lang}', 'w', encoding='utf-8') as out:
      written, copy = 0, 0
      while written < pairs:
        for line in base[: pairs - written]:
          out.write(f'[{copy}] {line}\n')
        written += min(len(base), pairs - written)
        copy += 1
    for split, raw in (('val', 'val'), ('test', 'test_2016_flickr')):
      with gzip.open(multi30k / f'{raw}.{lang}.gz', 'rt', encoding='utf-8') as f:
        (directory / f'{split}.{lang}').write_text(f.read(), encoding='utf-8')
  done.touch()
  return directory


def make_config(args, workers: int | None = None):
  """The config measured: `--config` on the corpus, with the vocabulary asked for."""
  spec = importlib.util.spec_from_file_location('bench_config', REPO / args.config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.data.dataset = 'parallel_text'
  config.data.manual_dir = str(corpus_dir(args))
  config.data.data_dir = str(Path(args.root) / 'data')
  config.data.test_split = 'test'
  config.vocab_size = args.vocab_size
  config.data.spm_train_sentences = args.spm_sentences
  if workers is not None and 'num_workers' in config.data:
    config.data.num_workers = workers
  return config


def corpus_dir(args) -> Path:
  return Path(args.root) / f'corpus_{args.pairs}'


def prepare(args) -> dict:
  """Builds the TFDS data, trains the vocabulary, encodes ids; times each."""
  from transformer import datasets, tasks, tokenizer

  config = make_config(args)
  times = {}
  start = time.perf_counter()
  datasets.prepare(config.data)
  times['tfds_build_s'] = time.perf_counter() - start
  start = time.perf_counter()
  vocab = tokenizer.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
  times['vocab_s'] = time.perf_counter() - start
  start = time.perf_counter()
  # Pipelines that read prepared ids encode here; main's tokenizes while training.
  prepare_ids = getattr(tasks.translation, 'prepare_ids', None)
  if prepare_ids is not None:
    prepare_ids(config.data, vocab)
  times['encode_s'] = time.perf_counter() - start
  times['preparation_s'] = times['vocab_s'] + times['encode_s']
  return times


def peak_rss_kb() -> int:
  """This process's peak resident memory (VmHWM; `ru_maxrss` would include the parent's,
  as Linux keeps it across exec)."""
  with open('/proc/self/status') as f:
    return next(int(line.split()[1]) for line in f if line.startswith('VmHWM:'))


def measure(args) -> dict:
  """Reads batches in this process (a fresh one per worker count); returns figures."""
  from absl import flags

  from transformer import tasks, tokenizer

  flags.FLAGS.mark_as_parsed()  # Grain reads its absl flags when it starts workers.
  config = make_config(args, args.measure_workers)
  vocab = tokenizer.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
  start = time.perf_counter()
  it = tasks.get_task(config.model.architecture).train_iterator(
    config.data, vocab, seed=config.seed
  )
  batch = next(it)
  first = time.perf_counter() - start
  real = slots = 0
  start = time.perf_counter()
  for _ in range(args.batches):
    batch = next(it)
    real += int((batch['src_segments'] > 0).sum() + (batch['tgt_segments'] > 0).sum())
    slots += batch['tgt_segments'].size
  seconds = time.perf_counter() - start
  worker_rss = 0
  try:
    import psutil

    worker_rss = sum(c.memory_info().rss for c in psutil.Process().children(recursive=True))
  except ImportError:
    pass
  close = getattr(it, 'close', None)
  if close:
    close()
  tokens_per_s = real / seconds
  cores = max(1, args.measure_workers)
  return {
    'workers': args.measure_workers,
    'first_batch_s': round(first, 2),
    'batches_per_s': round(args.batches / seconds, 3),
    'real_tokens_per_s': round(tokens_per_s),
    'real_tokens_per_s_per_worker': round(tokens_per_s / cores),
    'real_target_share': round(float((batch['tgt_segments'] > 0).mean()), 4),
    'peak_rss_main_mb': round(peak_rss_kb() / 1024),
    'rss_workers_end_mb': round(worker_rss / 2**20),
    'rows_x_len': list(batch['tgt_tokens'].shape),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--pairs', type=int, default=1_015_000, help='Training pairs.')
  parser.add_argument('--root', default='/tmp/issue12', help='Corpus and prepared data.')
  parser.add_argument('--config', default='configs/wmt14_ende_base.py', help='Batch of.')
  parser.add_argument('--vocab_size', type=int, default=16000, help='Shared vocabulary.')
  parser.add_argument(
    '--spm_sentences',
    type=int,
    default=1_000_000,
    help='Sentences sampled to train the vocabulary.',
  )
  parser.add_argument('--workers', default='0', help='Comma-separated worker counts.')
  parser.add_argument('--batches', type=int, default=200, help='Timed batches after the first.')
  parser.add_argument('--measure_workers', type=int, default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if problems := path_checks.output_dir_errors(args.root, '--root'):
    parser.error(problems[0])

  if args.measure_workers is not None:
    print(json.dumps(measure(args)))
    return
  write_corpus(corpus_dir(args), args.pairs, MULTI30K)
  result = {
    'pairs': args.pairs,
    'config': args.config,
    'vocab_size': args.vocab_size,
    'load_average': os.getloadavg(),
  }
  result.update({k: round(v, 1) for k, v in prepare(args).items()})
  print(json.dumps(result), flush=True)
  for workers in [int(w) for w in args.workers.split(',')]:
    out = subprocess.run(
      [sys.executable, __file__, *sys.argv[1:], f'--measure_workers={workers}'],
      check=True,
      capture_output=True,
      text=True,
      cwd=REPO,
    ).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row['load_average'] = os.getloadavg()
    print(json.dumps(row), flush=True)


if __name__ == '__main__':
  main()
