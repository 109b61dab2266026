"""Device mesh from the config, and logical axis names -> mesh axes by the config's table.

Parameters and activations are annotated with logical names (`embed`, `heads`,
`kv`, `mlp`, `vocab`, `batch`, `length`); the table `config.mesh.rules` (by default
`LOGICAL_AXIS_RULES`) decides
where each lives on the (data, fsdp, tensor) mesh. Changing the mesh sizes in the
config is all it takes to go from one device to data parallelism, fully sharded
data parallelism (FSDP), tensor parallelism, or any mix of them:

  data    replicas of the model, each fed its own rows of the global batch;
  fsdp    also splits the batch, and shards parameters and optimizer state
          along `embed` (gathered just in time for each matmul by XLA);
  tensor  splits heads, the FFN's inner dimension and the vocabulary
          (Megatron-style), so one layer's matmuls run on several devices.

A mesh axis is used at most once per array: for an activation
[batch, length, embed] the batch takes `fsdp` first, so `embed` stays whole.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer.errors import InvalidInput

MESH_AXES = ('data', 'fsdp', 'tensor')
LOGICAL_AXES = ('batch', 'length', 'embed', 'heads', 'kv', 'mlp', 'vocab')

Rules = tuple[tuple[str, Any], ...]

# The one table from logical axis names (on every parameter and activation) to mesh axes: the
# default of `config.mesh.rules` (a config may replace it).
LOGICAL_AXIS_RULES: Rules = (
  ('batch', ('data', 'fsdp')),  # Rows of every batch: split over data x fsdp.
  ('embed', 'fsdp'),  # d_model of the weights: FSDP shards parameters along it.
  ('heads', 'tensor'),  # Attention heads: tensor parallel.
  ('mlp', 'tensor'),  # d_ff, the FFN's inner dimension: tensor parallel.
  ('vocab', 'tensor'),  # Vocabulary of the shared embedding/softmax: tensor parallel.
  ('kv', None),  # d_k = d_v within a head: never split.
  ('length', None),  # Sequence positions: never split.
)


def mesh_shape(mesh_config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, ...]:
  """Resolves the (data, fsdp, tensor) sizes; one may be -1 for "all remaining devices"."""
  sizes = [mesh_config[axis] for axis in MESH_AXES]
  named = dict(zip(MESH_AXES, sizes, strict=True))
  unknown = [axis for axis, size in named.items() if size == -1]
  if any(size == 0 or size < -1 for size in sizes) or len(unknown) > 1:
    raise InvalidInput(f'config.mesh: sizes must be positive with at most one -1, got {named}.')
  known = math.prod(size for size in sizes if size != -1)
  if unknown:
    if num_devices % known:
      raise InvalidInput(
        f'config.mesh: {num_devices} devices do not divide by the fixed axes ({known}) of {named}.'
      )
    sizes[MESH_AXES.index(unknown[0])] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise InvalidInput(
      f'config.mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} '
      f'devices, but {num_devices} are available.'
    )
  return tuple(sizes)


def create_mesh(mesh_config: ml_collections.ConfigDict, devices: Sequence | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: every device of every process).

  Devices are ordered by process, so each process's devices fill the innermost
  axes (tensor, then fsdp) and only the outer ones cross the slower network
  between hosts. On TPU, `mesh_utils` follows the physical torus instead.
  """
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(mesh_config, len(devices))
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  if devices[0].platform == 'tpu':
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  else:
    grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, MESH_AXES)


