"""train.py of two checkouts, run in turn on the same config: their training speed side by side.

  python bench/train_side_by_side.py --before=../main --after=. --rounds=3 --train_args="\
      --config=configs/default.py --config.data.manual_dir=../shared/data/multi30k \
      --config.num_train_steps=25 --config.log_every_steps=5"

Runs `python train.py ARGS --workdir=<fresh folder>` in each checkout, alternating (before,
after, before, after, ...), so that both see the same load; reads each run's metrics.jsonl
and prints, per run, the median steps/s and target tokens/s over its log windows but the
first (which compiles) and the median time waiting for input per step (`input_wait_ms`,
where the checkout logs it), then the after/before ratio of each round. The load average is
printed before each run: compare the ratios, not the rates, on a shared machine.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _median_after_first(rows: list[dict], key: str) -> float | None:
  values = [r[key] for r in rows if key in r][1:]
  return statistics.median(values) if values else None


def run(checkout: Path, args: list[str], workdir: Path) -> dict:
  done = subprocess.run(
    [sys.executable, 'train.py', *args, f'--workdir={workdir}'],
    cwd=checkout,
    capture_output=True,
    text=True,
    check=False,
  )
  if done.returncode:
    raise RuntimeError(f'train.py in {checkout} failed:\n{done.stderr[-3000:]}')
  with open(workdir / 'metrics.jsonl') as f:
    rows = [r for r in map(json.loads, f) if 'train_loss' in r]
  return {
    key: _median_after_first(rows, key)
    for key in ('steps_per_sec', 'tokens_per_sec', 'input_wait_ms')
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--before', type=Path, required=True, help='Checkout measured first.')
  parser.add_argument('--after', type=Path, required=True, help='Checkout measured second.')
  parser.add_argument('--rounds', type=int, default=3, help='Runs of each checkout.')
  parser.add_argument('--train_args', required=True, help="train.py's arguments, one string.")
  options = parser.parse_args()
  root = Path(tempfile.mkdtemp(prefix='side_by_side_'))
  fmt = lambda value, spec: '-' if value is None else format(value, spec)
  ratios = []
  for round_ in range(1, options.rounds + 1):
    results = {}
    for name in ('before', 'after'):
      load = os.getloadavg()
      workdir = root / f'{name}_{round_}'
      args = shlex.split(options.train_args)
      results[name] = run(getattr(options, name).resolve(), args, workdir)
      r = results[name]
      print(
        f'round {round_} {name:6}: {fmt(r["steps_per_sec"], ".3f")} steps/s, '
        f'{fmt(r["tokens_per_sec"], ",.0f")} tokens/s, input wait '
        f'{fmt(r["input_wait_ms"], ".1f")} ms/step (load average before: '
        f'{load[0]:.1f} {load[1]:.1f} {load[2]:.1f})',
        flush=True,
      )
    ratios.append(results['after']['steps_per_sec'] / results['before']['steps_per_sec'])
    print(f'round {round_} after / before: {ratios[-1]:.3f}x steps/s', flush=True)
  print(
    f'after / before over {len(ratios)} rounds: median {statistics.median(ratios):.3f}x '
    f'(from {min(ratios):.3f}x to {max(ratios):.3f}x)'
  )


if __name__ == '__main__':
  main()
