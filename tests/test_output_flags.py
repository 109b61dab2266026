"""One rule for every output path: each flag of each command that writes is checked by
`path_checks` before any work (issue 62).

Every flag that names a path or a string, of every command (the entry points, bench/ and the
tools), is listed below as what it is: an output (`OUTPUTS`, with a command line that reaches
its check) or not (`NOT_OUTPUTS`, saying what it names). A flag added to a command without
being listed fails `test_every_flag_of_every_command_is_listed`; each output is then run
with its path inside a training run's checkpoints, and must be refused in one message that
names the flag, before anything is written.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from configs import tiny
from transformer import errors, runs

REPO = Path(__file__).resolve().parents[1]
COMMANDS = sorted(
  str(path.relative_to(REPO))
  for path in [
    *REPO.glob('*.py'),
    *(REPO / 'bench').glob('*.py'),
    *(REPO / 'transformer' / 'tools').glob('*.py'),
  ]
  if 'DEFINE_' in path.read_text() or 'add_argument(' in path.read_text()
)
# {(command, flag): its arguments}: {file} and {folder} lie in the run's checkpoints; {run} is
# that run (configs/tiny.py's config.json), {tmp} a scratch folder.
OUTPUTS = {
  ('train.py', 'workdir'): ['--config=configs/tiny.py', '--workdir={folder}'],
  ('eval.py', 'output_file'): [
    '--workdir={run}',
    '--input_file={tmp}/in.txt',
    '--output_file={file}',
  ],
  ('eval.py', 'attention_plot'): ['--workdir={run}', '--attention_plot={folder}', '--input_text=a'],
  ('convert.py', 'to_hf'): ['--workdir={run}', '--to_hf={folder}'],
  ('convert.py', 'to_ctranslate2'): ['--workdir={run}', '--to_ctranslate2={folder}'],
  ('convert.py', 'workdir'): ['--from_hf={tmp}', '--workdir={folder}'],  # --from_hf's new run.
  ('sweep.py', 'workdir'): [
    '--config=configs/tiny.py',
    '--sweep=configs/sweeps/tiny_schedule.py',
    '--workdir={folder}',
  ],
  ('sweep.py', 'storage'): [
    '--config=configs/tiny.py',
    '--sweep=configs/sweeps/tiny_study.py',
    '--search=optuna',
    '--num_trials=1',
    '--workdir={tmp}/sweep',
    '--storage=sqlite:///{file}',
  ],
  ('compare.py', 'output'): ['{tmp}/a.json', '{tmp}/b.json', '--output={file}'],
  ('transformer/tools/curves.py', 'output'): ['--run=a={run}', '--output={file}.png'],
  ('bench/accelerator_check.py', 'out'): ['--smoke', '--out={file}', '--root={tmp}/root'],
  ('bench/accelerator_check.py', 'root'): ['--smoke', '--out={tmp}/out.json', '--root={folder}'],
  ('bench/checkpoint_storage.py', 'out'): ['--config=configs/tiny.py', '--out={file}'],
  ('bench/same_outputs.py', 'root'): [
    '--before=.',
    '--after=.',
    '--manual_dir={tmp}',
    '--root={folder}',
  ],
  ('bench/train_throughput.py', 'profile_dir'): ['--profile_dir={folder}'],
  ('bench/translation_engines.py', 'output'): ['--workdir={run}', '--output={file}'],
  ('bench/input_pipeline.py', 'root'): ['--root={folder}', '--pairs=10'],
  ('bench/data_mirror.py', 'root'): ['--root={folder}', '--pairs=10'],
  ('bench/bucket_run.py', 'root'): ['--root={folder}'],
  ('bench/bucket_run.py', 'out'): ['--root={tmp}/root', '--out={file}'],
}
# {(command, flag): what it names}: read, or not a path.
NOT_OUTPUTS = {
  ('train.py', 'config'): 'the config file',
  ('train.py', 'topology'): 'a TPU slice or GPUs to compile for',
  ('eval.py', 'workdir'): 'the run it scores (it writes only WORKDIR/eval/, its own)',
  ('eval.py', 'checkpoint'): 'a checkpoint of the run',
  ('eval.py', 'split'): 'a split of the data',
  ('eval.py', 'input_file'): 'text to translate',
  ('eval.py', 'input_text'): 'a sentence',
  ('eval.py', 'prompt'): 'a prompt',
  ('eval.py', 'dry_run_configs'): 'configs to check flags against',
  ('eval.py', 'lengths'): 'window lengths',
  ('convert.py', 'from_hf'): 'the directory imported',
  ('convert.py', 'checkpoint'): 'a checkpoint of the run',
  ('convert.py', 'config'): 'the config file',
  ('sweep.py', 'config'): 'the config file',
  ('sweep.py', 'sweep'): 'the sweep file',
  ('sweep.py', 'eval_flags'): "eval.py's flags",
  ('sweep.py', 'slurm_option'): 'a Slurm option',
  ('sweep.py', 'trial'): 'a trial name',
  ('sweep.py', 'compare_to'): 'a trial name',
  ('sweep.py', 'study_name'): 'a study name',
  ('compare.py', 'split'): 'a split',
  ('compare.py', 'metrics'): 'metric names',
  ('transformer/tools/curves.py', 'run'): 'a run read',
  ('transformer/tools/curves.py', 'y'): 'a metric name',
  ('transformer/tools/curves.py', 'title'): 'a title',
  ('transformer/tools/curves.py', 'hline'): 'a line drawn',
  ('transformer/tools/curves.py', 'vline'): 'a line drawn',
  ('transformer/tools/curves.py', 'eval_split'): 'a split',
  ('bench/accelerator_check.py', 'configs'): 'config names',
  ('bench/accelerator_check.py', 'run'): 'internal: one config to run',
  ('bench/checkpoint_storage.py', 'config'): 'the config file',
  ('bench/checkpoint_storage.py', 'manual_dir'): 'the raw data read',
  ('bench/decode_speed.py', 'config'): 'the config file',
  ('bench/decode_speed.py', 'workdir'): 'the run decoded',
  ('bench/decode_speed.py', 'checkpoint'): 'a checkpoint of the run',
  ('bench/decode_speed.py', 'split'): 'a split',
  ('bench/decode_speed.py', 'decoders'): 'which decoders are timed',
  ('bench/peer_flax_wmt.py', 'flax_wmt_dir'): "the peer example's code, read",
  ('bench/same_outputs.py', 'before'): 'a checkout run',
  ('bench/same_outputs.py', 'after'): 'a checkout run',
  ('bench/same_outputs.py', 'manual_dir'): 'the raw data read',
  ('bench/train_throughput.py', 'config'): 'the config file',
  ('bench/translation_engines.py', 'workdir'): 'a run read',
  ('bench/translation_engines.py', 'checkpoint'): 'a checkpoint of the run',
  ('bench/translation_engines.py', 'alphas'): 'numbers',
  ('bench/translation_engines.py', 'penalties'): 'numbers',
  ('bench/translation_engines.py', 'tune_split'): 'a split',
  ('bench/input_pipeline.py', 'config'): 'the config file',
  ('bench/input_pipeline.py', 'workers'): 'numbers',
  ('bench/train_side_by_side.py', 'before'): 'a checkout run',
  ('bench/train_side_by_side.py', 'after'): 'a checkout run',
  ('bench/train_side_by_side.py', 'train_args'): "train.py's arguments",
  ('bench/tpu_slices.py', 'configs'): 'config names',
  ('bench/tpu_slices.py', 'slices'): 'TPU slices to compile for',
  ('bench/tpu_slices.py', 'attention'): 'attention implementations',
}
_STRING_FLAGS = {'DEFINE_string', 'DEFINE_multi_string', 'DEFINE_list', 'DEFINE_config_file'}


def _string_flags(command: str) -> set[str]:
  """The flags of `command` that take a string: absl's DEFINE_* and argparse's add_argument."""
  found = set()
  for node in ast.walk(ast.parse((REPO / command).read_text())):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
      continue
    name = node.args[0]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
      continue
    if node.func.attr in _STRING_FLAGS:
      found.add(name.value)
    elif node.func.attr == 'add_argument' and name.value.startswith('--'):
      typed = {k.arg: k.value for k in node.keywords}
      kind = typed.get('type')
      if kind is None or (isinstance(kind, ast.Name) and kind.id in ('str', 'Path')):
        found.add(name.value[2:])
  return found


def test_every_flag_of_every_command_is_listed():
  found = {(command, flag) for command in COMMANDS for flag in _string_flags(command)}
  unlisted = found - set(OUTPUTS) - set(NOT_OUTPUTS)
  assert not unlisted, f'List each as an output (with its check) or not: {sorted(unlisted)}'
  assert not (set(OUTPUTS) | set(NOT_OUTPUTS)) - found  # No stale entry.
  assert not set(OUTPUTS) & set(NOT_OUTPUTS)


@pytest.fixture(scope='module')
def run(tmp_path_factory) -> Path:
  """A training run's workdir as the commands recognise one: config.json, checkpoints/."""
  workdir = tmp_path_factory.mktemp('outputs') / 'run'
  (workdir / 'checkpoints').mkdir(parents=True)
  runs.write_config(tiny.get_config(), str(workdir))
  return workdir


