"""Trials run at once on one machine get devices of their own: `sweep.py --parallel=N`.

JAX takes every visible GPU and preallocates 75% of each one's memory as it starts, and
a TPU chip is opened by one process only: N trials on the same devices run out of memory
or fail to start. So with N > 1 the visible accelerators are split into N equal shares, one
per trial running at once, through the variables the runtimes read before JAX starts:

* NVIDIA GPUs: `CUDA_VISIBLE_DEVICES` (a share of the ids it lists, or of those
  `nvidia-smi -L` lists where it is unset). JAX numbers a trial's GPUs from 0.
* TPU chips of one host: `TPU_VISIBLE_CHIPS` with the chips' bounds
  (`TPU_CHIPS_PER_PROCESS_BOUNDS`), a slice of one process (`TPU_PROCESS_BOUNDS=1,1,1`) and
  a port of its own (`TPU_PROCESS_PORT`, `TPU_PROCESS_ADDRESSES`): how JAX's own
  multi-process tests run several processes on one TPU VM.

A split that does not fit is refused before any trial starts: more trials than devices
(they would share one), a device count that N does not divide, or a trial whose
`config.mesh` or batch does not fit its share. On CPUs (no accelerator found, or
`JAX_PLATFORMS` naming neither cuda nor tpu) every trial sees the whole machine, as before.

Found without starting JAX in the sweep's process (which would take the devices itself).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from transformer import config as config_lib
from transformer.errors import InvalidInput
from transformer.tools.sweeps import Trial

# Chips of one host a trial may get, as the box they form (x,y,z), as JAX's multi-process tests
# lay them out on 4-chip (2x2) and 8-chip (2x4) hosts.
TPU_CHIP_BOUNDS = {1: '1,1,1', 2: '1,2,1', 4: '2,2,1', 8: '2,4,1'}
TPU_FIRST_PORT = 8476  # libtpu's default port; trial slot i gets this + i.
_NVIDIA_GPU_LINE = re.compile(r'^GPU \d+: ')
_NVIDIA_UUID = re.compile(r'\(UUID: ([^)\s]+)\)')


@dataclasses.dataclass(frozen=True)
class Accelerators:
  """The accelerators visible to this process, as the variable that selects them names them."""

  kind: str  # 'gpu', 'tpu' or 'cpu'.
  ids: tuple[str, ...] = ()  # GPU indices or UUIDs, TPU chip indices; () on CPUs.
  source: str = ''  # How they were found, for messages.

  @property
  def name(self) -> str:
    """'GPUs', 'TPU chips' (singular for one)."""
    name = {'gpu': 'GPU', 'tpu': 'TPU chip'}.get(self.kind, 'device')
    return name if len(self.ids) == 1 else name + 's'


def _listed(value: str) -> tuple[str, ...]:
  """The entries of a visibility variable; CUDA stops at -1 (none)."""
  entries = []
  for entry in value.split(','):
    entry = entry.strip()
    if not entry or entry == '-1':
      break
    entries.append(entry)
  return tuple(entries)


def _nvidia_gpus() -> tuple[int, tuple[str, ...]]:
  """How many GPUs `nvidia-smi -L` lists, and every UUID it lists (GPUs' and MIG devices');
  (0, ()) without the tool or a driver."""
  tool = shutil.which('nvidia-smi')
  if tool is None:
    return 0, ()
  try:
    listing = subprocess.run([tool, '-L'], capture_output=True, text=True, timeout=60)
  except (OSError, subprocess.SubprocessError):
    return 0, ()
  if listing.returncode != 0:
    return 0, ()
  # Each GPU's UUID in order (its index's), then the MIG devices'.
  gpus = [line for line in listing.stdout.splitlines() if _NVIDIA_GPU_LINE.match(line)]
  uuids = [u for line in gpus for u in _NVIDIA_UUID.findall(line)]
  uuids += [u for u in _NVIDIA_UUID.findall(listing.stdout) if u not in uuids]
  return len(gpus), tuple(uuids)


def _gpu_id_errors(ids: Sequence[str], count: int, uuids: Sequence[str], visible: str) -> list[str]:
  """CUDA_VISIBLE_DEVICES entries that name no GPU nvidia-smi lists, or one GPU twice."""
  found, errors, seen = [], [], {}
  for entry in ids:
    if entry.isdigit():  # An index, as its GPU's UUID (listed in order) so both forms compare.
      index = int(entry)
      gpu = None if index >= count else uuids[index] if len(uuids) >= count else index
    else:  # A UUID, or the start of one that names a single device (as CUDA takes it).
      matches = [uuid for uuid in uuids if uuid.startswith(entry)]
      gpu = matches[0] if len(matches) == 1 else None
    if gpu is None:
      found.append(entry)
    elif gpu in seen:
      errors.append(f'{entry!r} names the same GPU as {seen[gpu]!r}')
    else:
      seen[gpu] = entry
  if found:
    listed = f'GPUs 0 to {count - 1}' if count > 1 else 'GPU 0'
    errors.insert(
      0,
      f'{", ".join(map(repr, found))} {"is" if len(found) == 1 else "are"} not among the GPUs '
      f'nvidia-smi -L lists ({listed}' + (f', UUIDs {", ".join(uuids)})' if uuids else ')'),
    )
  if not errors:
    return []
  return [
    f'CUDA_VISIBLE_DEVICES={visible}: {"; ".join(errors)}. Two trials would share a GPU, or a '
    'trial would find none; list each GPU once, by an index or UUID that nvidia-smi -L shows.'
  ]


def _tpu_chips(dev_dir: str) -> int:
  """TPU chips of this host by their device files (/dev/accel*; /dev/vfio/N from v5e on)."""
  if not os.path.isdir(dev_dir):
    return 0
  accel = [n for n in os.listdir(dev_dir) if re.fullmatch(r'accel\d+', n)]
  vfio_dir = os.path.join(dev_dir, 'vfio')
  vfio = [n for n in os.listdir(vfio_dir) if n.isdigit()] if os.path.isdir(vfio_dir) else []
  return len(accel) or len(vfio)


def find(environ: Mapping[str, str] | None = None, dev_dir: str = '/dev') -> Accelerators:
  """The accelerators a trial started from this process would see (JAX not started)."""
  environ = os.environ if environ is None else environ
  platforms = {p.strip() for p in environ.get('JAX_PLATFORMS', '').lower().split(',') if p}
  if not platforms or platforms & {'cuda', 'gpu'}:
    count, uuids = _nvidia_gpus()
    if count:
      if 'CUDA_VISIBLE_DEVICES' in environ:
        visible = environ['CUDA_VISIBLE_DEVICES']
        ids = _listed(visible)
        errors = _gpu_id_errors(ids, count, uuids, visible)
        if errors:
          raise InvalidInput(errors[0])
        source = f'CUDA_VISIBLE_DEVICES={visible} of the {count} that nvidia-smi -L lists'
      else:
        ids = tuple(str(i) for i in range(count))
        source = 'nvidia-smi -L'
      if ids:
        return Accelerators('gpu', ids, source)
  if not platforms or 'tpu' in platforms:
    for variable in ('TPU_VISIBLE_CHIPS', 'TPU_VISIBLE_DEVICES'):
      if environ.get(variable):
        return Accelerators('tpu', _listed(environ[variable]), f'{variable}={environ[variable]}')
    count = _tpu_chips(dev_dir)
    if count:
      return Accelerators('tpu', tuple(str(i) for i in range(count)), f'{dev_dir}/')
  return Accelerators('cpu')


def split(accelerators: Accelerators, parallel: int) -> list[dict[str, str]]:
  """The environment of each of `parallel` trial slots: its own share of the accelerators.

  One slot, or CPUs: [{}] * parallel (every trial sees everything, as without a split).
  Raises InvalidInput naming --parallel and the devices where the split does not fit.
  """
  count = len(accelerators.ids)
  if accelerators.kind == 'cpu' or parallel == 1:
    return [{} for _ in range(parallel)]
  found = f'{count} {accelerators.name} ({accelerators.source})'
  if parallel > count:
    raise InvalidInput(
      f'--parallel={parallel} runs {parallel} trials at once, but this machine has {found}: '
      "trials do not share a device (JAX preallocates most of a GPU's memory, and a TPU chip "
      f'opens in one process only). Use --parallel={count} or fewer.'
    )
  if count % parallel:
    fits = [n for n in range(1, count + 1) if count % n == 0]
    raise InvalidInput(
      f'--parallel={parallel} cannot split the {found} evenly between the trials running at '
      f'once; use a --parallel that divides {count}: {", ".join(map(str, fits))}.'
    )
  share = count // parallel
  if accelerators.kind == 'tpu' and share not in TPU_CHIP_BOUNDS:
    fits = [count // n for n in TPU_CHIP_BOUNDS if n <= count and count % n == 0]
    raise InvalidInput(
      f'--parallel={parallel} would give each trial {share} of the {found}; a TPU process '
      f'takes {", ".join(map(str, TPU_CHIP_BOUNDS))} chips: use --parallel='
      + ' or '.join(map(str, sorted(fits)))
      + '.'
    )
  slots = []
  for slot in range(parallel):
    ids = ','.join(accelerators.ids[slot * share : (slot + 1) * share])
    if accelerators.kind == 'gpu':
      slots.append({'CUDA_VISIBLE_DEVICES': ids})
    else:
      port = str(TPU_FIRST_PORT + slot)
      slots.append(
        {
          'TPU_VISIBLE_CHIPS': ids,
          'TPU_CHIPS_PER_PROCESS_BOUNDS': TPU_CHIP_BOUNDS[share],
          'TPU_PROCESS_BOUNDS': '1,1,1',
          'TPU_PROCESS_PORT': port,
          'TPU_PROCESS_ADDRESSES': f'localhost:{port}',
          'CLOUD_TPU_TASK_ID': '0',
          'ALLOW_MULTIPLE_LIBTPU_LOAD': '1',
        }
      )
  return slots


def check_shares(trials: Sequence[Trial], accelerators: Accelerators, parallel: int) -> None:
  """Each trial's mesh and batch fit the devices of its share (as train.py would check them)."""
  if accelerators.kind == 'cpu' or parallel == 1:
    return
  share = len(accelerators.ids) // parallel
  for trial in trials:
    try:
      config_lib.validate(trial.config, share)
    except ValueError as e:
      raise InvalidInput(
        f'--parallel={parallel} gives each trial {share} of the {len(accelerators.ids)} '
        f'{accelerators.name}, which trial {trial.name} does not fit: {e}'
      ) from None


def trial_environments(trials: Sequence[Trial], parallel: int) -> list[dict[str, str]]:
  """The environment of each of `parallel` trial slots, checked against `trials` (`split`)."""
  accelerators = find()
  slots = split(accelerators, parallel)
  check_shares(trials, accelerators, parallel)
  return slots
