"""NVIDIA GPUs for `train.py --dry_run --topology`: their names, figures and compile-only devices.

`parse` reads `h100:8` (8 GPUs on one host) or `h100:2x8` (2 hosts of 8 GPUs each: 16 devices),
likewise `a100:` and `h200:`. `GPUS` holds each card's published figures, with their sources.
`devices` gives the compile-only devices through JAX's CUDA plugin (the `gpu` extra:
jax-cuda12-plugin, jax-cuda12-pjrt, and CUDA's ptxas and libdevice from nvidia-cuda-nvcc-cu12):
`jax.experimental.topologies.get_topology_desc(platform='cuda', target_config=...)` with a
description of the card, which `target_config` writes from `GPUS` (a text-format
`stream_executor.GpuTargetConfigProto`, what XLA:GPU would otherwise ask the device). No GPU,
driver or cuDNN is needed; `transformer/tpu_compile.py` compiles a run over these devices.

What XLA:GPU does differently without a GPU (docs/devices.md#compiled-for-gpu-before-renting-one):
no autotuning (each gemm and fusion gets the compiler's default tiling, where a GPU would time
the candidates), a generated code size of 0, no refusal of a program larger than the card's
memory (the report compares the totals with it, as it does for TPUs), and no
`compiled.cost_analysis()`: `cost_analysis` counts the optimized program's FLOPs instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import os
import re
import sys
from typing import ClassVar

from transformer import CUDA_PLUGIN, extras
from transformer.errors import InvalidInput

FLAG = '--topology'
EXTRA = 'gpu'
GIB = 2**30
# GPUs per host: an HGX/DGX board holds 8 SXM GPUs joined by NVLink.
MAX_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class Gpu:
  """A card's published figures, and what XLA:GPU reads of it (`target_config`)."""

  name: str  # As --topology names it: 'h100'.
  device_kind: str  # The device's name as CUDA reports it (JAX's `device_kind`).
  hbm_bytes: int  # Device memory as CUDA reports it (cuDeviceTotalMem): what "fits" compares.
  peak_flops: float  # Dense bfloat16 tensor-core peak, FLOP/s per GPU.
  hbm_bandwidth: float  # Bytes/s per GPU.
  compute_capability: tuple[int, int]
  feature_extension: str  # 'ACCELERATED_FEATURES': sm_90a (wgmma), as CUDA 12 builds for H100.
  sms: int  # Streaming multiprocessors (XLA's `core_count`).
  fp32_per_sm: int  # FP32 units per SM (XLA's `fpus_per_core`).
  l2_bytes: int
  clock_ghz: float  # The SMs' boost clock.
  shared_memory_per_sm: int  # Bytes; and the most one block may opt into:
  shared_memory_per_block_optin: int


GPUS = {
  # NVIDIA H100 SXM5 80 GB. https://www.nvidia.com/en-us/data-center/h100/ (datasheet): BF16
  # tensor core 1,979 TFLOP/s with sparsity (989 dense), 80 GB HBM3 at 3.35 TB/s. NVIDIA H100
  # Tensor Core GPU Architecture whitepaper (2022): 132 SMs, 128 FP32 cores per SM, 50 MB L2.
  # CUDA C++ Programming Guide, compute capability 9.0: 228 KB shared memory per SM, 227 KB per
  # block. The memory CUDA reports (84,942,979,072 B) and the 1.98 GHz boost clock: XLA's
  # description of this card, xla/backends/gpu/target_config/specs/h100_sxm.txtpb (openxla/xla).
  'h100': Gpu(
    name='h100',
    device_kind='NVIDIA H100 80GB HBM3',
    hbm_bytes=84_942_979_072,
    peak_flops=989e12,
    hbm_bandwidth=3.35e12,
    compute_capability=(9, 0),
    feature_extension='ACCELERATED_FEATURES',
    sms=132,
    fp32_per_sm=128,
    l2_bytes=50 * 2**20,
    clock_ghz=1.98,
    shared_memory_per_sm=228 * 1024,
    shared_memory_per_block_optin=227 * 1024,
  ),
  # NVIDIA A100 SXM4 80 GB. https://www.nvidia.com/en-us/data-center/a100/ (datasheet): BF16
  # tensor core 312 TFLOP/s (dense), 80 GB HBM2e at 2,039 GB/s. NVIDIA A100 Tensor Core GPU
  # Architecture whitepaper (2020): 108 SMs, 64 FP32 cores per SM, 40 MB L2, 1.41 GHz boost
  # clock. CUDA C++ Programming Guide, compute capability 8.0: 164 KB shared memory per SM,
  # 163 KB per block. The memory CUDA reports (85,100,068,864 B): XLA's
  # xla/backends/gpu/target_config/specs/a100_sxm_80.txtpb.
  'a100': Gpu(
    name='a100',
    device_kind='NVIDIA A100-SXM4-80GB',
    hbm_bytes=85_100_068_864,
    peak_flops=312e12,
    hbm_bandwidth=2.039e12,
    compute_capability=(8, 0),
    feature_extension='NONE',
    sms=108,
    fp32_per_sm=64,
    l2_bytes=40 * 2**20,
    clock_ghz=1.41,
    shared_memory_per_sm=164 * 1024,
    shared_memory_per_block_optin=163 * 1024,
  ),
}

