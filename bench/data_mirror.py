"""The cost of prepared data in a bucket: the first host's upload, every other host's copy.

  python bench/data_mirror.py --pairs=1015000 [--root=/tmp/data_mirror]

writes (once) bench/input_pipeline.py's corpus of `--pairs` training pairs (Multi30k's training
set repeated, each copy tagged so every pair is distinct), then, with
`config.data.data_dir=gs://BUCKET/tfds` on a fake-gcs-server started on 127.0.0.1
(tests/object_stores.py; nothing leaves the machine), times `datasets.prepare` three ways:
  * the first host: TFDS prepares into its local mirror, then `bucket_mirror.push` uploads it;
  * another host: `bucket_mirror.pull` copies it into an empty mirror, TFDS finds it ready;
  * that host again: one listing finds nothing new.
Reports seconds, files and bytes. The emulator keeps objects in memory on this machine: the
figures bound the client's own cost, not a cloud bucket's bandwidth.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'tests'))
sys.path.insert(0, str(REPO / 'bench'))
from transformer import path_checks  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--pairs', type=int, default=1_015_000, help='Training pairs (>= 1).')
  parser.add_argument('--root', default=os.path.join(tempfile.gettempdir(), 'data_mirror'))
  args = parser.parse_args()
  if problems := path_checks.output_dir_errors(args.root, '--root'):
    parser.error(problems[0])
  if args.pairs < 1:
    parser.error(f'--pairs={args.pairs} must be >= 1.')

  import input_pipeline  # bench/input_pipeline.py: the corpus.
  import object_stores  # tests/object_stores.py: the server.

  stores = object_stores.start()
  try:
    from configs import wmt14_ende_base
    from transformer import datasets, storage
    from transformer.datasets import bucket_mirror

    corpus = input_pipeline.write_corpus(
      Path(args.root) / f'corpus_{args.pairs}', args.pairs, input_pipeline.MULTI30K
    )
    config = wmt14_ende_base.get_config()
    config.data.update(dataset='parallel_text', manual_dir=str(corpus))
    config.data.data_dir = storage.join(stores.bucket('gs'), 'tfds')
    report = {'pairs': args.pairs}
    spent = {'push': 0.0, 'pull': 0.0}  # Of the mirror's own steps, inside `prepare`.
    for name in spent:
      step = getattr(bucket_mirror, name)

      def timed(url, step=step, name=name):
        started = time.perf_counter()
        try:
          return step(url)
        finally:
          spent[name] += time.perf_counter() - started

      setattr(bucket_mirror, name, timed)
    for host in ('first_host_prepare_and_push', 'other_host_pull', 'other_host_again'):
      cache = Path(args.root) / ('cache_first' if host.startswith('first') else 'cache_other')
      os.environ[bucket_mirror.CACHE_ENV] = str(cache)
      started = time.perf_counter()
      datasets.prepare(config.data)
      report[f'{host}_s'] = round(time.perf_counter() - started, 2)
      report[f'{host}_mirror_s'] = {name: round(s, 2) for name, s in spent.items()}
      spent.update(push=0.0, pull=0.0)
      print(f'{host}: {report[f"{host}_s"]} s', flush=True)
    sizes = storage.sizes(datasets.dataset_dir(config.data))
    report.update(files=len(sizes), bytes=sum(sizes.values()))
    print(json.dumps(report, indent=2))
  finally:
    stores.stop()


if __name__ == '__main__':
  main()
