"""Device mesh from the config and the one table mapping logical axis names to mesh axes.

Parameters and activations are annotated with logical names (`embed`, `heads`,
`kv`, `mlp`, `vocab`, `batch`, `length`); `LOGICAL_AXIS_RULES` decides where
each lives on the mesh. Changing the mesh shape in the config is all it takes to
go from one device to data, fully-sharded or tensor parallelism.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ('data', 'fsdp', 'tensor')

# logical name -> mesh axis (or axes); unnamed or unlisted logical axes are replicated.
LOGICAL_AXIS_RULES = (
  ('batch', ('data', 'fsdp')),
  ('embed', 'fsdp'),
  ('heads', 'tensor'),
  ('mlp', 'tensor'),
  ('vocab', 'tensor'),
  ('kv', None),
  ('length', None),
)


def mesh_shape(mesh_config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, ...]:
  """Resolves the (data, fsdp, tensor) sizes; one may be -1 for "all remaining devices"."""
  sizes = [mesh_config[axis] for axis in MESH_AXES]
  unknown = [axis for axis, size in zip(MESH_AXES, sizes, strict=True) if size == -1]
  bad = [axis for axis, size in zip(MESH_AXES, sizes, strict=True) if size == 0 or size < -1]
  if bad or len(unknown) > 1:
    raise ValueError(
      f'config.mesh: sizes must be positive with at most one -1, got '
      f'{dict(zip(MESH_AXES, sizes, strict=True))}.')
  known = math.prod(size for size in sizes if size != -1)
  if unknown:
    if num_devices % known:
      raise ValueError(
        f'config.mesh: {num_devices} devices do not divide by the fixed axes '
        f'({known}) of {dict(zip(MESH_AXES, sizes, strict=True))}.')
    sizes[MESH_AXES.index(unknown[0])] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(
      f'config.mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} '
      f'devices, but {num_devices} are available.')
  return tuple(sizes)


def create_mesh(mesh_config: ml_collections.ConfigDict, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh over all devices of all processes."""
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_config, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_shardings(logical_specs, mesh: Mesh):
  """NamedShardings for a tree of logical PartitionSpecs (from `nn.get_partition_spec`)."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, LOGICAL_AXIS_RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of [batch, length] input arrays: rows split over data x fsdp."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes(('batch', 'length'), LOGICAL_AXIS_RULES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
