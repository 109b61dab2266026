"""Multi-process runs: JAX's distributed runtime, started from flags or the cluster's environment.

One process per host (GPU node, TPU VM) or per GPU. Every process runs the same
`train.py` command; they find each other through a coordinator (process 0's
address). JAX reads the address, the process count and this process's id from
Slurm, Open MPI, Kubernetes and Cloud TPU environments by itself; elsewhere pass
them as flags:

  python train.py ... --coordinator_address=HOST0:1234 --num_processes=2 --process_id=0
  python train.py ... --coordinator_address=HOST0:1234 --num_processes=2 --process_id=1
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
from absl import flags, logging

from transformer.errors import InvalidInput

COORDINATOR_ADDRESS = flags.DEFINE_string(
  'coordinator_address',
  None,
  'host:port of process 0 for a multi-process run (default: from the cluster environment).',
)
NUM_PROCESSES = flags.DEFINE_integer(
  'num_processes', None, 'Processes in the run (default: from the cluster environment, or 1).'
)
PROCESS_ID = flags.DEFINE_integer(
  'process_id',
  None,
  "This process's index in [0, num_processes) (default: from the cluster environment).",
)

# Environment variables that hold a process count, set by launchers JAX detects itself.
_CLUSTER_SIZE_VARIABLES = ('SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE', 'PMI_SIZE')


def _cluster_processes(environ: Mapping[str, str]) -> int:
  """Processes the launcher started, as far as the environment says (1 if it says nothing)."""
  for name in _CLUSTER_SIZE_VARIABLES:
    if environ.get(name, '').isdigit():
      return int(environ[name])
  hosts = environ.get('TPU_WORKER_HOSTNAMES', '')  # Cloud TPU VMs of a pod slice.
  return len(hosts.split(',')) if hosts else 1


def is_multi_process(
  coordinator_address: str | None,
  num_processes: int | None,
  environ: Mapping[str, str] = os.environ,
) -> bool:
  """Whether this run has several processes: by the flags, else by the environment."""
  if num_processes is not None:
    return num_processes > 1
  if coordinator_address or environ.get('JAX_COORDINATOR_ADDRESS'):
    return True
  return _cluster_processes(environ) > 1


def ordered(outputs):
  """Waits for `outputs` where computations must not overlap: several processes on CPUs.

  XLA:CPU runs computations that do not depend on each other (e.g. the evaluation
  steps of successive batches) at the same time, on a thread pool, so each process
  can reach their cross-process collectives in another order, and both then wait
  forever (seen: two processes hung in `train_steps.evaluate`). Accelerators run a
  process's computations in launch order, which is the same on every process.
  Returns `outputs`.
  """
  if jax.process_count() > 1 and jax.default_backend() == 'cpu':
    jax.block_until_ready(outputs)
  return outputs


def initialize() -> None:
  """Starts `jax.distributed` when the run has several processes; a no-op otherwise.

  Must run before anything touches a device. Afterwards `jax.devices()` lists
  every device of every process, and processes other than 0 log warnings only
  (process 0 writes logs, metrics and configs).
  """
  coordinator, count, index = (COORDINATOR_ADDRESS.value, NUM_PROCESSES.value, PROCESS_ID.value)
  if not is_multi_process(coordinator, count, os.environ):
    if index not in (None, 0):
      raise InvalidInput(f'--process_id={index} needs --num_processes > {index}.')
    return
  if count is not None and index is not None and not 0 <= index < count:
    raise InvalidInput(f'--process_id={index} is not in [0, --num_processes={count}).')
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=count, process_id=index)
  logging.info(
    'Process %d of %d; %d local of %d devices.',
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  if jax.process_index() > 0:
    logging.set_verbosity(logging.WARNING)
