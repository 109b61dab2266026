"""The paper's base and big models lower for CUDA and TPU, on one device and on a 2 x 2 x 2 mesh.

`jax.export` lowers each jitted function of a run in bfloat16 (the train step, the evaluation
step, beam search and greedy decoding) for the platforms of the machines this code exists for,
from shapes alone: nothing is allocated, nothing is compiled, and no GPU or TPU is needed. The
8 CPU devices of tests/conftest.py stand in for the mesh's devices. Attention takes the XLA path
(`attention_impl='xla'`): JAX's cuDNN path checks for cuDNN while it traces, so a CPU machine
cannot export it; bench/accelerator_check.py runs it on a GPU.
"""

import math
import re

import jax
import jax.numpy as jnp
import pytest
from conftest import abstract_run
from jax import export

from configs import wmt14_ende_base, wmt14_ende_big
from transformer import inference, sharding
from transformer.tasks import translation

PLATFORMS = ('cuda', 'tpu')
CONFIGS = {'base': wmt14_ende_base, 'big': wmt14_ende_big}
MESHES = {'one_device': (1, 1, 1), 'mesh_2x2x2': (2, 2, 2)}
ROWS, LENGTH, SOURCE_LENGTH = 8, 16, 8  # Small batches: lowering costs the same at any size.


@pytest.fixture(scope='module', params=[(c, m) for c in CONFIGS for m in MESHES], ids='-'.join)
def run(request):
  """Everything a run of (config, mesh) jits, as shapes with their shardings."""
  name, mesh_name = request.param
  config = CONFIGS[name].get_config()
  config.dtype = 'bfloat16'
  config.model.attention_impl = 'xla'
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = MESHES[mesh_name]
  devices = jax.devices()[: math.prod(MESHES[mesh_name])]
  if len(devices) < math.prod(MESHES[mesh_name]):
    pytest.fail(f'{mesh_name} needs 8 devices; tests/conftest.py asks JAX for them.')
  return abstract_run(config, devices, ROWS, LENGTH)


def _export(run, jitted, *args) -> export.Exported:
  with sharding.activated(run.mesh, run.rules):
    exported = export.export(jitted, platforms=PLATFORMS)(*args)
  assert exported.platforms == PLATFORMS
  assert exported.nr_devices == run.mesh.size
  module = exported.mlir_module()
  # No kernel of one platform (cuDNN, a CPU library) in the module: plain StableHLO.
  custom_calls = set(re.findall(r'stablehlo\.custom_call @(\w+)', module))
  assert not custom_calls, custom_calls
  assert 'bf16' in module  # The bfloat16 matmuls of config.dtype.
  return exported


def test_train_step_lowers(run):
  exported = _export(run, run.train_step, run.state, run.batch)
  if run.mesh.size > 1:  # Parameters and batches are split over the mesh, as in a real run.
    specs = [s.spec for s in exported.in_shardings_jax(run.mesh)]
    split_over = {axis for spec in specs for axes in spec if axes for axis in jax.tree.leaves(axes)}
    assert split_over == set(sharding.MESH_AXES), specs


def test_eval_step_lowers(run):
  _export(run, run.eval_step, run.state.params, run.batch)


@pytest.mark.parametrize('decoder', ['beam', 'greedy'])
def test_decoding_lowers(run, decoder):
  """Beam search (beam 4, the paper's) and greedy decoding: their loop body is one step."""
  options = inference.DecodeOptions(decoder=decoder, max_extra_len=4)
  rows = sharding.rows_sharding(run.mesh, run.rules)
  decode = jax.jit(
    lambda params, src_BS, key_data: translation.decode.translate(
      params,
      src_BS,
      jax.random.wrap_key_data(key_data),
      model_config=run.eval_model.config,
      options=options,
    ),
    out_shardings=rows,
  )
  src = jax.ShapeDtypeStruct((ROWS, SOURCE_LENGTH), jnp.int32, sharding=rows)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(run.mesh))
  exported = _export(run, decode, run.state.params, src, key)
  assert exported.out_avals[0].shape == (ROWS, SOURCE_LENGTH + options.max_extra_len)
