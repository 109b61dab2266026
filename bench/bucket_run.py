"""A short run on gs:// against its local twin: does a bucket cost more than its requests?

  python bench/bucket_run.py [--repeats=5] [--steps=20] [--checkpoint_every=10] [--root=DIR]

The run of issue 52: configs/tiny.py for `--steps` steps with a checkpoint every
`--checkpoint_every`, on a synthetic Multi30k-shaped corpus; trained `--repeats` times into a
new gs:// workdir (fake-gcs-server on 127.0.0.1 behind the tests' front, tests/object_stores.py;
nothing leaves the machine) and as many times into a new local workdir, alternating, so that the
machine's load falls on both alike, after one local run that prepares the data and is not
counted. Every run must end 0 within `--timeout` seconds (a hang is
reported as such, with the run's last log lines). Prints each run's wall seconds and the
median gs:// / local ratio; `--out` writes them as JSON. The emulator keeps objects in memory on
this machine: the ratio bounds the client's own cost, not a cloud bucket's latency.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'tests'))
from transformer import errors, outputs, path_checks  # noqa: E402


def _corpus(root: Path) -> tuple[Path, Path]:
  """A synthetic corpus in Multi30k's raw layout (the tests' own), and a data_dir for it."""
  import conftest  # pylint: disable=g-import-not-at-top  (tests/conftest.py: the corpus)

  manual = root / 'manual'
  manual.mkdir(parents=True, exist_ok=True)
  for offset, (split, size) in enumerate(conftest.SYNTHETIC_MULTI30K_SIZES.items()):
    en, de = zip(*conftest.synthetic_captions(size, seed=1000 * offset), strict=True)
    for lang, lines in {'en': en, 'de': de, 'fr': en, 'cs': en}.items():
      conftest.write_lines(manual / f'{split}.{lang}.gz', lines)
  return manual, root / 'tfds'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--repeats', type=int, default=5, help='Runs of each kind (>= 1).')
  parser.add_argument('--steps', type=int, default=20, help='Training steps per run (>= 1).')
  parser.add_argument('--checkpoint_every', type=int, default=10, help='Steps between saves.')
  parser.add_argument('--timeout', type=float, default=600.0, help='Seconds before a run hangs.')
  parser.add_argument('--root', default=os.path.join(tempfile.gettempdir(), 'bucket_run'))
  parser.add_argument('--out', default=None, help='A JSON file for the figures.')
  args = parser.parse_args()
  problems = path_checks.output_dir_errors(args.root, '--root')
  if args.out:
    problems += path_checks.output_errors(args.out, '--out', {})
  for name in ('repeats', 'steps', 'checkpoint_every'):
    if getattr(args, name) < 1:
      problems.append(f'--{name}={getattr(args, name)} must be >= 1.')
  if not args.timeout > 0:
    problems.append(f'--timeout={args.timeout} must be > 0.')
  if problems:
    parser.error(problems[0])

  import object_stores  # pylint: disable=g-import-not-at-top  (tests/object_stores.py)

  root = Path(args.root)
  manual, data_dir = _corpus(root)
  stores = object_stores.start()
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  seconds = {'gs': [], 'local': []}
  # A first local run, not counted, prepares the data (and fills the OS's caches) for all.
  schedule = [(-1, 'local')] + [(r, k) for r in range(args.repeats) for k in ('gs', 'local')]
  try:
    for repeat, kind in schedule:
      workdir = (
        stores.bucket('gs') + '/run'
        if kind == 'gs'
        else tempfile.mkdtemp(prefix=f'local{repeat}-', dir=root)
      )
      command = [
        sys.executable,
        'train.py',
        '--config=configs/tiny.py',
        f'--workdir={workdir}',
        f'--config.data.manual_dir={manual}',
        f'--config.data.data_dir={data_dir}',
        f'--config.num_train_steps={args.steps}',
        f'--config.checkpoint_every_steps={args.checkpoint_every}',
      ]
      started = time.monotonic()
      try:
        result = subprocess.run(
          command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout
        )
      except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b'')[-2000:]
        raise errors.Refusal(
          f'The {kind} run {repeat} hung: no end after {args.timeout:g} s. Its log ends: {tail!r}'
        ) from None
      if result.returncode != 0:
        raise errors.Refusal(
          f'The {kind} run {repeat} failed ({result.returncode}): {result.stderr[-2000:]}'
        )
      if repeat < 0:
        continue
      seconds[kind].append(round(time.monotonic() - started, 2))
      print(f'{kind:5} run {repeat}: {seconds[kind][-1]:.1f} s', flush=True)
  finally:
    stores.stop()
  ratio = statistics.median(seconds['gs']) / statistics.median(seconds['local'])
  report = {**vars(args), 'seconds': seconds, 'median_ratio_gs_to_local': round(ratio, 3)}
  print(f'median gs:// / local: {ratio:.2f}')
  if args.out:
    outputs.write(args.out, json.dumps(report, indent=2) + '\n', '--out')


if __name__ == '__main__':
  try:
    main()
  except errors.Refusal as e:  # A hang or a failed run: one message.
    sys.exit(f'bucket_run.py: error: {e}')