def axis_rules(mesh_config: ml_collections.ConfigDict) -> Rules:
  """`config.mesh.rules` as a tuple of (logical, mesh axes) pairs, checked.

  Accepts the lists that a config read back from JSON holds. Errors name the key.
  """
  rules = []
  for entry in mesh_config.rules:
    if len(entry) != 2:
      raise InvalidInput(f'config.mesh.rules: {entry!r} is not a (logical, mesh axes) pair.')
    logical, target = entry
    target = tuple(target) if isinstance(target, (list, tuple)) else target
    targets = target if isinstance(target, tuple) else (target,)
    unknown = [t for t in targets if t is not None and t not in MESH_AXES]
    if logical not in LOGICAL_AXES or unknown:
      raise InvalidInput(
        f'config.mesh.rules: ({logical!r}, {target!r}) must map one of {LOGICAL_AXES} to '
        f'None or mesh axes among {MESH_AXES}.'
      )
    rules.append((logical, target))
  return tuple(rules)


def logical_shardings(logical_specs, mesh: Mesh, rules: Rules):
  """NamedShardings for a tree of logical PartitionSpecs (from `nn.get_partition_spec`)."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
  """Sharding of [batch, length] input arrays (rows over data x fsdp by default)."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes(('batch', 'length'), rules))


def batch_shards(mesh_sizes: dict[str, int], rules: Rules) -> int:
  """Into how many pieces the rows of a batch are split (`dict(mesh.shape)` or resolved sizes).

  Global row counts must divide by it.
  """
  return math.prod(mesh_sizes[axis] for axis in mesh_axes('batch', rules))


def mesh_axes(logical: str, rules: Rules | None = None) -> tuple[str, ...]:
  """The mesh axes the axis rules put the logical axis `logical` on (`rules`, else the active
  ones of `nn.logical_axis_rules`); () where it is not split."""
  axes = nn.logical_to_mesh_axes((logical,), rules)[0]
  axes = axes if isinstance(axes, tuple) else (axes,)
  return tuple(axis for axis in axes if axis is not None)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def activated(mesh: Mesh, rules: Rules) -> Iterator[None]:
  """Makes the model's `nn.with_logical_constraint` hints bind to `mesh` while tracing."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def check_divisible(abstract_tree, mesh: Mesh) -> None:
  """Raises, naming the array and the mesh axis, if a sharded dimension does not divide.

  Runs on shapes only, before anything is compiled or allocated.
  """
  problems = []
  flat, _ = jax.tree_util.tree_flatten_with_path(abstract_tree)
  for path, leaf in flat:
    spec = getattr(getattr(leaf, 'sharding', None), 'spec', None)
    if spec is None:
      continue
    for dim, axes in zip(leaf.shape, spec, strict=False):
      axes = axes if isinstance(axes, tuple) else (axes,)
      size = math.prod(mesh.shape[a] for a in axes if a is not None)
      if dim % size:
        names = ' x '.join(f'config.mesh.{a}={mesh.shape[a]}' for a in axes if a is not None)
        problems.append(
          f'{jax.tree_util.keystr(path)} {tuple(leaf.shape)}: dimension {dim} '
          f'does not divide over {names}'
        )
  if problems:
    raise InvalidInput('Parameters do not fit the mesh:\n  ' + '\n  '.join(problems[:20]))


def global_batch(batch: dict[str, np.ndarray], mesh: Mesh, rules: Rules) -> dict[str, jax.Array]:
  """This process's rows of a global batch -> global arrays sharded like `batch_sharding`."""
  sharding = batch_sharding(mesh, rules)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def from_host(array: np.ndarray, target: NamedSharding) -> jax.Array:
  """A host array that every process holds whole -> a global array with `target` sharding."""
  array = np.asarray(array)
  return jax.make_array_from_callback(array.shape, target, lambda index: array[index])


def rows_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
  """Arrays whose first dimension is the batch (any rank): rows split like `batch_sharding`."""
  return NamedSharding(mesh, PartitionSpec(batch_sharding(mesh, rules).spec[0]))


def to_host(array: jax.Array) -> np.ndarray:
  """The whole value of a (possibly multi-process) global array, on every process."""
  if array.is_fully_addressable:
    return np.asarray(array)
  return np.asarray(multihost_utils.process_allgather(array, tiled=True))
