"""train.py --dry_run --topology: a run's functions compiled by the real TPU compiler, on a CPU.

libtpu (the `tpu` extra, which CI installs) compiles the base model's train step for one small
slice of each TPU generation, and its eval step and beam search for v5e; the compiler's memory
and FLOPs come back, and its FLOPs agree with `summary.flops_per_token`. The train step's
attention is TPUs' Pallas kernel (`attention_impl='auto'`, `transformer/tpu_attention.py`),
compiled by Mosaic. A config too large for
its slice is reported as not fitting, and the change that fits is found by compiling. Bad
topology names and a missing extra are refused with one message. Nothing here reaches the
network: `tpu_topology.prepare_environment` keeps libtpu off the cloud's metadata server.
"""

import importlib
import re
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from configs import tiny, wmt14_ende_base
from transformer import dry_run, summary, tpu_attention, tpu_compile, tpu_topology
from transformer.config import ModelConfig
from transformer.errors import InvalidInput

# One small slice of each generation JAX names: 4 chips each (v4 and v5p: one device a chip).
TOPOLOGIES = ('v4:2x2x1', 'v5e:2x2', 'v5p:2x2x1', 'v6e:2x2')
# The compiled train step against the model's count: the count is matmuls only (2 FLOPs a
# multiply-add, 3 x the forward pass); the compiler counts every op besides: softmax, layer
# norms, dropout, the loss over the vocabulary and Adam's update of every parameter, but nothing
# inside the Pallas attention kernel (a custom call), so the count compared leaves out the
# attention's two products. Measured: 1.032x for this config on v5e (with the einsum, the
# products counted: 1.033x on each generation); 1.024x for the whole base model at its batch of
# 96 rows on v5e:2x2 with the einsum (docs/devices.md). A count that left out a matmul or
# counted one twice would be off by 10% or more.
FLOPS_TOLERANCE = (1.0, 1.10)


def _base_config():
  """The base model in bfloat16 at small shapes: one layer of each stack (the six of the base
  repeat the same ops and multiply the compile time by 2.5), one row of 256 tokens per chip,
  and sources of up to 64 tokens to decode."""
  config = wmt14_ende_base.get_config()
  config.dtype = 'bfloat16'
  config.model.num_layers = 1
  config.data.tokens_per_batch = 4 * config.data.max_len
  config.data.max_eval_len = 64
  return config


# The eval step and beam search are compiled for one generation only: each generation's
# compiler is exercised by the train step, and the two add a minute of CI's 2 cores apiece.
ALL_FUNCTIONS_ON = 'v5e:2x2'


# The attention kernels built while each slice's functions compiled, by topology.
KERNELS: dict[str, list[tuple]] = {}


@pytest.fixture(scope='module', params=TOPOLOGIES)
def report(request):
  """The base model's train step (and, on `ALL_FUNCTIONS_ON`, its eval step and beam search)
  compiled for one slice; the Pallas kernels built meanwhile go to `KERNELS`."""
  names = ('train step', 'eval step', 'beam search')
  names = names if request.param == ALL_FUNCTIONS_ON else names[:1]
  built = KERNELS.setdefault(request.param, [])
  kernel = tpu_attention._kernel  # pylint: disable=protected-access
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(tpu_attention, '_kernel', lambda *a: built.append(a) or kernel(*a))
    return tpu_compile.compile_run(_base_config(), tpu_topology.parse(request.param), names)


def test_memory_and_flops_come_back_and_fit(report):
  expected = ['train step', 'eval step', 'beam search']
  if report.topology.name != ALL_FUNCTIONS_ON:
    expected = expected[:1]
  assert [f.name for f in report.functions] == expected
  for f in report.functions:
    assert f.error is None, f
    assert f.arguments > 0 and f.code > 0 and f.total > 0, f
    assert f.flops > 0 and f.bytes_accessed > 0, f
    assert f.total < report.topology.chip.hbm_bytes, f
  train = report.train
  assert train.aliased > 0  # The donated state is updated in place.
  assert train.temporaries > 0
  assert report.fits()
  assert report.mesh == {'data': 4, 'fsdp': 1, 'tensor': 1}
  assert 0 < report.mfu_ceiling() <= 1
  text = tpu_compile.format_report(report)
  assert f'TPU {report.topology.name}' in text and 'fits: yes' in text


