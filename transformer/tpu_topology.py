"""TPU slices for `train.py --dry_run --topology`: their names, chips and compile-only devices.

`parse` reads a slice as JAX names it (`v5e:2x2`, `v4:2x2x1`, `v5p:2x2x1`, `v6e:2x4`:
generation, then chips along each axis of the slice's torus) or as the cloud does (`v5e-8`,
`v5litepod-16`, `v4-8`, `v5p-8`, `v6e-8`; `SLICE_SHAPES`), optionally several slices joined
by the data-centre network (`2xv5e-8`: multi-slice). `CHIPS` holds each generation's published
figures, with their sources. `devices` gives the slice's compile-only devices through JAX's
TPU runtime (libtpu, the `tpu` extra): on v4 and v5p each device is one chip (megacore), on
v5e and v6e a chip is one core. Nothing here reaches the network: libtpu would ask the cloud's
metadata server (169.254.169.254) what TPU this host is, and `prepare_environment` tells it not
to. `transformer/tpu_compile.py` compiles a run over these devices.

NVIDIA GPUs (`h100:8`, `a100:2x8`) are `transformer/gpu_topology.py`'s: `parse`, `devices`,
`prepare_environment` and `require_extra` hand a GPU name, and its `Topology`, to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from typing import ClassVar

from transformer import extras, gpu_topology
from transformer.errors import InvalidInput

FLAG = '--topology'
EXTRA = 'tpu'
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """A TPU generation's published figures per chip, and how JAX and the cloud name its slices."""

  name: str  # As JAX's topology names and the cloud's slice names begin: 'v5e'.
  hbm_bytes: int  # HBM per chip.
  peak_flops: float  # Dense bfloat16 matmul peak, FLOP/s per chip.
  hbm_bandwidth: float  # Bytes/s per chip.
  dims: int  # Axes of the slice's torus: 3 (AxBxC) or 2 (AxB).
  cores_per_name_unit: int  # The cloud's `v4-8` counts TensorCores (2 a chip); `v5e-8` chips.
  chip_config: str  # get_topology_desc's chip_config_name: 'megacore', one device per chip.


