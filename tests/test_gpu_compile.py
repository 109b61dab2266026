"""train.py --dry_run --topology=h100:8: a run's functions compiled by XLA:GPU, on a CPU.

JAX's CUDA plugin (the `gpu` extra, which CI installs) compiles for NVIDIA GPUs described by
`gpu_topology.target_config`: each card's description parses into devices of the right kind,
compute capability and SM count; the base model's train step compiles for two H100s with its
memory and FLOPs (counted by `gpu_topology.cost_analysis`) agreeing with
`summary.flops_per_token`; and train.py reports a config too large for the card as not fitting,
and the change that fits. XLA:GPU compiles slowly (10-30 s for the smallest train step on 2
cores, most of it making each kernel's machine code): one in-process compile, one train.py.
"""

import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from configs import tiny, wmt14_ende_base
from transformer import dry_run, gpu_topology, summary, tpu_compile, tpu_topology
from transformer.config import ModelConfig
from transformer.errors import InvalidInput

# As tests/test_tpu_compile.py: the compiler counts every op besides the model's matmuls
# (softmax, layer norms, the loss, Adam's update). Measured: 1.023x for this config on h100:2.
FLOPS_TOLERANCE = (1.0, 1.10)


@pytest.mark.parametrize(
  'name, capability, sms', [('h100', '9.0', 132), ('h200', '9.0', 132), ('a100', '8.0', 108)]
)
def test_each_cards_description_parses_into_its_devices(name, capability, sms):
  topology = tpu_topology.parse(f'{name}:2x2')
  devices = tpu_topology.devices(topology)
  assert len(devices) == topology.chips == 4
  assert {d.platform for d in devices} == {'gpu'}
  assert {d.process_index for d in devices} == {0, 1}  # 2 hosts of 2.
  for d in devices:
    assert d.device_kind == gpu_topology.GPUS[name].device_kind
    assert (str(d.compute_capability), d.core_count) == (capability, sms)


def test_a_description_the_plugin_cannot_read_is_refused(monkeypatch):
  # A field its proto lacks (as XLA's newer descriptions have): the text is parsed, not ignored.
  text = gpu_topology.target_config(gpu_topology.GPUS['h100'])
  broken = text.replace('core_count', 'cores_in_all')
  monkeypatch.setattr(gpu_topology, 'target_config', lambda gpu: broken)
  with pytest.raises(InvalidInput, match="--topology='h100:1': JAX's CUDA plugin gave no"):
    gpu_topology.devices(gpu_topology.parse('h100:1'))


def _base_config():
  """The base model in bfloat16 at small shapes, as tests/test_tpu_compile.py compiles it: one
  layer of each stack, one row of 256 tokens per GPU."""
  config = wmt14_ende_base.get_config()
  config.dtype = 'bfloat16'
  config.model.num_layers = 1
  config.data.tokens_per_batch = 2 * config.data.max_len
  return config


@pytest.fixture(scope='module')
def report():
  """The base model's train step compiled for two H100s."""
  return tpu_compile.compile_run(_base_config(), tpu_topology.parse('h100:2'), ('train step',))


def test_memory_and_flops_come_back_and_fit(report):
  (train,) = report.functions
  assert train.error is None, train
  assert train.arguments > 0 and train.temporaries > 0 and train.aliased > 0, train
  assert train.code == 0  # XLA:GPU does not size the generated code.
  assert train.flops > 0 and train.bytes_accessed > 0, train
  assert report.fits() and report.mesh == {'data': 2, 'fsdp': 1, 'tensor': 1}
  assert 0 < report.mfu_ceiling() <= 1
  text = tpu_compile.format_report(report)
  assert text.startswith('compiled for GPU h100:2 (2 x NVIDIA H100 80GB HBM3;'), text
  assert 'by jax-cuda12-plugin 0.10.2' in text.splitlines()[0]
  # 'auto' attention is the einsum: cuDNN's kernel is chosen by this host's backend (the CPU).
  assert "attention the einsum ('auto' picks cuDNN's kernel on a GPU host only)" in text
  assert '(no autotuning without a GPU' in text and 'fits: yes' in text