def _snapshot(folder: Path) -> dict[str, bytes]:
  return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob('*') if p.is_file()}


@pytest.mark.parametrize(
  ('command', 'flag'), sorted(OUTPUTS), ids=[f'{c}--{f}' for c, f in sorted(OUTPUTS)]
)
def test_an_output_inside_a_runs_files_is_refused_before_any_work(run, tmp_path, command, flag):
  (tmp_path / 'in.txt').write_text('a\n')
  result = {'bleu': 1.0, 'split': 'test', 'translations_sha256': 'x'}
  for name in ('a.json', 'b.json'):
    (tmp_path / name).write_text(json.dumps(result))
  where = {
    'run': run,
    'tmp': tmp_path,
    'file': run / 'checkpoints' / 'out.json',
    'folder': run / 'checkpoints' / 'out',
  }
  args = [arg.format(**where) for arg in OUTPUTS[command, flag]]
  before = _snapshot(run)
  # The tools run as modules (python -m transformer.tools.curves), the others as scripts.
  module = command.removesuffix('.py').replace('/', '.')
  script = ['-m', module] if command.startswith('transformer/') else [command]
  done = subprocess.run(
    [sys.executable, *script, *args],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode in (1, 2), done.stderr[-3000:]
  assert 'Traceback' not in done.stderr, done.stderr[-3000:]
  lines = [
    line
    for line in done.stderr.strip().splitlines()
    if not line.startswith(f'(set {errors.TRACEBACK_ENV}=1')
  ]
  assert any(
    f'lies in checkpoints of the training run in {run}, which only that run writes' in line
    and f'--{flag}' in line
    for line in lines[-3:]
  ), done.stderr[-3000:]
  assert _snapshot(run) == before
  assert sorted(os.listdir(run / 'checkpoints')) == []
