"""Two checkouts of the code, the same runs: are their outputs the same? (A refactor's proof.)

  python bench/same_outputs.py --before=/tmp/before --after=. \
      --manual_dir=../shared/data/multi30k --root=/tmp/same_outputs

In each checkout, one after the other and at the same paths (so that every path written into
a file is the same): `configs/tiny.py` (a translation model, 60 steps) and `configs/lm_tiny.py`
(a language model, 40 steps) are trained by train.py and scored by eval.py. Then, for each
run, the two checkouts' outputs are compared:
  * metrics.jsonl and eval/metrics rows, every value but the timings (wall seconds, steps and
    tokens per second, input wait);
  * config.json (a key one checkout has and the other lacks is listed apart: a field added
    between them, which older runs read with its `before` value);
  * provenance.jsonl's recorded inputs (the data's fingerprint, the vocabulary's hash);
  * every file eval.py wrote (translations byte for byte; its JSON without timings);
  * every array of every checkpoint, bit for bit, and the data position beside them;
  * TensorBoard's scalars (tag, step, value).
Prints each comparison and exits non-zero if anything differs.
"""

import json
import os
import shutil
import subprocess
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformer import errors, path_checks  # noqa: E402

_BEFORE = flags.DEFINE_string('before', None, 'The checkout before the change.', required=True)
_AFTER = flags.DEFINE_string('after', None, 'The checkout after the change.', required=True)
_MANUAL_DIR = flags.DEFINE_string('manual_dir', None, 'Multi30k raw files.', required=True)
_ROOT = flags.DEFINE_string('root', '/tmp/same_outputs', 'Where the runs are written (emptied).')

RUNS = {  # name -> (config, train.py overrides)
  'tiny': ('configs/tiny.py', []),
  'lm_tiny': ('configs/lm_tiny.py', []),
}
TIMING_KEYS = {'wall_seconds', 'steps_per_sec', 'tokens_per_sec', 'input_wait_ms', 'seconds'}


def _is_timing(key: str) -> bool:
  """Wall-clock figures: they differ between any two runs."""
  return key in TIMING_KEYS or key.endswith(('_per_sec', '_seconds', '_ms'))


def _run(checkout: str, root: str, name: str) -> str:
  """Trains and evaluates run `name` with the code of `checkout`; returns where it was moved."""
  config, overrides = RUNS[name]
  workdir = os.path.join(root, 'run')
  common = [f'--config.data.manual_dir={os.path.abspath(_MANUAL_DIR.value)}']
  common.append(f'--config.data.data_dir={os.path.join(root, "tfds")}')
  env = {**os.environ, 'PYTHONHASHSEED': '0'}
  for command in (
    [sys.executable, 'train.py', f'--config={config}', f'--workdir={workdir}', *common, *overrides],
    [sys.executable, 'eval.py', f'--workdir={workdir}'],
  ):
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode:
      sys.exit(f'{" ".join(command)} failed in {checkout}:\n{done.stderr[-3000:]}')
  moved = os.path.join(root, f'{name}-{os.path.basename(os.path.abspath(checkout))}')
  os.rename(workdir, moved)
  shutil.rmtree(os.path.join(root, 'tfds'))  # The next checkout prepares and trains anew.
  return moved


