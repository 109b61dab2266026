"""The Transformer of "Attention Is All You Need" in JAX/Flax: the library of the entry points."""

import glob
import importlib.util
import os
import shutil
import sys
import types

# The repository root: where train.py, eval.py and sweep.py live, and the code git tracks.
CODE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_only_host() -> bool:
  """No TPU on this host's PCI bus (Google's vendor id, where JAX looks: jax._src.hardware_utils),
  no GPU device node (NVIDIA's /dev/nvidia0..., AMD's /dev/kfd) and no nvidia-smi (which
  sweep.py asks for the GPUs)."""
  for vendor in glob.glob('/sys/bus/pci/devices/*/vendor'):
    with open(vendor, encoding='ascii') as f:
      if f.read().strip() == '0x1ae0':
        return False
  gpus = glob.glob('/dev/nvidia[0-9]*') or os.path.exists('/dev/kfd') or shutil.which('nvidia-smi')
  return not gpus


# With the `tpu` extra installed (libtpu, for train.py --dry_run --topology), JAX loads libtpu
# at start-up wherever JAX_PLATFORMS is unset, to look for a TPU: on a host without one that is
# 105 MiB more per process and six lines of libtpu warnings on every command
# (docs/devices.md#compiled-for-tpu-before-renting-one). There the CPU is all JAX can use.
if (
  'JAX_PLATFORMS' not in os.environ
  and importlib.util.find_spec('libtpu') is not None
  and _cpu_only_host()
):
  os.environ['JAX_PLATFORMS'] = 'cpu'

# With the `gpu` extra installed (JAX's CUDA plugin, for train.py --dry_run --topology=h100:8),
# JAX loads the plugin (its 458 MB library) in every process, whatever JAX_PLATFORMS says: on a
# host without a GPU that is 93 MiB more per process and 0.3 s more start-up, for nothing. There
# JAX finds an empty plugin instead, and `gpu_topology.devices` registers the real one when a
# command compiles for GPUs (docs/devices.md#compiled-for-gpu-before-renting-one).
CUDA_PLUGIN = 'jax_plugins.xla_cuda12'
if (
  CUDA_PLUGIN not in sys.modules
  and importlib.util.find_spec('jax_cuda12_plugin') is not None
  and _cpu_only_host()
):
  sys.modules[CUDA_PLUGIN] = types.ModuleType(CUDA_PLUGIN, 'Held back: transformer/__init__.py.')
  sys.modules[CUDA_PLUGIN].initialize = lambda: None
