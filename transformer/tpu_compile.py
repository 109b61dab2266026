"""Compiled for TPU before renting one: `train.py --dry_run --topology=NAME`.

JAX's TPU runtime (libtpu, the `tpu` extra) describes a TPU slice this host does not have
(`jax.experimental.topologies.get_topology_desc`): compile-only devices, over which a run's
mesh is laid and its jitted functions are lowered and compiled by the real TPU compiler.
Nothing runs and no TPU is needed. For each function the compiled executable's
`memory_analysis()` gives the bytes per device (arguments, outputs, temporaries, generated
code) and `cost_analysis()` the FLOPs and bytes accessed per device; with the chip's published
peak and HBM bandwidth (`tpu_topology.CHIPS`) they bound the step time from below and the MFU
from above.

What is compiled is what the run builds: the train step and the eval step of
`train_steps.jit_train_step` / `jit_eval_step` over the state of
`train_steps.abstract_state_and_shardings`, at the config's global batch, mesh, remat, dtype
and attention; and for translation the decoders of eval.py (`translation.decode.translate`,
the first pass of greedy decoding and of beam search, `inference.TwoPass`) at the config's
`decode.*` settings, jitted with their rows over the mesh as `inference.jit_rows` does.

The slice, its chips' figures and its compile-only devices are `transformer/tpu_topology.py`'s
(which also keeps libtpu off the network). NVIDIA GPUs (`--topology=h100:8`) are compiled the
same way by XLA:GPU, their figures and devices `transformer/gpu_topology.py`'s: there
`cost_analysis()` is None and `gpu_topology.cost_analysis` counts the FLOPs instead.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import time
from collections.abc import Callable, Sequence

import ml_collections

from transformer import config_fields, config_rules, gpu_topology
from transformer.tpu_topology import GIB, Topology, devices, parse, require_extra


@dataclasses.dataclass(frozen=True)
class Compiled:
  """One jitted function as the TPU compiler compiled it: its figures per device.

  `error` holds the compiler's refusal (the program does not fit the chip's HBM), and then
  the figures are 0.
  """

  name: str  # 'train step', 'eval step', 'greedy decoding', 'beam search'.
  shape: str  # Its batch per device: '24 rows x 256 tokens'.
  seconds: float  # Lowering and compiling.
  arguments: int = 0  # Bytes per device.
  outputs: int = 0
  aliased: int = 0  # Outputs written over donated arguments (the train step's state).
  temporaries: int = 0
  code: int = 0  # The generated program.
  flops: float = 0.0  # Per device, one call, as `cost_analysis()` counts them.
  bytes_accessed: float = 0.0  # HBM traffic per device, one call (the compiler's count).
  # Whether attention ran in the Pallas kernel (a Mosaic custom call, whose FLOPs and bytes
  # `cost_analysis()` does not count).
  kernel: bool = False
  error: str | None = None
  # The compiler counts a loop's body once: the train step's gradient accumulation
  # (`config.grad_accum_steps` micro-batches in a `lax.scan`) runs it this many times.
  repeats: int = 1

  @property
  def step_flops(self) -> float:
    """FLOPs per device of one call, the accumulation loop counted `repeats` times (the
    optimizer's update outside it is then overcounted too: under 0.1% of a step's FLOPs)."""
    return self.flops * self.repeats

  @property
  def step_bytes(self) -> float:
    """Bytes accessed per device of one call, likewise (the update's bytes overcounted: 2% of
    the big model's step at 4 micro-batches)."""
    return self.bytes_accessed * self.repeats

  @property
  def total(self) -> int:
    """Peak bytes per device: arguments, outputs not aliased to them, temporaries, code."""
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.code


def compile_one(name: str, shape: str, jitted, args: Sequence, mesh, rules) -> Compiled:
  """Lowers and compiles `jitted(*args)` (shapes with shardings) under the run's mesh."""
  import jax  # pylint: disable=g-import-not-at-top

  from transformer import sharding  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  try:
    with sharding.activated(mesh, rules):
      compiled = jitted.lower(*args).compile()
  except jax.errors.JaxRuntimeError as e:
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    error = str(e).split('\n', 1)[0]
    return Compiled(name, shape, time.perf_counter() - start, error=error)
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost  # Older JAX: one dict per program.
  if cost is None:  # Compile-only GPUs: counted by XLA over the optimized program instead.
    cost = gpu_topology.cost_analysis(compiled)
  return Compiled(
    name,
    shape,
    seconds,
    arguments=memory.argument_size_in_bytes,
    outputs=memory.output_size_in_bytes,
    aliased=memory.alias_size_in_bytes,
    temporaries=memory.temp_size_in_bytes,
    code=memory.generated_code_size_in_bytes,
    flops=float(cost.get('flops', 0.0)),
    bytes_accessed=float(cost.get('bytes accessed', 0.0)),
    kernel='tpu_custom_call' in compiled.as_text(),
  )


@dataclasses.dataclass(frozen=True)
class Report:
  """A config compiled for a topology: each function, and what the train step's figures mean."""

  topology: Topology
  mesh: dict[str, int]
  train_rows: int  # Global rows of a training batch, and their length.
  length: int
  model_flops: float  # `summary.flops_per_token`'s train step count x the batch's target tokens.
  functions: tuple[Compiled, ...]
  estimate: int  # `memory.step_memory`'s total per device (--dry_run's estimate).
  settings: str  # The config's dtype, remat and attention, as compiled.
  notes: tuple[str, ...] = ()  # What was not compiled, and why.
  # Of `model_flops`, the attention products (q.k and weights.v) that the train step computes
  # in the Pallas kernel, where the compiler counts nothing; 0 where XLA computes them.
  kernel_flops: float = 0.0

  @property
  def train(self) -> Compiled:
    return self.functions[0]

  def fits(self) -> bool:
    """Every function compiled and needs at most the chip's HBM."""
    return all(f.error is None and f.total <= self.topology.chip.hbm_bytes for f in self.functions)

  def step_flops(self) -> float:
    """The train step's FLOPs per device: the compiler's, and the Pallas kernel's by the
    model's count (`kernel_flops`), which the compiler does not see."""
    return self.train.step_flops + self.kernel_flops / self.topology.chips

  def step_seconds(self) -> float:
    """The train step's lower bound: its FLOPs at the bf16 peak, or its bytes at HBM speed
    (the compiler's count: without the Pallas kernel's reads, which are the bound's to miss)."""
    chip = self.topology.chip
    return max(self.step_flops() / chip.peak_flops, self.train.step_bytes / chip.hbm_bandwidth)

  def mfu_ceiling(self) -> float:
    """The model FLOPs per second at the bound step time over the slice's bf16 peak."""
    seconds = self.step_seconds()
    peak = self.topology.chips * self.topology.chip.peak_flops
    return self.model_flops / seconds / peak if seconds > 0 else 0.0


def _functions(
  config: ml_collections.ConfigDict, devices_: Sequence, names: Sequence[str]
) -> tuple[dict[str, int], list[Compiled], list[str]]:
  """The run's jitted functions among `names`, built as training and eval.py build them."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from transformer import (  # pylint: disable=g-import-not-at-top
    inference,
    input_pipeline,
    optim,
    sharding,
    tasks,
    train_steps,
  )
  from transformer.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from transformer.tasks import translation  # pylint: disable=g-import-not-at-top

  mesh = sharding.create_mesh(config.mesh, devices_)
  rules = sharding.axis_rules(config.mesh)
  task = tasks.get_task(config.model.architecture)
  model_config = ModelConfig.from_config(config)
  model, eval_model = train_steps.create_models(model_config)
  optimizer = optim.create_optimizer(optim.OptimizerConfig.from_config(config))
  state, state_shardings = train_steps.abstract_state_and_shardings(
    model, optimizer, task, mesh, rules
  )
  step_config = train_steps.StepConfig.from_config(config)
  shardings = dict(state_shardings=state_shardings, mesh=mesh, rules=rules)
  shards = sharding.batch_shards(dict(mesh.shape), rules)
  batch_sharding = sharding.batch_sharding(mesh, rules)

  def batch(rows: int, length: int) -> dict:
    return {
      k: jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=batch_sharding)
      for k in task.batch_keys
    }

  def per_device(rows: int, length: int) -> str:
    return f'{rows // shards} rows x {length} tokens'

  out = []
  train_rows, length = config.data.tokens_per_batch // config.data.max_len, config.data.max_len
  if 'train step' in names:
    jitted = train_steps.jit_train_step(
      step_config, model=model, optimizer=optimizer, task=task, **shardings
    )
    accum = config.grad_accum_steps
    micro = f', {accum} micro-batches' if accum > 1 else ''
    compiled = compile_one(
      'train step',
      per_device(train_rows, length) + micro,
      jitted,
      (state, batch(train_rows, length)),
      mesh,
      rules,
    )
    out.append(dataclasses.replace(compiled, repeats=accum))
  if 'eval step' in names:
    eval_rows = input_pipeline.eval_rows(config.data, shards)
    jitted = train_steps.jit_eval_step(step_config, eval_model=eval_model, task=task, **shardings)
    out.append(
      compile_one(
        'eval step',
        per_device(eval_rows, config.data.max_eval_len),
        jitted,
        (state.params, batch(eval_rows, config.data.max_eval_len)),
        mesh,
        rules,
      )
    )
  decoders = [n for n in names if n in ('greedy decoding', 'beam search')]
  if decoders and task.name == 'translation':
    # eval.py's widest decoding batch: sources of max_eval_len tokens, as many rows as
    # `inference.length_sorted_batches` puts in one at eval.py's defaults, padded to the
    # batch shards (`inference.jit_rows`).
    width = input_pipeline.bucket_length(config.data.max_eval_len, config.data.max_eval_len)
    rows = inference.MAX_DECODE_ROWS, inference.MAX_DECODE_TOKENS // width
    rows = 1 << max(0, min(rows).bit_length() - 1)
    rows = -(-rows // shards) * shards
    rows_sharding = sharding.rows_sharding(mesh, rules)
    src = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=rows_sharding)
    key = jax.ShapeDtypeStruct((rows, 2), jnp.uint32, sharding=rows_sharding)  # A key per row.
    for name in decoders:
      decoder = 'beam' if name == 'beam search' else 'greedy'
      options = inference.DecodeOptions.from_config(config, decoder)
      # As `translation.decode.make_translate_fn` and `inference.jit_rows` jit it: the first
      # pass, which every batch decodes (`inference.TwoPass`).
      decode_fn = functools.partial(
        translation.decode.translate,
        model_config=eval_model.config,
        options=options,
        first_pass=True,
      )
      jitted = jax.jit(
        lambda params, src_BS, key_data, fn=decode_fn: fn(
          params, src_BS, jax.random.wrap_key_data(key_data)
        ),
        out_shardings=rows_sharding,
      )
      label = f'{per_device(rows, width)}' + (
        f', beam {options.beam_size}' if decoder == 'beam' else ''
      )
      out.append(compile_one(name, label, jitted, (state.params, src, key), mesh, rules))
  notes = []
  if decoders and task.name != 'translation':
    notes.append(f'decoding is compiled for translation only, not for the {task.name} yet')
  return dict(mesh.shape), out, notes


FUNCTIONS = ('train step', 'eval step', 'greedy decoding', 'beam search')


def compile_run(
  config: ml_collections.ConfigDict,
  topology: Topology,
  names: Sequence[str] = FUNCTIONS,
  devices_: Sequence | None = None,
) -> Report:
  """`config`'s jitted functions among `names` compiled for `topology` (the train step first).

  `devices_`: the topology's devices, if already made (`devices`).
  """
  from transformer import config as config_lib  # pylint: disable=g-import-not-at-top
  from transformer import memory, summary  # pylint: disable=g-import-not-at-top
  from transformer.config import ModelConfig  # pylint: disable=g-import-not-at-top

  devices_ = devices(topology) if devices_ is None else devices_
  config_lib.validate(config, len(devices_))
  config_lib.raise_if(config_rules.platform_errors(config, topology.platform))
  names = ['train step', *[n for n in names if n != 'train step']]
  mesh, functions, notes = _functions(config, devices_, names)
  rows, length = config.data.tokens_per_batch // config.data.max_len, config.data.max_len
  model_config = ModelConfig.from_config(config)
  per_token = summary.flops_per_token(model_config, length)['train']
  # Length 0: the count without the attention products, which a kernel hides from the compiler.
  in_kernel = per_token - summary.flops_per_token(model_config, 0)['train']
  return Report(
    topology=topology,
    mesh=mesh,
    train_rows=rows,
    length=length,
    model_flops=per_token * rows * length,
    functions=tuple(functions),
    estimate=memory.step_memory(config, len(devices_)).total,
    settings=_settings(config, topology.platform),
    notes=tuple(notes) + (gpu_topology.NOTES if topology.platform == 'gpu' else ()),
    kernel_flops=in_kernel * rows * length if functions[0].kernel else 0.0,
  )


def _settings(config: ml_collections.ConfigDict, platform: str = 'tpu') -> str:
  impl = config.model.attention_impl
  if platform == 'gpu':  # `gpu_topology.attention`: no cuDNN kernel without a GPU.
    attention = gpu_topology.attention(impl)
    return f'{config.dtype}, remat {config.model.remat!r}, attention {attention}'
  # On TPUs 'auto' is the Pallas kernel at lengths of 128 (`attention.implementation`).
  attention = (
    "'auto' (Pallas at lengths of 128, else the einsum)" if impl == 'auto' else f"'{impl}'"
  )
  return f'{config.dtype}, remat {config.model.remat!r}, attention {attention}'


def _gib(n: float) -> str:
  return f'{n / GIB:.2f}'


def format_report(report: Report) -> str:
  """The table of each function's memory per device, then the train step's FLOPs and bounds."""
  chip = report.topology.chip
  mesh = ' x '.join(f'{axis} {size}' for axis, size in report.mesh.items())
  lines = [
    f'compiled for {report.topology.platform.upper()} {report.topology.describe()} by '
    + (
      gpu_topology.compiler_version()
      if report.topology.platform == 'gpu'
      else f'libtpu {libtpu_version()}'
    ),
    f'  mesh {mesh}; {report.settings}',
    f'  memory per device, GiB ({chip.hbm_bytes / GIB:.0f} GiB HBM each):',
    f'  {"function":<16} {"batch per device":<40} {"args":>6} {"outputs":>7} {"temps":>6} '
    f'{"code":>5} {"total":>6} {"of HBM":>6}  {"fits":<4} {"compiled in":>11}',
  ]
  for f in report.functions:
    if f.error is not None:
      lines.append(f'  {f.name:<16} {f.shape:<40} does not fit: {f.error} ({f.seconds:.1f} s)')
      continue
    share = f.total / chip.hbm_bytes
    fits = 'yes' if share <= 1 else 'NO'
    # Outputs aliased to donated arguments (the train step's state) count once, as arguments.
    lines.append(
      f'  {f.name:<16} {f.shape:<40} {_gib(f.arguments):>6} {_gib(f.outputs - f.aliased):>7} '
      f'{_gib(f.temporaries):>6} {_gib(f.code):>5} {_gib(f.total):>6} {share:>6.0%}  '
      f'{fits:<4} {f.seconds:>9.1f} s'
    )
  train = report.train
  # The compiler's figure decides what fits; the estimate is what --dry_run shows without it.
  lines.append(
    f'  train step estimate of --dry_run without --topology (transformer/memory.py): '
    f'{_gib(report.estimate)} GiB'
    + (
      f", {report.estimate / train.total:.2f}x the compiler's {_gib(train.total)} GiB, "
      'which decides what fits'
      if train.error is None
      else ''
    )
  )
  if train.error is None:
    compiled = train.step_flops * report.topology.chips
    tokens = report.train_rows * report.length
    compute = report.step_flops() / chip.peak_flops
    traffic = train.step_bytes / chip.hbm_bandwidth
    if train.repeats > 1:
      lines.append(
        f'  (the compiler counts the accumulation loop once: its FLOPs and bytes x {train.repeats})'
      )
    kernel = ''
    if report.kernel_flops:
      kernel = (
        f' + {report.kernel_flops / 1e12:,.2f} TFLOP of attention in the Pallas kernel, which '
        'the compiler does not count (the model count of its products)'
      )
    lines += [
      f'  train step FLOPs: {compiled / 1e12:,.2f} TFLOP compiled{kernel} '
      f'({report.step_flops() / 1e12:,.2f} per device), model count '
      f'{report.model_flops / 1e12:,.2f} TFLOP (summary.flops_per_token x {tokens:,} target '
      f'tokens): {(compiled + report.kernel_flops) / report.model_flops:.3f}x',
      f'  train step time at least {report.step_seconds() * 1e3:,.1f} ms: FLOPs at the bf16 '
      f'peak {compute * 1e3:,.1f} ms, bytes accessed ({train.step_bytes / 1e9:,.1f} GB '
      f'per device) at HBM bandwidth {traffic * 1e3:,.1f} ms',
      f'  MFU at most {report.mfu_ceiling():.0%} (model FLOPs at that step time over '
      f'{report.topology.chips} x {chip.peak_flops / 1e12:,.0f} TFLOP/s); at most '
      f'{tokens / report.step_seconds():,.0f} target tokens/s',
    ]
  lines += [f'  ({note})' for note in report.notes]
  lines.append(f'  fits: {"yes" if report.fits() else "no"}')
  return '\n'.join(lines)


def libtpu_version() -> str:
  try:
    return importlib.metadata.version('libtpu')
  except importlib.metadata.PackageNotFoundError:
    return '(unknown)'


# What a user would change, in order, when the train step does not fit (`find_fit`): each is
# (description, the config's overrides). Gradient accumulation keeps the global batch.
def _candidates(config: ml_collections.ConfigDict, chips: int) -> list[tuple[str, dict]]:
  fsdp = {'mesh.data': 1, 'mesh.fsdp': -1, 'mesh.tensor': 1} if chips > 1 else {}
  remat = {'model.remat': 'layer'}
  out = []
  if fsdp and not (config.mesh.data == 1 and config.mesh.tensor == 1):
    out.append(('fsdp over every chip', fsdp))
  if config.model.remat != 'layer':
    out.append(("model.remat='layer'", remat))
    if fsdp:
      out.append(("fsdp over every chip and model.remat='layer'", {**fsdp, **remat}))
  rows = config.data.tokens_per_batch // config.data.max_len // chips
  accum = config.grad_accum_steps * 2
  while accum <= rows and rows % accum == 0:
    overrides = {**fsdp, **remat, 'grad_accum_steps': accum}
    what = 'fsdp, ' if fsdp else ''
    out.append(
      (
        f"{what}model.remat='layer' and grad_accum_steps={accum} "
        f'({rows // accum} rows per device at a time; the global batch kept)',
        overrides,
      )
    )
    accum *= 2
  return out


def find_fit(
  config: ml_collections.ConfigDict, topology: Topology, devices_: Sequence, log: Callable
) -> tuple[str, dict, Report] | None:
  """The first of `_candidates` whose train step the compiler fits, compiled; None if none."""
  for description, overrides in _candidates(config, len(devices_)):
    changed = config_fields.with_values(config, overrides)
    log(f'trying {description} ...')
    report = compile_run(changed, topology, ('train step',), devices_)
    if report.fits():
      return description, overrides, report
    train = report.train
    figure = train.error or f'{_gib(train.total)} GiB'
    log(f'  does not fit ({figure})')
  return None


def preflight(config: ml_collections.ConfigDict, value: str) -> Report:
  """`train.py --dry_run --topology=value`: compiles and prints; if the config does not fit,
  compiles the changes of `_candidates` until one does and prints it."""
  topology = parse(value)
  require_extra(topology)
  devices_ = devices(topology)
  loads = "JAX's CUDA plugin" if topology.platform == 'gpu' else 'libtpu'
  print(
    f'compiling for {topology.platform.upper()} {topology.describe()} (the first compile loads '
    f'{loads}) ...'
  )
  report = compile_run(config, topology, devices_=devices_)
  print(format_report(report))
  if not report.train.error and report.train.total <= topology.chip.hbm_bytes:
    return report
  print('the train step does not fit; compiling what a user would change:')
  found = find_fit(config, topology, devices_, print)
  if found is None:
    more = 'more GPUs' if topology.platform == 'gpu' else 'a larger slice (more chips)'
    print(f'none of them fits {topology.name}: {more} is needed.')
    return report
  description, overrides, fitted = found
  flags = ' '.join(f'--config.{k}={v}' for k, v in overrides.items())
  print(f'the train step fits with {description}: {flags}')
  print(format_report(fitted))
  for f in report.functions[1:]:
    if f.error is not None or f.total > topology.chip.hbm_bytes:
      print(
        f'  the {f.name} did not fit either, and these changes leave its batch as it was '
        '(config.data.tokens_per_batch // config.data.max_eval_len rows for the eval step).'
      )
  return report
