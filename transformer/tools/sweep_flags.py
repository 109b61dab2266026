"""sweep.py's own flags checked before any trial: the sweep root and `--eval_flags`.

`root_errors`: the root is a folder of its own (not a run, the code or an input);
`parse_eval_flags` splits `--eval_flags` as a shell would; `eval_flag_errors` refuses eval.py
flags that a sweep sets itself or that would not score each trial where the summary reads.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

import ml_collections

from transformer import path_checks, storage
from transformer.errors import InvalidInput


def root_errors(config: ml_collections.ConfigDict, root: str) -> list[str]:
  """Errors of the sweep root `root`: a folder of its own that can be written, not a run, its
  files or its inputs."""
  if errors := storage.path_errors(root, '--workdir') or storage.checkpoint_errors(
    root, '--workdir'
  ):
    return errors
  if root and storage.isdir(root) and path_checks.is_run(root):
    return [f'--workdir={root} is the workdir of a training run; give the sweep its own folder.']
  if root and storage.isfile(root):
    return [f'--workdir={root} is a file, not a folder.']
  inputs = {
    'the raw data (config.data.manual_dir)': config.data.manual_dir,
    'the prepared data (config.data.data_dir)': config.data.data_dir,
  }
  return path_checks.output_dir_errors(root, '--workdir', inputs)  # And writable.


# eval.py's flags that the sweep sets itself, or that would not score the trial's split into
# WORKDIR/eval/ (where the summary reads results), or would write one path for every trial.
_EVAL_FLAGS_OF_THE_SWEEP = (
  'workdir',
  'dry_run',
  'dry_run_configs',
  'watch',
  'input_file',
  'output_file',
  'prompt',
  'attention_plot',
  'input_text',
)


def parse_eval_flags(text: str, evaluate: bool) -> list[str] | None:
  """sweep.py's `--eval_flags` as eval.py's argv (None without `--eval`: no eval.py runs).

  Split as a shell would; flags given without `--eval` are an error, not ignored.
  """
  if not evaluate:
    if text.strip():
      raise InvalidInput(
        f'--eval_flags={text} is given without --eval, so no eval.py would run to take them. '
        'Add --eval (eval.py evaluates each trial after it trains), or drop --eval_flags.'
      )
    return None
  try:
    return shlex.split(text)
  except ValueError as e:  # An unbalanced quote, or a backslash at the end.
    what, fix = ('a quote without its closing one', 'Close the quote or drop it')
    if 'quotation' not in str(e):
      what, fix = ('a \\ at the end', 'Drop the \\')
    raise InvalidInput(
      f'--eval_flags={text}: {e} ({what}), so it cannot be split into eval.py flags as a '
      f'shell would. {fix}; e.g. --eval_flags="--split=validation --checkpoint=avg:5".'
    ) from None


def eval_flag_errors(eval_flags: Sequence[str]) -> list[str]:
  """Errors of `--eval_flags` that the sweep itself can tell (`check_eval_flags`: eval.py's)."""
  errors = []
  for flag in eval_flags:
    name = flag.lstrip('-').split('=', 1)[0]
    name = name[2:] if name.startswith('no') and name[2:] in _EVAL_FLAGS_OF_THE_SWEEP else name
    if not flag.startswith('-'):
      errors.append(f'--eval_flags: {flag!r} is not a flag (eval.py takes --name=value flags).')
    elif name in _EVAL_FLAGS_OF_THE_SWEEP:
      errors.append(
        f'--eval_flags: {flag} is not for a sweep: the sweep sets --workdir, and the summary '
        "reads the scores eval.py writes to each trial's WORKDIR/eval/ (no "
        + ', '.join(f'--{n}' for n in _EVAL_FLAGS_OF_THE_SWEEP[1:])
        + ').'
      )
  return errors