def _rows(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [
      {k: v for k, v in json.loads(line).items() if not _is_timing(k)} for line in f if line.strip()
    ]


def _without_timings(value):
  if isinstance(value, dict):
    return {k: _without_timings(v) for k, v in value.items() if not _is_timing(k)}
  if isinstance(value, list):
    return [_without_timings(v) for v in value]
  return value


def _checkpoint_arrays(workdir: str) -> dict[str, object]:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  arrays = {}
  directory = os.path.join(workdir, 'checkpoints')
  for step in sorted(os.listdir(directory), key=lambda s: int(s) if s.isdigit() else -1):
    state = os.path.join(directory, step, 'state')
    if not os.path.isdir(state):
      continue
    with ocp.PyTreeCheckpointer() as checkpointer:
      tree = checkpointer.restore(state)
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in leaves:
      arrays[f'{step}/{jax.tree_util.keystr(path)}'] = np.asarray(leaf)
    data = os.path.join(directory, step, 'data')
    for dirpath, _, files in os.walk(data):
      for file in files:
        with open(os.path.join(dirpath, file), 'rb') as f:
          arrays[f'{step}/data/{os.path.relpath(os.path.join(dirpath, file), data)}'] = f.read()
  return arrays


def _scalars(workdir: str) -> list[tuple]:
  from tensorboard.backend.event_processing import (  # pylint: disable=g-import-not-at-top
    event_accumulator,
  )

  found = []
  directory = os.path.join(workdir, 'tensorboard')
  accumulator = event_accumulator.EventAccumulator(directory, size_guidance={'scalars': 0})
  accumulator.Reload()
  for tag in sorted(accumulator.Tags()['scalars']):
    if _is_timing(tag.rsplit('/', 1)[-1]):
      continue
    found += [(tag, e.step, e.value) for e in accumulator.Scalars(tag)]
  return found


def _compare(name: str, before: str, after: str) -> list[str]:
  import numpy as np  # pylint: disable=g-import-not-at-top

  differences = []

  def check(what: str, a, b) -> None:
    same = a == b
    print(f'  {name}: {what}: {"same" if same else "DIFFERENT"}')
    if not same:
      differences.append(f'{name}: {what}')

  check(
    'metrics.jsonl (timings left out)',
    _rows(f'{before}/metrics.jsonl'),
    _rows(f'{after}/metrics.jsonl'),
  )
  with open(f'{before}/config.json') as f:
    config_before = json.load(f)
  with open(f'{after}/config.json') as f:
    config_after = json.load(f)
  flat_before, flat_after = _flatten(config_before), _flatten(config_after)
  added = sorted(set(flat_after) - set(flat_before))
  removed = sorted(set(flat_before) - set(flat_after))
  if added or removed:
    print(f'  {name}: config.json keys only after: {added}; only before: {removed}')
  shared = set(flat_before) & set(flat_after)
  check(
    'config.json (shared keys)',
    {k: flat_before[k] for k in shared},
    {k: flat_after[k] for k in shared},
  )
  check(
    'provenance inputs',
    [r.get('inputs') for r in _rows(f'{before}/provenance.jsonl')],
    [r.get('inputs') for r in _rows(f'{after}/provenance.jsonl')],
  )
  eval_before, eval_after = (
    sorted(os.listdir(f'{before}/eval')),
    sorted(os.listdir(f'{after}/eval')),
  )
  check('eval/ file names', eval_before, eval_after)
  for file in sorted(set(eval_before) & set(eval_after)):
    a, b = f'{before}/eval/{file}', f'{after}/eval/{file}'
    if file.endswith('.json'):
      with open(a) as fa, open(b) as fb:
        check(
          f'eval/{file} (timings left out)',
          _without_timings(json.load(fa)),
          _without_timings(json.load(fb)),
        )
    elif file.endswith('.jsonl'):
      check(f'eval/{file} (timings left out)', _rows(a), _rows(b))
    else:
      with open(a, 'rb') as fa, open(b, 'rb') as fb:
        check(f'eval/{file} bytes', fa.read(), fb.read())
  arrays_before, arrays_after = _checkpoint_arrays(before), _checkpoint_arrays(after)
  check('checkpoint array names', sorted(arrays_before), sorted(arrays_after))
  unequal = [
    key
    for key in sorted(set(arrays_before) & set(arrays_after))
    if not (
      arrays_before[key] == arrays_after[key]
      if isinstance(arrays_before[key], bytes)
      else np.array_equal(arrays_before[key], arrays_after[key])
    )
  ]
  print(f'  {name}: {len(arrays_before)} checkpoint arrays and data files, {len(unequal)} differ')
  if unequal:
    differences.append(f'{name}: checkpoint arrays {unequal[:5]}')
  check('TensorBoard scalars', _scalars(before), _scalars(after))
  return differences


def _flatten(tree, prefix=''):
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f'{prefix}{key}.'))
    else:
      flat[prefix + key] = value
  return flat


# What marks --root as this script's own: a folder that holds anything else is never emptied.
MARKER = '.same_outputs'


def _root_errors(root: str) -> list[str]:
  """--root is emptied: it must be new, empty or this script's, and no run's files, input
  (the checkouts, the raw data) or code (`path_checks.output_dir_errors`)."""
  inputs = {
    'the checkout --before': _BEFORE.value,
    'the checkout --after': _AFTER.value,
    'the raw data (--manual_dir)': _MANUAL_DIR.value,
  }
  if errors := path_checks.output_dir_errors(root, '--root', inputs):
    return errors
  if os.path.isdir(root) and os.listdir(root) and not os.path.exists(os.path.join(root, MARKER)):
    return [
      f'--root={root} holds files this script did not write, and it empties --root: name a '
      'new or empty folder.'
    ]
  return []


def main(argv):
  del argv
  root = os.path.abspath(_ROOT.value)
  if problems := _root_errors(root):
    raise errors.InvalidInput(problems[0])
  shutil.rmtree(root, ignore_errors=True)
  os.makedirs(root)
  open(os.path.join(root, MARKER), 'w').close()
  differences = []
  for name in RUNS:
    before = _run(os.path.abspath(_BEFORE.value), root, name)
    after = _run(os.path.abspath(_AFTER.value), root, name)
    print(f'{name}: {before} against {after}')
    differences += _compare(name, before, after)
  print('All the same.' if not differences else 'Different:\n  ' + '\n  '.join(differences))
  sys.exit(1 if differences else 0)


if __name__ == '__main__':
  errors.run(main)