def test_compiled_train_flops_match_the_model_count(report):
  """The cost analysis of the optimized program counts the Triton gemm fusions' dots: a gemm
  left to cuBLAS (a custom call) would count 0, and the ratio would fall far below 1."""
  config = _base_config()
  per_token = summary.flops_per_token(ModelConfig.from_config(config), config.data.max_len)
  model = per_token['train'] * config.data.tokens_per_batch
  assert report.model_flops == pytest.approx(model)
  ratio = report.train.flops * report.topology.chips / model
  assert FLOPS_TOLERANCE[0] <= ratio <= FLOPS_TOLERANCE[1], ratio


@pytest.mark.parametrize(
  'value, name, gpus',
  [('h100:8', 'h100:8', 8), ('H100:2x8', 'h100:2x8', 16), ('a100:1', 'a100:1', 1)],
)
def test_gpu_names(value, name, gpus):
  topology = tpu_topology.parse(value)
  assert (topology.name, topology.chips, topology.platform) == (name, gpus, 'gpu')


@pytest.mark.parametrize('value', ['h100', 'h100:0', 'h100:9', 'h100:0x8', 'h100-8', 'h100:2x2x8'])
def test_a_bad_gpu_name_is_refused_naming_the_flag(value):
  with pytest.raises(InvalidInput, match='--topology=') as error:
    tpu_topology.parse(value)
  assert 'h100:2x8' in str(error.value)  # It says what a name looks like.


def test_without_the_extra_gpus_are_refused_naming_it(monkeypatch):
  monkeypatch.setitem(sys.modules, 'jax_cuda12_plugin', None)  # As if not installed.
  with pytest.raises(InvalidInput) as error:
    dry_run.run(tiny.get_config(), topology='h100:8')
  message = str(error.value)
  assert message.startswith('--topology needs jax_cuda12_plugin, which is not installed')
  assert 'pip install -r requirements/gpu.txt' in message and "'.[gpu]'" in message


def test_train_py_reports_a_config_too_large_and_what_fits_by_compiling():
  """End to end, in a fresh process (where `transformer/__init__.py` holds the CUDA plugin back
  until --topology asks for it): one wide layer of the tiny language model (d_model 4096, d_ff
  786,432: 6.5G parameters) on two H100s. Replicated, its parameters and Adam's moments alone
  need 73 GiB of each GPU's 79.1: XLA:GPU compiles it anyway (it refuses nothing for its size),
  and the report says it does not fit; split over both (fsdp) it does, found by compiling. The
  language model compiles a train step and an eval step only: no decoders."""
  wide = ['--config.model.d_model=4096', '--config.model.num_heads=8', '--config.model.d_ff=786432']
  result = subprocess.run(
    [sys.executable, 'train.py', '--config=configs/lm_tiny.py', *wide, '--dry_run']
    + ['--topology=h100:2'],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  first, fitted = out.split('\nthe train step does not fit; compiling what a user would change:')
  assert 'compiled for GPU h100:2 (2 x NVIDIA H100 80GB HBM3;' in first, out
  (train,) = [line for line in first.splitlines() if line.startswith('  train step  ')]
  assert ' NO ' in train, out
  assert any(line.startswith('  eval step  ') for line in first.splitlines()), out
  assert first.rstrip().endswith('fits: no'), out
  # The compiler decides what fits: the estimate is shown beside it, without a verdict of its own.
  assert 'fits a device when' not in out and "the compiler's" in first, out
  assert fitted.startswith(
    '\ntrying fsdp over every chip ...\nthe train step fits with fsdp over '
    'every chip: --config.mesh.data=1 --config.mesh.fsdp=-1 --config.mesh.tensor=1\n'
  ), out
  assert 'mesh data 1 x fsdp 2 x tensor 1' in fitted and '\n  fits: yes\n' in fitted, out
  assert out.rstrip().splitlines()[-1].startswith('params: 6512.5M'), out
  assert 'cuda drivers' not in result.stderr, result.stderr  # Nothing printed at start-up.
