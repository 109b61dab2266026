"""Trains the Transformer: `python train.py --config=configs/default.py --workdir=DIR`.

Every config field can be overridden on the command line, e.g.
`--config.model.num_layers=2 --config.data.manual_dir=../shared/data/multi30k`.
A workdir that holds checkpoints is resumed from the latest one. SIGTERM, SIGINT
(Ctrl-C) or SIGUSR2 (Slurm's notice before a time limit, as submitit asks for it; see
`transformer/preemption.py`) checkpoints the current step and exits with status 0; before the
first step (start-up, data preparation) it stops at once, with status 128 + signal. On several
hosts, run the same command on each (see `transformer/distributed.py`); the mesh
(`--config.mesh.*`) spans the devices of all of them.
"""

import signal
import sys

# Ctrl-C ends this process at once until the run's own handlers take over (the
# PreemptionWatcher of training.train_and_evaluate): while the libraries import, Python's
# KeyboardInterrupt can land in a garbage-collection callback (JAX registers one), where it is
# only printed and the start-up goes on.
signal.signal(signal.SIGINT, signal.SIG_DFL)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer import config as config_lib  # noqa: E402
from transformer import distributed, dry_run, errors, preemption, training  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Training config file.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints and metrics.')
_DRY_RUN = flags.DEFINE_bool(
  'dry_run',
  False,
  "Validate the config, print the parameter table, FLOPs per token, the train step's "
  'memory per device and `params: N`, then exit without data, training or compiles.',
)
_DRY_RUN_DEVICES = flags.DEFINE_integer(
  'dry_run_devices',
  0,
  "With --dry_run: lay the config's mesh over this many devices for the memory report "
  "(e.g. a GPU node's 8 from a laptop). 0: this host's devices.",
  lower_bound=0,
)
_TOPOLOGY = flags.DEFINE_string(
  'topology',
  None,
  "With --dry_run: compile the run's train step, eval step and decoders with the TPU compiler "
  "for this TPU slice (v5e:2x2, v4:2x2x1, v5p:2x2x1, v6e:2x4, or the cloud's v5e-8, v4-8, "
  '...) and print their memory per device, FLOPs and bounds (transformer/tpu_compile.py; '
  "needs the 'tpu' extra); or with XLA:GPU for NVIDIA GPUs: h100:8 (8 GPUs on one host), "
  'h100:2x8 (2 hosts of 8), likewise a100: and h200: (transformer/gpu_topology.py; needs '
  "the 'gpu' extra).",
)
_RESTORE_FALLBACK = flags.DEFINE_bool(
  'restore_fallback',
  False,
  'If the latest checkpoint cannot be restored (truncated or '
  'corrupted files), move it to WORKDIR/corrupt_checkpoints/ and resume from the newest one '
  'that restores. Without it such a checkpoint stops the run and nothing is changed.',
)
_PROFILE_STEPS = flags.DEFINE_integer(
  'profile_steps',
  0,
  'Trace this many train steps, from the second one this process runs '
  '(the first compiles), with jax.profiler into WORKDIR/profile/ (open with `tensorboard '
  '--logdir WORKDIR/profile`, Profile tab). 0: no trace.',
  lower_bound=0,
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if _DRY_RUN_DEVICES.value and not _DRY_RUN.value:
    raise app.UsageError('--dry_run_devices sizes the memory report of --dry_run; add --dry_run.')
  if _TOPOLOGY.value is not None and not _DRY_RUN.value:
    raise app.UsageError('--topology compiles for TPUs or GPUs with --dry_run; add --dry_run.')
  if _TOPOLOGY.value is not None and _DRY_RUN_DEVICES.value:
    raise app.UsageError('--topology lays the mesh over its chips; drop --dry_run_devices.')
  overridden = config_flags.get_override_values(flags.FLAGS['config'])
  config_lib.raise_if(config_lib.ignored_override_errors(_CONFIG.value, overridden))
  if _DRY_RUN.value:
    dry_run.run(_CONFIG.value, _DRY_RUN_DEVICES.value or None, overridden, _TOPOLOGY.value)
    return
  if _WORKDIR.value is None:
    raise app.UsageError('--workdir is required (except with --dry_run).')
  distributed.initialize()
  logging.info('Config:\n%s', _CONFIG.value)
  try:
    training.train_and_evaluate(
      _CONFIG.value,
      _WORKDIR.value,
      restore_fallback=_RESTORE_FALLBACK.value,
      profile_steps=_PROFILE_STEPS.value,
      overridden=overridden,
    )
  except preemption.Interrupted as e:  # Before the first step: nothing to save.
    logging.warning('%s', e)
    sys.exit(128 + e.signum)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  errors.run(main, flags_parser=config_lib.parse_flags)
