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

With --launcher=slurm the trials are submitted to Slurm instead, as job arrays
through submitit, and sweep.py returns; each trial runs through srun on
config.launch.nodes x config.launch.tasks_per_node processes, is requeued on
its time limit and rewrites the summary when it ends (transformer/tools/sweep_slurm.py).

With --search=optuna (the default for a sweep file that defines space()) the sweep is an
Optuna study: its workers, in this process (--parallel) and in others sharing --storage, ask
the study for trials and prune the poor ones from their validation rows; trials run, resume
and are summarized as above (transformer/tools/sweep_optuna.py defines the study,
transformer/tools/sweep_study.py runs it).
"""

import dataclasses
import shlex
import signal
import sys

# Ctrl-C ends this process at once while the libraries import (as in train.py); `main` makes it
# a KeyboardInterrupt again, which stops the running trials.
signal.signal(signal.SIGINT, signal.SIG_DFL)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer import config as config_lib  # noqa: E402
from transformer import errors, wandb_run  # noqa: E402
from transformer.tools import (  # noqa: E402
  sweep_devices,
  sweep_flags,
  sweep_optuna,
  sweep_runner,
  sweep_slurm,
  sweep_study,
  sweep_summary,
  sweep_tensorboard,
  sweeps,
)

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'Base config file of every trial.', lock_config=True
)
_SWEEP = flags.DEFINE_string('sweep', None, 'Python file whose sweep() returns override dicts.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Sweep root: one subdirectory per trial.')
_PARALLEL = flags.DEFINE_integer(
  'parallel',
  1,
  'Trials run at once, each on its own share of the GPUs or TPU chips (refused where they '
  'do not split evenly); with --launcher=slurm, a cap on the array tasks run at once (1: no '
  'cap).',
)
_EVAL = flags.DEFINE_bool('eval', False, 'Run eval.py on each trial after training.')
_EVAL_FLAGS = flags.DEFINE_string(
  'eval_flags', '', "eval.py's flags with --eval, e.g. '--checkpoint=avg:5 --split=validation'."
)
_DRY_RUN = flags.DEFINE_bool(
  'dry_run', False, 'Print every trial command (and what Slurm would get); run nothing.'
)
_SUMMARIZE = flags.DEFINE_bool('summarize', False, 'Only rewrite the summary files.')
_LAUNCHER = flags.DEFINE_enum(
  'launcher',
  'local',
  ['local', 'slurm'],
  'local: run the trials here; slurm: submit them to Slurm as job arrays (submitit) and return.',
)
_SLURM_OPTIONS = flags.DEFINE_multi_string(
  'slurm_option',
  [],
  'With --launcher=slurm, an sbatch option as KEY=VALUE (repeatable), e.g. '
  f'--slurm_option=partition=gpu --slurm_option=gres=gpu:8; time=[D-]HH:MM:SS is the limit of '
  f'each start of a trial (default {sweep_slurm.DEFAULT_TIME}; it is requeued on reaching it).',
)
_TRIAL = flags.DEFINE_string('trial', None, 'Run (or submit) only the trial of this name.')
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


_SEARCH = flags.DEFINE_enum(
  'search',
  None,
  sweep_optuna.SEARCHES,
  "'list': the sweep file's trials; 'optuna': an Optuna study (its space(), or the values its "
  'sweep() lists, searched, those trials first). Default: optuna for a file that defines space().',
)
_NUM_TRIALS = flags.DEFINE_integer(
  'num_trials', 0, 'Optuna: trials of the whole study (default: as many as sweep() lists).'
)
_SAMPLER = flags.DEFINE_enum('sampler', 'tpe', sweep_optuna.SAMPLERS, 'Optuna: the sampler.')
_PRUNER = flags.DEFINE_enum(
  'pruner',
  'median',
  sweep_optuna.PRUNERS,
  'Optuna: stops trials whose validation rows fall behind (SIGTERM: they checkpoint).',
)
_STARTUP_TRIALS = flags.DEFINE_integer(
  'startup_trials', 5, 'Optuna, --pruner=median: trials that complete before it prunes any.'
)
_STORAGE = flags.DEFINE_string(
  'storage',
  '',
  'Optuna: the study, shared by every worker: a database URL (sqlite:///, postgresql://, '
  'mysql://) or a journal file on a shared file system. Default: sqlite:///WORKDIR/study.db.',
)
_STUDY_NAME = flags.DEFINE_string(
  'study_name', '', "Optuna: the study's name in --storage (default: WORKDIR's last part)."
)


def _raise_keyboard_interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt('SIGTERM')


def main(argv):
  signal.signal(signal.SIGINT, signal.default_int_handler)
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  slurm = _LAUNCHER.value == 'slurm'
  if slurm and not _SUMMARIZE.value:
    sweep_slurm.require_submitit()  # The sweeps extra: before anything is checked or written.
  sweep_runner.check_parallel(_PARALLEL.value, slurm=slurm)
  if _SLURM_OPTIONS.value and not slurm:
    raise app.UsageError('--slurm_option is for --launcher=slurm.')
  slurm_options = sweep_slurm.parse_options(_SLURM_OPTIONS.value)
  arguments = (
    config_flags.get_config_filename(flags.FLAGS['config']),
    _CONFIG.value,
    _SWEEP.value,
    _WORKDIR.value,
    config_flags.get_override_values(flags.FLAGS['config']),
    sweep_flags.parse_eval_flags(_EVAL_FLAGS.value, _EVAL.value),
  )
  study = None
  if (_SEARCH.value or sweep_optuna.search_of(_SWEEP.value)) == 'optuna':
    if slurm or _TRIAL.value or _COMPARE_TO.value:
      raise errors.InvalidInput(
        'An Optuna study runs its trials here, each worker asking it for the next one: '
        'no --launcher=slurm, --trial or --compare_to. On a cluster, run the same command on '
        'each node with a shared --storage.'
      )
    sweep, study = sweep_optuna.create(
      *arguments,
      num_trials=_NUM_TRIALS.value,
      sampler=_SAMPLER.value,
      pruner=_PRUNER.value,
      storage_spec=_STORAGE.value,
      study_name=_STUDY_NAME.value,
      startup_trials=_STARTUP_TRIALS.value,
      seeds=_SEEDS.value,
    )
  else:
    sweep = sweeps.create(*arguments, seeds=_SEEDS.value, compare_to=_COMPARE_TO.value)
  # eval.py reads them only after training: checked now (on the base config, before a study).
  sweep_runner.check_eval_flags(
    sweep
    if sweep.trials
    else dataclasses.replace(sweep, trials=(sweeps.Trial('base', {}, sweep.config),))
  )
  base = sweeps.Trial('base', {}, sweep.config)
  for trial in [*sweep.trials, base] if study else sweep.trials:
    # W&B without wandb, or online without a login, would stop every trial at its start:
    # refused before the first.
    for error in [] if _SUMMARIZE.value else wandb_run.login_errors(trial.config):
      raise errors.InvalidInput(error)
    # config.launch is the Slurm launcher's: a local trial would run as one process regardless.
    for error in [] if slurm or _SUMMARIZE.value else config_lib.launch_errors(trial.config, None):
      raise errors.InvalidInput(f'trial {trial.name}: {error}')
  if _DRY_RUN.value:
    if slurm:
      print('\n'.join(sweep_slurm.dry_run(sweep, _PARALLEL.value, slurm_options, _TRIAL.value)))
    else:
      # The devices of the trials run at once: the split the run would refuse, refused now.
      checked = [*sweep.trials, base] if study else sweep_runner.pending_trials(sweep, _TRIAL.value)
      sweep_devices.trial_environments(checked, _PARALLEL.value)
      described = sweep_optuna.describe(study) if study else []
      print('\n'.join([*described, *sweep_runner.dry_run(sweep)]))
    return
  if slurm and not _SUMMARIZE.value:
    for error in sweep_slurm.cluster_errors():  # Before the data: a cluster must take the jobs.
      raise errors.InvalidInput(error)
    sweep_runner.prepare_data(sweep.trials)  # Once here, rather than racing in every task.
    submitted, left = sweep_slurm.submit(sweep, _PARALLEL.value, slurm_options, _TRIAL.value)
    for name, why in left.items():
      logging.info('%s: %s', name, why)
    jobs = sorted({job.job_id.split('_')[0] for job in submitted.values()})
    print(
      f'Submitted {len(submitted)} of {len(sweep.trials)} trials to Slurm as job array(s) '
      f'{", ".join(jobs) or "(none)"}; their output is in {sweep.root}/{sweep_slurm.FOLDER}/. '
      'Each trial rewrites the summary when it ends; run the same command again to submit '
      'what failed or was stopped, or, to rewrite the summary:\n  '
      + shlex.join(sweep_runner.sweep_command(sweep, '--summarize'))
    )
    return
  outcomes = {}
  try:
    if not _SUMMARIZE.value:
      # Slurm and `kill` stop jobs with SIGTERM: stop the trials as on Ctrl-C, marked interrupted.
      signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
      if study:
        outcomes = sweep_study.run(sweep, study, _PARALLEL.value)
      else:
        outcomes = sweep_runner.run(sweep, _PARALLEL.value, only=_TRIAL.value)
  except KeyboardInterrupt:
    sweep = sweep_study.studied(sweep, study) if study else sweep
    sweep_tensorboard.write(sweep, sweep_summary.write(sweep))  # What there is so far.
    logging.warning(
      'Interrupted: the running trials were stopped and marked interrupted; run '
      'the same command again to resume them.'
    )
    sys.exit(130)
  sweep = sweep_study.studied(sweep, study) if study else sweep  # The trials a study ran.
  results = sweep_summary.write(sweep)
  sweep_tensorboard.write(sweep, results)  # The table of `tensorboard --logdir ROOT`.
  logging.info(
    'Summary: %s/summary.{csv,md,png}; best: %s',
    sweep.root,
    next((r.name for r in results if r.rank == 1), 'none yet'),
  )
  if study:
    logging.info(
      'The study %r in %s: best %s.', study.name, study.storage, sweep_study.best(sweep, study)
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