def test_compiled_train_flops_match_the_model_count(report):
  config = _base_config()
  model_config = ModelConfig.from_config(config)
  per_token = summary.flops_per_token(model_config, config.data.max_len)
  model = per_token['train'] * config.data.tokens_per_batch
  assert report.model_flops == pytest.approx(model)
  # Length 0: the count without the attention's products, which the kernel computes.
  matmuls = summary.flops_per_token(model_config, 0)['train'] * config.data.tokens_per_batch
  ratio = report.train.flops * report.topology.chips / matmuls
  assert FLOPS_TOLERANCE[0] <= ratio <= FLOPS_TOLERANCE[1], ratio
  # The kernel's products are added back, by the model's count, for the bounds.
  assert report.train.kernel
  assert report.kernel_flops == pytest.approx(model - matmuls)
  assert report.step_flops() * report.topology.chips == pytest.approx(
    report.train.flops * report.topology.chips + model - matmuls
  )


def test_attention_compiles_as_the_pallas_kernel_for_tpus(report):
  """The train step's three attentions (encoder, causal decoder, cross) at 256 tokens are the
  kernel, compiled by Mosaic (not interpreted: this process's own devices are CPUs, the mesh's
  TPUs); the eval step's and beam search's 64 tokens do not tile and keep the einsum."""
  config = _base_config()
  length, heads = config.data.max_len, config.model.num_heads
  # (length, kv_length, heads, causal, interpret), as `tpu_attention._kernel` takes them.
  assert sorted(KERNELS[report.topology.name]) == [
    (length, length, heads, False, False),
    (length, length, heads, False, False),
    (length, length, heads, True, False),
  ]


def _too_large():
  """One wide layer (d_model 8192, d_ff 32768: 1.9G parameters) at one row per chip: its
  parameters, gradients and Adam's moments need 30 GiB per chip when replicated (data
  parallel), 7.5 GiB split over 4 chips (fsdp). Small shapes otherwise: it compiles in
  seconds."""
  config = tiny.get_config()
  config.model.d_model = 8192
  config.model.num_heads = 8
  config.model.d_ff = 32768
  config.data.tokens_per_batch = 4 * config.data.max_len
  return config


def test_too_large_a_config_does_not_fit_and_what_fits_is_found_by_compiling():
  topology = tpu_topology.parse('v5e:2x2')
  devices = tpu_topology.devices(topology)
  config = _too_large()
  report = tpu_compile.compile_run(config, topology, ('train step',), devices)
  assert not report.fits()
  # The compiler refuses it, saying how much HBM it needs and how much a v5e chip has.
  assert 'RESOURCE_EXHAUSTED' in report.train.error and 'HBM' in report.train.error
  assert 'fits: no' in tpu_compile.format_report(report)
  log = []
  found = tpu_compile.find_fit(config, topology, devices, log.append)
  assert found is not None, log
  description, overrides, fitted = found
  assert description == 'fsdp over every chip', log  # The first change a user would try.
  assert overrides == {'mesh.data': 1, 'mesh.fsdp': -1, 'mesh.tensor': 1}
  assert fitted.fits() and fitted.mesh == {'data': 1, 'fsdp': 4, 'tensor': 1}
  assert fitted.train_rows == report.train_rows  # The global batch is kept.
  assert log == ['trying fsdp over every chip ...']