# NVIDIA H200 SXM 141 GB: the H100's GH100 chip with HBM3e.
# https://www.nvidia.com/en-us/data-center/h200/ (datasheet): BF16 tensor core 1,979 TFLOP/s
# with sparsity (989 dense), 141 GB HBM3e at 4.8 TB/s. SMs, L2, clock and shared memory as
# the H100's; the memory CUDA reports (151,397,597,184 B): XLA's
# xla/backends/gpu/target_config/specs/h200.txtpb.
GPUS['h200'] = dataclasses.replace(
  GPUS['h100'],
  name='h200',
  device_kind='NVIDIA H200 141GB HBM3e',
  hbm_bytes=151_397_597_184,
  hbm_bandwidth=4.8e12,
)

# The limits both compute capabilities (8.0 and 9.0) share: the CUDA C++ Programming Guide's
# "Technical Specifications per Compute Capability": threads per block and per SM, the warp,
# static shared memory per block (48 KB), grid and block dimensions, 64K 32-bit registers per SM
# and per block.
_LIMITS = {
  'threads_per_block_limit': 1024,
  'threads_per_warp': 32,
  'shared_memory_per_block': 48 * 1024,
  'threads_per_core_limit': 2048,
  'block_dim_limit_x': 2**31 - 1,
  'block_dim_limit_y': 65535,
  'block_dim_limit_z': 65535,
  'registers_per_core_limit': 65536,
  'registers_per_block_limit': 65536,
  'thread_dim_limit_x': 1024,
  'thread_dim_limit_y': 1024,
  'thread_dim_limit_z': 64,
}


def target_config(gpu: Gpu) -> str:
  """`gpu` as XLA:GPU's `stream_executor.GpuTargetConfigProto`, in protobuf's text format: what
  the compiler reads of a device (`get_topology_desc`'s `target_config`).

  No cuDNN version is given: the `gpu` extra has no cuDNN, so nothing is compiled for it.
  """
  major, minor = gpu.compute_capability
  fields = {
    **_LIMITS,
    'core_count': gpu.sms,
    'fpus_per_core': gpu.fp32_per_sm,
    'shared_memory_per_core': gpu.shared_memory_per_sm,
    'shared_memory_per_block_optin': gpu.shared_memory_per_block_optin,
    'memory_bandwidth': round(gpu.hbm_bandwidth),
    'l2_cache_size': gpu.l2_bytes,
    'clock_rate_ghz': gpu.clock_ghz,
    'device_memory_size': gpu.hbm_bytes,
  }
  lines = ['gpu_device_info {']
  lines += [f'  {key}: {value}' for key, value in fields.items()]
  lines += [
    '  cuda_compute_capability {',
    f'    major: {major}',
    f'    minor: {minor}',
    f'    feature_extension: {gpu.feature_extension}',
    '  }',
    '}',
    'platform_name: "CUDA"',
    f'device_description_str: "{gpu.device_kind}"',
  ]
  return '\n'.join(lines) + '\n'


