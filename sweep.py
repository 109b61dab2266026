"""Runs a hyperparameter sweep: one train.py process per trial, then a ranked summary.

  python sweep.py --config=configs/tiny.py --sweep=configs/sweeps/tiny_schedule.py \
      --workdir=workdirs/sweep --parallel=2 --config.data.manual_dir=../shared/data/multi30k

Each override dict of the sweep file's `sweep()` is a trial in WORKDIR/<name>/
(name from its overrides); `--config.KEY=VALUE` flags apply to every trial.
Running the same command again skips finished trials and resumes interrupted
ones. WORKDIR/summary.{csv,md,png} rank the trials by `config.target_metric`.

With --seeds=N each trial runs N times (config.seed, config.seed + 1, ...) and the
summary ranks configurations by the mean over their seeds (mean, std, min/max,
error bars); with --eval it adds paired significance tests of the best
configuration's (or --compare_to's) eval.py translations against each other's
(see sweep_summary.py).
"""

import signal
import sys

# Ctrl-C ends this process at once while the libraries import (as in train.py); `main` makes it
# a KeyboardInterrupt again, which stops the running trials.
signal.signal(signal.SIGINT, signal.SIG_DFL)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer import config as config_lib  # noqa: E402
from transformer import errors  # noqa: E402
from transformer.tools import sweep_runner, sweep_summary, sweeps  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'Base config file of every trial.', lock_config=True
)
_SWEEP = flags.DEFINE_string('sweep', None, 'Python file whose sweep() returns override dicts.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Sweep root: one subdirectory per trial.')
_PARALLEL = flags.DEFINE_integer(
  'parallel',
  1,
  'Trials run at once; with --emit=slurm, a cap on the array tasks run at once (1: no cap).',
)
_EVAL = flags.DEFINE_bool('eval', False, 'Run eval.py on each trial after training.')
_EVAL_FLAGS = flags.DEFINE_string(
  'eval_flags', '', "eval.py's flags with --eval, e.g. '--checkpoint=avg:5 --split=validation'."
)
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Print every trial command; run nothing.')
_SUMMARIZE = flags.DEFINE_bool('summarize', False, 'Only rewrite the summary files.')
_EMIT = flags.DEFINE_enum(
  'emit',
  None,
  ['slurm'],
  'Write WORKDIR/sweep.slurm (a job array) instead of running the trials here.',
)
_SLURM_OPTIONS = flags.DEFINE_multi_string(
  'slurm_option', [], "An extra '#SBATCH' option, e.g. --slurm_option=--gres=gpu:1 (repeatable)."
)
_TRIAL = flags.DEFINE_string('trial', None, 'Run only the trial of this name (Slurm tasks).')
_SEEDS = flags.DEFINE_integer(
  'seeds',
  1,
  'Run every trial with this many seeds (config.seed, '
  '+1, ...); the summary then groups them: mean, std, min/max, and '
  'paired tests of eval.py results against the best.',
)
_COMPARE_TO = flags.DEFINE_string(
  'compare_to',
  None,
  'With --seeds: the configuration (e.g. '
  "'base') the summary's paired tests compare every other one "
  'to; default: the best.',
)


def _raise_keyboard_interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt('SIGTERM')


def main(argv):
  signal.signal(signal.SIGINT, signal.default_int_handler)
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  sweep_runner.check_parallel(_PARALLEL.value, slurm=_EMIT.value == 'slurm')
  sweep = sweeps.create(
    config_flags.get_config_filename(flags.FLAGS['config']),
    _CONFIG.value,
    _SWEEP.value,
    _WORKDIR.value,
    shared_overrides=config_flags.get_override_values(flags.FLAGS['config']),
    eval_flags=sweeps.parse_eval_flags(_EVAL_FLAGS.value, _EVAL.value),
    seeds=_SEEDS.value,
    compare_to=_COMPARE_TO.value,
  )
  sweep_runner.check_eval_flags(sweep)  # eval.py reads them only after training: checked now.
  if _DRY_RUN.value:
    print('\n'.join(sweep_runner.dry_run(sweep)))
    return
  if _EMIT.value == 'slurm':
    sweep_runner.prepare_data(sweep.trials)  # Once here, rather than racing in every task.
    path = sweep_runner.write_slurm(
      sweep, _PARALLEL.value if _PARALLEL.value > 1 else 0, _SLURM_OPTIONS.value
    )
    print(f'Wrote {path} ({len(sweep.trials)} trials); submit it with: sbatch {path}')
    return
  outcomes = {}
  try:
    if not _SUMMARIZE.value:
      # Slurm and `kill` stop jobs with SIGTERM: stop the trials as on Ctrl-C, marked interrupted.
      signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
      outcomes = sweep_runner.run(sweep, _PARALLEL.value, only=_TRIAL.value)
  except KeyboardInterrupt:
    sweep_summary.write(sweep)  # What there is so far.
    logging.warning(
      'Interrupted: the running trials were stopped and marked interrupted; run '
      'the same command again to resume them.'
    )
    sys.exit(130)
  results = sweep_summary.write(sweep)
  logging.info(
    'Summary: %s/summary.{csv,md,png}; best: %s',
    sweep.root,
    next((r.name for r in results if r.rank == 1), 'none yet'),
  )
  failed = [name for name, outcome in outcomes.items() if outcome == 'failed']
  if failed:
    logging.error(
      '%d of %d trials failed (see their train.log / eval.log): %s',
      len(failed),
      len(outcomes),
      ', '.join(failed),
    )
    sys.exit(1)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config', 'sweep', 'workdir'])
  errors.run(main, flags_parser=config_lib.parse_flags)