def test_two_slices_compile_as_one_mesh():
  """Multi-slice: JAX's topology API takes a number of slices; the mesh spans their chips."""
  config = tiny.get_config()
  report = tpu_compile.compile_run(config, tpu_topology.parse('2xv5e:2x2'), ('train step',))
  assert report.topology.chips == 8 and report.mesh == {'data': 8, 'fsdp': 1, 'tensor': 1}
  assert report.fits() and report.train.flops > 0
  assert '2 slices of v5e:2x2 (8 chips' in tpu_compile.format_report(report)


@pytest.mark.parametrize(
  'value, name, chips, slices',
  [
    ('v5e:2x2', 'v5e:2x2', 4, 1),
    ('v5e-8', 'v5e:2x4', 8, 1),
    ('v5litepod-16', 'v5e:4x4', 16, 1),
    ('v4-8', 'v4:2x2x1', 4, 1),
    ('v5p-16', 'v5p:2x2x2', 8, 1),
    ('V6E-8', 'v6e:2x4', 8, 1),
    ('2xv5e-8', 'v5e:2x4', 16, 2),
  ],
)
def test_topology_names_jax_and_the_cloud_use(value, name, chips, slices):
  topology = tpu_topology.parse(value)
  assert (topology.name, topology.chips, topology.num_slices) == (name, chips, slices)


@pytest.mark.parametrize('value', ['v9:2x2', 'v5e:2x2x1', 'v4:2x2', 'v5e-6', 'v4-7', 'tpu', ''])
def test_a_bad_topology_is_refused_naming_the_flag(value):
  with pytest.raises(InvalidInput, match='--topology=') as error:
    tpu_topology.parse(value)
  assert 'v5e:2x2' in str(error.value)  # It says what a name looks like.


def test_a_shape_libtpu_refuses_is_refused_naming_the_flag():
  with pytest.raises(InvalidInput, match=r"--topology='v5e:3x3' is refused by libtpu"):
    tpu_topology.devices(tpu_topology.parse('v5e:3x3'))


def test_without_the_extra_topology_is_refused_naming_it(monkeypatch):
  monkeypatch.setitem(sys.modules, 'libtpu', None)  # As if not installed: importing it fails.
  with pytest.raises(InvalidInput) as error:
    dry_run.run(tiny.get_config(), topology='v5e:2x2')
  message = str(error.value)
  assert message.startswith('--topology needs libtpu, which is not installed')
  assert 'pip install -r requirements/tpu.txt' in message and "'.[tpu]'" in message


def test_train_py_refuses_a_bad_topology_with_one_message():
  result = subprocess.run(
    [sys.executable, 'train.py', '--config=configs/tiny.py', '--dry_run', '--topology=v5e:9'],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert result.returncode == 1
  assert 'Traceback' not in result.stderr
  errors = [line for line in result.stderr.splitlines() if 'error:' in line]
  assert len(errors) == 1 and "--topology='v5e:9' is no v5e slice" in errors[0], result.stderr


@pytest.mark.parametrize('name', ['wmt14_ende_base', 'wmt14_ende_big', 'wmt14_enfr_big', 'lm1b'])
def test_each_config_names_a_slice_it_fits_as_compiled_in_the_table(name):
  """The config's docstring names a slice (`--topology=...`); docs/devices.md's table, made by
  bench/tpu_slices.py with the TPU compiler, has that config fitting it as it is."""
  docstring = importlib.import_module(f'configs.{name}').__doc__
  match = re.search(r'--dry_run --topology=(\S+)', docstring)
  assert match, f'configs/{name}.py names no slice it fits'
  slice_name = tpu_topology.parse(match.group(1)).name
  table = (REPO_ROOT / 'docs' / 'devices.md').read_text()
  rows = [
    [cell.strip() for cell in line.strip('|').split('|')]
    for line in table.splitlines()
    if line.startswith(f'| {name} | {slice_name} |')
  ]
  assert rows, f'docs/devices.md has no row of {name} on {slice_name}'
  # Columns: config, slice, attention, mesh, rows/device, compiler GiB, estimate, fits, ...,
  # changed (empty: the config as it is).
  assert any(row[7] == 'yes' and row[-1] == '' for row in rows), rows