@dataclasses.dataclass(frozen=True)
class Topology:
  """GPUs of one kind on one host or several, as `--topology` named them."""

  platform: ClassVar[str] = 'gpu'
  flag: str  # The flag's value, as given.
  chip: Gpu
  hosts: int
  per_host: int

  @property
  def name(self) -> str:
    """'h100:8', 'h100:2x8'."""
    hosts = f'{self.hosts}x' if self.hosts > 1 else ''
    return f'{self.chip.name}:{hosts}{self.per_host}'

  @property
  def chips(self) -> int:
    """GPUs of all hosts: the devices of the mesh."""
    return self.hosts * self.per_host

  def describe(self) -> str:
    c = self.chip
    gpus = f'{self.chips} x {c.device_kind}'
    hosts = f', {self.hosts} hosts of {self.per_host}' if self.hosts > 1 else ''
    return (
      f'{self.name} ({gpus}{hosts}; each {c.hbm_bytes / GIB:.1f} GiB HBM at '
      f'{c.hbm_bandwidth / 1e9:,.0f} GB/s, {c.peak_flops / 1e12:,.0f} TFLOP/s bfloat16)'
    )


# What a report compiled for GPUs says besides its figures (`tpu_compile.compile_run`).
NOTES = (
  "no autotuning without a GPU: each gemm and fusion has XLA:GPU's default tiling, where a GPU "
  'would time candidates; the generated code is not sized (0)',
  "FLOPs and bytes: XLA's cost analysis of the optimized program per device "
  '(`gpu_topology.cost_analysis`)',
  "JAX takes 75% of each GPU's memory by default: a total above that needs "
  'XLA_CLIENT_MEM_FRACTION raised (up to .95)',
)


def attention(impl: str) -> str:
  """How `config.model.attention_impl` is compiled for compile-only GPUs, for the report.

  `attention.implementation` picks cuDNN's fused kernel by this host's backend, the CPU here,
  so 'auto' is the einsum and 'cudnn' XLA's implementation of the same function: the cuDNN
  kernel needs cuDNN and a GPU to compile (the `gpu` extra has neither). Where cuDNN would run
  on a GPU, that run stores no [B, H, L, S] attention weights, and needs less memory than here.
  """
  if impl == 'auto':
    return "the einsum ('auto' picks cuDNN's kernel on a GPU host only)"
  if impl == 'cudnn':
    return "'xla' for 'cudnn' (cuDNN's kernel compiles on a GPU host only)"
  return f"'{impl}'"


def names_gpu(value: str) -> bool:
  """Whether `--topology=value` names GPUs (one of `GPUS`) rather than a TPU slice."""
  match = re.match(r'[a-z]+\d+', value.strip().lower())  # 'h100' of 'h100:8' (or 'h100-8').
  return match is not None and match.group() in GPUS


def _usage(value: str, problem: str) -> InvalidInput:
  return InvalidInput(
    f'{FLAG}={value!r} {problem}. Name GPUs as h100:8 (8 GPUs on one host) or h100:2x8 '
    f'(2 hosts of 8), at most {MAX_PER_HOST} a host; GPUs: {", ".join(GPUS)}.'
  )


def parse(value: str) -> Topology:
  """The `Topology` that `--topology=value` names; `InvalidInput` naming the flag if none."""
  text = value.strip().lower()
  match = re.fullmatch(r'([a-z0-9]+):(?:(\d+)x)?(\d+)', text)
  if match is None:
    raise _usage(value, 'is no GPU topology')
  name, hosts, per_host = match.group(1), int(match.group(2) or 1), int(match.group(3))
  if name not in GPUS:
    raise _usage(value, f'names no GPU this compiler knows ({name!r})')
  if hosts < 1:
    raise _usage(value, 'asks for no host')
  if not 1 <= per_host <= MAX_PER_HOST:
    raise _usage(value, f'asks for {per_host} GPUs a host')
  return Topology(value, GPUS[name], hosts, per_host)