# Google Cloud's TPU documentation, the key chip specifications of each version's page (HBM in
# GiB as the v4 and v5p pages write it; the v5e and v6e pages write "GB" for the same stacks):
CHIPS = {
  # https://cloud.google.com/tpu/docs/v4: 275 TFLOPs (bf16), HBM2 32 GiB at 1200 GBps.
  'v4': Chip('v4', 32 * GIB, 275e12, 1200e9, 3, 2, 'megacore'),
  # https://cloud.google.com/tpu/docs/v5e: 197 TFLOPs (bf16), HBM2 16 GB at 819 GBps.
  'v5e': Chip('v5e', 16 * GIB, 197e12, 819e9, 2, 1, 'default'),
  # https://cloud.google.com/tpu/docs/v5p: 459 TFLOPs (bf16), HBM2e 95 GiB at 2765 GBps.
  'v5p': Chip('v5p', 95 * GIB, 459e12, 2765e9, 3, 2, 'megacore'),
  # https://cloud.google.com/tpu/docs/v6e: 918 TFLOPs (bf16), HBM 32 GB at 1640 GBps.
  'v6e': Chip('v6e', 32 * GIB, 918e12, 1640e9, 2, 1, 'default'),
}
# The cloud's slice names -> JAX's topology: chips -> the slice shapes of the pages above
# (v5e, v6e: "supported configurations"; v4, v5p: the slice shapes, 2 TensorCores a chip).
SLICE_SHAPES = {
  2: {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8', 128: '8x16', 256: '16x16'},
  3: {
    4: '2x2x1',
    8: '2x2x2',
    16: '2x2x4',
    32: '2x4x4',
    64: '4x4x4',
    128: '4x4x8',
    256: '4x8x8',
    512: '8x8x8',
    1024: '8x8x16',
    2048: '8x16x16',
    4096: '16x16x16',
  },
}
ALIASES = {'v5litepod': 'v5e'}  # The cloud's accelerator type for v5e slices: v5litepod-16.
# The cloud's accelerator type of each generation, for libtpu's TPU_ACCELERATOR_TYPE.
_ACCELERATOR_TYPE = {'v4': 'v4-{}', 'v5e': 'v5litepod-{}', 'v5p': 'v5p-{}', 'v6e': 'v6e-{}'}


@dataclasses.dataclass(frozen=True)
class Topology:
  """A slice (or several) of one TPU generation, as `--topology` named it."""

  platform: ClassVar[str] = 'tpu'
  flag: str  # The flag's value, as given.
  chip: Chip
  shape: tuple[int, ...]  # Chips along each axis of one slice.
  num_slices: int = 1

  @property
  def name(self) -> str:
    """JAX's topology name of one slice: 'v5e:2x2'."""
    return f'{self.chip.name}:{"x".join(map(str, self.shape))}'

  @property
  def chips(self) -> int:
    """Chips of all slices: the devices of the mesh (one device per chip)."""
    return math.prod(self.shape) * self.num_slices

  def describe(self) -> str:
    slices = f'{self.num_slices} slices of ' if self.num_slices > 1 else ''
    chips = f'{self.chips} chip' + ('s' if self.chips > 1 else '')
    c = self.chip
    return (
      f'{slices}{self.name} ({chips}; each {c.hbm_bytes / GIB:.0f} GiB HBM at '
      f'{c.hbm_bandwidth / 1e9:,.0f} GB/s, {c.peak_flops / 1e12:,.0f} TFLOP/s bfloat16)'
    )


def _usage(value: str, problem: str) -> InvalidInput:
  names = ', '.join(sorted(CHIPS))
  return InvalidInput(
    f'{FLAG}={value!r} {problem}. Name a slice as JAX does (v5e:2x2, v4:2x2x1, v5p:2x2x1, '
    f'v6e:2x4: generation, then chips along each axis) or as the cloud does (v5e-8, '
    f'v5litepod-16, v4-8, v5p-8, v6e-8), optionally several slices as 2xv5e-8; generations: '
    f'{names}. NVIDIA GPUs: h100:8, a100:8, h200:8, h100:2x8 (2 hosts of 8).'
  )


def parse(value: str) -> Topology | gpu_topology.Topology:
  """The `Topology` that `--topology=value` names; `InvalidInput` naming the flag if none.

  Checks the generation, the shape's axes and (for the cloud's names) the chip count against
  `CHIPS` and `SLICE_SHAPES`; whether libtpu accepts the shape is checked when it is built.
  GPU names (`h100:8`) are `gpu_topology.parse`'s.
  """
  if gpu_topology.names_gpu(value):
    return gpu_topology.parse(value)
  text = value.strip().lower()
  slices_match = re.fullmatch(r'(\d+)x(v.*)', text)
  num_slices = int(slices_match.group(1)) if slices_match else 1
  text = slices_match.group(2) if slices_match else text
  if num_slices < 1:
    raise _usage(value, 'asks for no slice')
  if match := re.fullmatch(r'([a-z0-9]+):(\d+(?:x\d+)*)', text):  # JAX's name: v5e:2x2.
    generation, shape_text = match.groups()
    chip = CHIPS.get(ALIASES.get(generation, generation))
    if chip is None:
      raise _usage(value, f'names no TPU generation this compiler knows ({generation!r})')
    shape = tuple(int(n) for n in shape_text.split('x'))
    if len(shape) != chip.dims or min(shape) < 1:
      raise _usage(value, f'is no {chip.name} slice: it has {chip.dims} axes of chips')
    return Topology(value, chip, shape, num_slices)
  if match := re.fullmatch(r'([a-z0-9]+)-(\d+)', text):  # The cloud's name: v5e-8.
    generation, count = match.group(1), int(match.group(2))
    chip = CHIPS.get(ALIASES.get(generation, generation))
    if chip is None:
      raise _usage(value, f'names no TPU generation this compiler knows ({generation!r})')
    chips, remainder = divmod(count, chip.cores_per_name_unit)
    shape_text = SLICE_SHAPES[chip.dims].get(chips) if not remainder else None
    if shape_text is None:
      raise _usage(value, f'is no {chip.name} slice of the cloud (known: {_cloud_names(chip)})')
    return Topology(value, chip, tuple(int(n) for n in shape_text.split('x')), num_slices)
  raise _usage(value, 'is no TPU slice name')


def _cloud_names(chip: Chip) -> str:
  counts = sorted(SLICE_SHAPES[chip.dims])
  return ', '.join(f'{chip.name}-{n * chip.cores_per_name_unit}' for n in counts)


def prepare_environment(topology: Topology) -> None:
  """Before libtpu loads: no metadata server, no TPU of this host, no lock on one.

  libtpu asks the cloud's metadata server what TPU this host is unless TPU_SKIP_MDS_QUERY is
  set (JAX sets it too where no TPU is on the PCI bus, `jax._src.cloud_tpu_init`); the host's
  accelerator type and worker names, which it would read there, are given instead (else it
  prints a page of warnings; the compiled programs are the same either way, checked for
  all four generations). ALLOW_MULTIPLE_LIBTPU_LOAD lets it load while another process (a
  run on this TPU VM, another pre-flight) holds /tmp/libtpu_lockfile: compiling touches no
  TPU. The host's own devices stay the CPU (JAX_PLATFORMS, unless set): this process needs
  no TPU client.
  """
  if topology.platform == 'gpu':
    return gpu_topology.prepare_environment(topology)
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  accelerator = _ACCELERATOR_TYPE[topology.chip.name]
  chips = math.prod(topology.shape) * topology.chip.cores_per_name_unit
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', accelerator.format(chips))
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  import jax  # pylint: disable=g-import-not-at-top

  if not os.environ.get('JAX_PLATFORMS') and not jax.config.jax_platforms:
    # Backends already started (a test process): they stay what they are.
    with contextlib.suppress(RuntimeError):
      jax.config.update('jax_platforms', 'cpu')


def require_extra(topology: Topology | gpu_topology.Topology | None = None) -> None:
  """`InvalidInput` naming the `tpu` extra if libtpu (the TPU compiler) is not installed; for
  GPUs, the `gpu` extra (`gpu_topology.require_extra`)."""
  if topology is not None and topology.platform == 'gpu':
    return gpu_topology.require_extra()
  extras.require('libtpu', EXTRA, FLAG)


def devices(topology: Topology) -> list:
  """The compile-only devices of `topology`, one per chip; `InvalidInput` if libtpu refuses it."""
  if topology.platform == 'gpu':
    return gpu_topology.devices(topology)
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  prepare_environment(topology)
  kwargs = dict(chip_config_name=topology.chip.chip_config, num_slices=topology.num_slices)
  if math.prod(topology.shape) < 4:  # A sub-host slice: its one host holds all its chips.
    kwargs['chips_per_host_bounds'] = (*topology.shape, 1)[:3]
  try:
    description = topologies.get_topology_desc(topology.name, 'tpu', **kwargs)
  except jax.errors.JaxRuntimeError as e:
    raise _usage(topology.flag, f'is refused by libtpu ({e})') from None
  return list(description.devices)