def prepare_environment(topology: Topology) -> None:
  """Before JAX starts its backends: the CUDA plugin registered without a GPU.

  JAX's CUDA plugin checks the host's CUDA libraries when it registers, and does not register
  where they are missing, unless the platforms JAX was asked for leave CUDA out or
  JAX_SKIP_CUDA_CONSTRAINTS_CHECK is set (`jax_plugins.xla_cuda12.initialize`). The host's own
  devices stay the CPU (JAX_PLATFORMS, unless set): this process needs no GPU client, and
  attention's 'auto' then picks no cuDNN kernel, which the `gpu` extra could not compile.
  """
  del topology
  os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')
  import jax  # pylint: disable=g-import-not-at-top

  if not os.environ.get('JAX_PLATFORMS') and not jax.config.jax_platforms:
    # Backends already started (a test process): they stay what they are.
    with contextlib.suppress(RuntimeError):
      jax.config.update('jax_platforms', 'cpu')


def require_extra() -> None:
  """`InvalidInput` naming the `gpu` extra if JAX's CUDA plugin, or CUDA's ptxas (which it runs
  to make each kernel's machine code), is not installed."""
  extras.require('jax_cuda12_plugin', EXTRA, FLAG)
  if error := extras.missing('nvidia.cuda_nvcc', EXTRA, FLAG):
    raise InvalidInput(error)


def compiler_version() -> str:
  try:
    return f'jax-cuda12-plugin {importlib.metadata.version("jax-cuda12-plugin")}'
  except importlib.metadata.PackageNotFoundError:
    return 'jax-cuda12-plugin (unknown)'


def devices(topology: Topology) -> list:
  """The compile-only devices of `topology`; `InvalidInput` if the CUDA plugin gives none."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  prepare_environment(topology)
  try:
    _register_plugin()
    description = topologies.get_topology_desc(
      platform='cuda',
      topology_name='',
      target_config=target_config(topology.chip),
      # JAX's GPU topology: partitions x hosts x devices per host.
      topology=f'1x{topology.hosts}x{topology.per_host}',
    )
  except (RuntimeError, NotImplementedError) as e:  # JaxRuntimeError is a RuntimeError.
    raise InvalidInput(
      f"{FLAG}={topology.flag!r}: JAX's CUDA plugin gave no devices ({e}). On a host whose "
      'JAX started its GPU backend (or failed to) before, run the command with '
      'JAX_PLATFORMS=cpu.'
    ) from None
  return list(description.devices)


def _register_plugin() -> None:
  """JAX's CUDA plugin registered, where it is not yet: held back at start-up on a host without
  a GPU (`transformer/__init__.py`), or refused there by its check of the host's CUDA libraries
  (which `prepare_environment` skips)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src.lib import xla_client  # pylint: disable=g-import-not-at-top

  jax.devices()  # JAX's plugins discovered (and the held-back one skipped), once.
  if xla_client.pjrt_plugin_loaded('cuda'):
    return
  held = sys.modules.get(CUDA_PLUGIN)
  if held is not None and getattr(held, '__file__', None) is None:  # The empty one.
    del sys.modules[CUDA_PLUGIN]
  importlib.import_module(CUDA_PLUGIN).initialize()


def cost_analysis(compiled) -> dict[str, float]:
  """XLA's cost analysis of `compiled`'s optimized per-device program, for compile-only GPUs.

  `compiled.cost_analysis()` is None there: JAX asks the GPU client, which a compile-only
  topology does not have. The same analysis (XLA's `HloCostAnalysis`) is run on the CPU client
  over the module XLA:GPU optimized: its fusions and Triton's gemm fusions count their dots
  (2 FLOPs a multiply-add), but a gemm XLA:GPU leaves to cuBLAS (a custom call) would count 0;
  the base model's matmuls all compile to Triton gemm fusions for the H100, H200 and A100, and
  its count is 1.01-1.03x `summary.flops_per_token` (tests/test_gpu_compile.py).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top

  (module,) = compiled.runtime_executable().hlo_modules()
  return _jax.hlo_module_cost_analysis(jax.devices('cpu')[0].client, module)
