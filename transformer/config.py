"""The config checked: every value's domain, the rules across keys, and the model's dataclass.

- `validate(config)`: every value against its domain (`CONFIG_RULES`, from the one
  declaration of each field in `config_fields`), then the rules across keys. `train_and_evaluate`,
  `train.py --dry_run`, `sweep.py` (every trial's config, before any trial runs) and `eval.py`
  (the run's config and its decoding flags) call it before anything is read, written or
  compiled. Errors name the key, its value and what it may be, all at once.
- `ModelConfig`: the model's frozen dataclass, one field per `model.` field of
  `config_fields` (same name, same default), built once from a config
  (`ModelConfig.from_config`) and read by every module of the model.
- eval.py's flags, checked the same way (`EVAL_FLAG_RULES`).

A new config field is one `config_fields.Field` line; a rule that involves several keys is a
`config_fields.Requirement` beside its fields, or a function in `config_rules.CROSS_CHECKS`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import ml_collections
from absl import app

from transformer import config_fields, config_rules, extras, sharding
from transformer.config_fields import (  # noqa: F401  (the choices, where callers read them)
  ARCHITECTURES,
  ATTENTION_IMPLS,
  DECAYING_TO_LAST_STEP,
  EVAL_BLEU_DECODERS,
  FFN_ACTIVATIONS,
  NORMS,
  POSITIONS,
  REMATS,
  SCHEDULES,
  SPM_MODEL_TYPES,
  SPM_NORMALIZATIONS,
)
from transformer.domains import POSITIVE_REAL, Rule, integer, real
from transformer.errors import InvalidInput

# config.dtype's names (`config_fields.DTYPE_NAMES`) -> the JAX dtypes.
DTYPES = {name: getattr(jnp, name) for name in config_fields.DTYPE_NAMES}

# Every leaf key of a training config (dotted) -> its domain (`config_fields.FIELDS`).
CONFIG_RULES: dict[str, Rule] = {field.key: field.domain for field in config_fields.FIELDS}


def flatten(
  config: ml_collections.ConfigDict | Mapping[str, Any], prefix: str = ''
) -> dict[str, Any]:
  """{'model.d_model': 256, ...}: every leaf of `config` under its dotted key."""
  leaves = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict | Mapping):
      leaves.update(flatten(value, f'{prefix}{key}.'))
    else:
      leaves[prefix + key] = value
  return leaves


def config_errors(
  config: ml_collections.ConfigDict, keys: Sequence[str] | None = None
) -> list[str]:
  """Every value of `config` outside its domain, then every broken rule across keys.

  `keys` limits the domain checks to those keys (and their groups, e.g.
  'model'); the rules across keys then run only if those keys are all valid.
  Keys of the table absent from `config` (a run's config.json written before
  they existed) are skipped.
  """
  values = flatten(config)
  selected = [
    k for k in CONFIG_RULES if keys is None or any(k == p or k.startswith(p + '.') for p in keys)
  ]
  errors = _domain_errors(values, selected)
  if errors or any(k not in values for k in CONFIG_RULES):
    return errors  # Rules across keys assume every value of theirs is valid and present.
  for check in config_rules.CROSS_CHECKS:
    errors += check(config)
  return errors


def model_errors(config: ml_collections.ConfigDict) -> list[str]:
  """The errors of `config.model`, `config.vocab_size` and `config.dtype` alone."""
  values = flatten(config)
  selected = [k for k in CONFIG_RULES if k.startswith('model.') or k in ('vocab_size', 'dtype')]
  return _domain_errors(values, selected) or config_rules.model_rule_errors(config)


# {key: the key it follows} of the fields whose default follows another's (`follows`).
_FOLLOWED_KEY = {
  field.key: field.default.key
  for field in config_fields.FIELDS
  if isinstance(field.default, config_fields.Follows)
}


def _domain_errors(values: Mapping[str, Any], selected: Sequence[str]) -> list[str]:
  """The domain errors of the `selected` keys present in `values` (flattened), in order.

  A field still equal to the invalid value it follows (model.num_kv_heads after
  model.num_heads=0) repeats its source's error, so only the source is named.
  """
  errors = {}
  for key in selected:
    if key in values and (error := CONFIG_RULES[key].error(f'config.{key}', values[key])):
      errors[key] = error
  return [
    error
    for key, error in errors.items()
    if not (_FOLLOWED_KEY.get(key) in errors and values[key] == values.get(_FOLLOWED_KEY[key]))
  ]


def ignored_override_errors(
  config: ml_collections.ConfigDict, overridden: Collection[str]
) -> list[str]:
  """Overrides the config would ignore, given the keys set over the config file (`overridden`).

  `config.lr_scale` only scales eq. 3's peak, which `config.peak_learning_rate` replaces: set
  on the command line (or by a sweep's trial) with a peak learning rate in force, it would
  change nothing. The config file's own value of lr_scale (its default) is never refused:
  a config may set a peak on a base whose lr_scale it inherits.
  """
  if 'lr_scale' in overridden and config.peak_learning_rate is not None:
    return [
      f'config.lr_scale={config.lr_scale:g} would be ignored: config.peak_learning_rate='
      f'{config.peak_learning_rate:g} sets the peak learning rate itself (lr_scale scales '
      "eq. 3's peak only when peak_learning_rate is None). Set the rate by "
      'config.peak_learning_rate alone (drop the lr_scale override), or, for lr_scale to '
      'apply, train a config that leaves peak_learning_rate unset (None).'
    ]
  return []


class ConfigError(InvalidInput):
  """A config value or flag outside its domain; the message lists every one."""


def raise_if(errors: Sequence[str], what: str = 'config') -> None:
  if errors:
    raise ConfigError(f'Invalid {what}:\n  ' + '\n  '.join(errors))


class _ModelConfigMethods:
  """What `ModelConfig` adds to its fields: the domain check, derived switches, construction."""

  def __post_init__(self):
    """Fills each following default (`config_fields.follows`: None until then) with the
    value it follows; checks every field against its domain in `CONFIG_RULES`."""
    for name, key in _FOLLOWING.items():
      if getattr(self, name) is None:
        object.__setattr__(self, name, getattr(self, key.split('.', 1)[1]))
    fields = {k: v for k, v in vars(self).items() if f'model.{k}' in CONFIG_RULES}
    raise_if(
      model_errors(ml_collections.ConfigDict({'vocab_size': self.vocab_size, 'model': fields})),
      'model config',
    )

  @property
  def has_encoder(self) -> bool:
    """False for the decoder-only language model (then the decoder has no cross-attention)."""
    return self.architecture == 'encoder_decoder'

  @property
  def pre_norm(self) -> bool:
    """Whether sub-layers normalise their input (then each stack ends with a final norm)."""
    return self.norm in ('pre_ln', 'rmsnorm')

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> ModelConfig:
    """Builds the dataclass from `config.model`; invalid values are errors naming the key.

    Every `model.` field is read from `config.model` under its own name, the vocabulary
    size and dtype from the top of the config.
    """
    dtype_error = CONFIG_RULES['dtype'].error('config.dtype', config.dtype)
    raise_if([dtype_error] if dtype_error else [], 'model config')  # The rest: __post_init__.
    return cls(
      vocab_size=config.vocab_size,
      dtype=DTYPES[config.dtype],
      **{name: config.model[name] for name in MODEL_FIELD_NAMES},
    )

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


# The model's fields: each `model.` field of `config_fields` under its own name and default.
MODEL_FIELD_NAMES = tuple(key.split('.', 1)[1] for key in config_fields.keys(group='model'))
# Hyperparameters of the model, built once from `config.model` (`from_config`); frozen and
# hashable, as Flax module attributes are. Besides the declared fields: the vocabulary size
# (required), the dtype, and the variants `replace(deterministic=True)` for evaluation and
# `replace(decode=True, max_decode_len=N)` for cached one-token-per-step decoding.
# {name: the key it follows} of the model fields whose default follows another's.
_FOLLOWING = {
  field.key.split('.', 1)[1]: field.default.key
  for field in config_fields.model_fields()
  if isinstance(field.default, config_fields.Follows)
}
ModelConfig = dataclasses.make_dataclass(
  'ModelConfig',
  [
    ('vocab_size', int),
    *(
      (
        field.key.split('.', 1)[1],
        config_fields.default_type(field),
        dataclasses.field(
          default=None if isinstance(field.default, config_fields.Follows) else field.default
        ),
      )
      for field in config_fields.model_fields()
    ),
    ('dtype', Any, dataclasses.field(default=jnp.float32)),
    ('deterministic', bool, dataclasses.field(default=False)),
    ('decode', bool, dataclasses.field(default=False)),
    ('max_decode_len', int, dataclasses.field(default=0)),
  ],
  bases=(_ModelConfigMethods,),
  frozen=True,
  namespace={'__module__': __name__},
)
ModelConfig.__doc__ = (
  'Hyperparameters of the model: the `model.` fields of `config_fields.FIELDS` (same names and '
  'defaults), `vocab_size`, `dtype`, and the variants `deterministic`, `decode`, '
  '`max_decode_len`.'
)


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
  """Raises `ConfigError` listing every invalid value of `config`.

  Args:
    config: A training config, or a run's config.json after `upgrade`.
    num_devices: With a number, the mesh must fit that many devices, the
      batches divide over it and the resource counts fit this machine
      (`machine_errors`); None checks the config alone (a sweep's trials, a run
      evaluated on other devices).
  """
  errors = config_errors(config)
  if not errors and num_devices is not None:
    errors = _device_errors(config, num_devices) + machine_errors(config)
  raise_if(errors)


def launch_errors(config: ml_collections.ConfigDict, processes: int | None) -> list[str]:
  """`config.launch` asking for processes that this run is not (`processes`; None: a local sweep,
  whose trials are one process each). Only `sweep.py --launcher=slurm` starts them (srun)."""
  nodes, tasks = config.launch.nodes, config.launch.tasks_per_node
  wanted = nodes * tasks
  if wanted == 1 or wanted == processes:
    return []
  what = (
    'a local sweep runs each trial as one train.py process'
    if processes is None
    else f'this train.py is {processes} process{"es" if processes > 1 else ""}'
  )
  return [
    f'config.launch.nodes={nodes} x config.launch.tasks_per_node={tasks} asks for {wanted} '
    f'processes, but {what}: config.launch takes effect only with sweep.py --launcher=slurm '
    '(which starts them through srun). Add --launcher=slurm, or leave config.launch at 1 x 1 '
    '(to train on several hosts by hand, start train.py on each: docs/devices.md).'
  ]


def wandb_use(project: str) -> str:
  """What needs the tracking extra (wandb): a run that logs to W&B project `project`."""
  return f'config.wandb.project={project!r} (logging to Weights & Biases)'


def machine_errors(config: ml_collections.ConfigDict) -> list[str]:
  """Resource counts of `config` that this machine cannot serve (`validate` with devices)."""
  cores = os.cpu_count() or 1
  project = config.wandb.project if 'wandb' in config else ''
  if project and (problem := extras.missing('wandb', 'tracking', wandb_use(project))):
    return [f"{problem} Or set config.wandb.project='' to train without W&B."]
  if config.data.num_workers > cores:
    return [
      f'config.data.num_workers={config.data.num_workers} exceeds the {cores} CPU cores of this '
      'machine: each worker is a process that reads and packs batches, and more of them than '
      'cores only take memory and slow each other down (0 packs in the training process).'
    ]
  return []


def _device_errors(config: ml_collections.ConfigDict, num_devices: int) -> list[str]:
  """The mesh over `num_devices`, and batches that divide over it."""
  try:
    sizes = dict(
      zip(sharding.MESH_AXES, sharding.mesh_shape(config.mesh, num_devices), strict=True)
    )
  except ValueError as e:
    return [str(e)]
  shards = sharding.batch_shards(sizes, sharding.axis_rules(config.mesh))
  rows = config.data.tokens_per_batch // config.data.max_len  # Global rows per batch.
  errors = []
  if rows % shards:
    errors.append(
      f'config.data.tokens_per_batch // config.data.max_len = {rows} rows per batch do not '
      f'divide over the {shards} batch shards of the mesh {sizes} (config.mesh).'
    )
  if rows % (config.grad_accum_steps * shards):
    errors.append(
      f'config.grad_accum_steps={config.grad_accum_steps} must divide the {rows} rows per '
      f'batch into equal micro-batches over {shards} batch shards.'
    )
  return errors


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing for entry points with a config flag (`app.run(flags_parser=...)`).

  An override of a key the config lacks (`--config.model.num_layer=2`) is a flag error that
  names the flag and the nearest keys, as absl reports other flag errors, instead of
  ml_collections' traceback.
  """
  try:
    return app.parse_flags_with_usage(list(argv))
  except (AttributeError, KeyError) as e:
    while isinstance(e, AttributeError) and e.args and isinstance(e.args[0], KeyError):
      e = e.args[0]
    first, _, hint = str(e.args[0] if e.args else e).partition('\n')
    missing = first.strip('\'"')
    flag = next(
      (
        arg.split('=', 1)[0]
        for arg in argv[1:]
        if re.match(r'--\w+\.', arg) and missing in arg.split('=', 1)[0].split('.')[1:]
      ),
      None,
    )
    if flag is None:
      raise
    key = flag.split('.', 1)[1]
    sys.stderr.write(
      f'FATAL Flags parsing error: {flag}: the config has no key {key}. {hint}'.rstrip()
      + '\nPass --helpshort or --helpfull to see help on flags.\n'
    )
    sys.exit(1)


# --- eval.py's flags ------------------------------------------------------------------------------

# eval.py's flags -> their domains (the decoder and split are checked where they are used).
DECODE_RULES: dict[str, Rule] = {
  'beam_size': CONFIG_RULES['decode.beam_size'],
  'alpha': CONFIG_RULES['decode.alpha'],
  'max_extra_len': CONFIG_RULES['decode.max_extra_len'],
  'temperature': real(0.0),  # 0: greedy.
  'top_k': integer(0),  # 0: every token.
  'top_p': real(0.0, 1.0, low_open=True),  # 1: every token.
}
# Upper ends of eval.py's batch flags, far beyond any useful batch (the defaults are
# inference.MAX_DECODE_*). Beam search caches every decoder layer's cross-attention keys and
# values for each of the beam's copies of a batch: at 2**20 source tokens a Transformer-big's
# (6 layers x 2 x 4 beams x 2**20 x 1,024 float32) come to about 200 GB, cache alone.
MAX_EVAL_BATCH_TOKENS = 2**20
MAX_EVAL_BATCH_ROWS = 2**16
# sacreBLEU's bootstrap gathers [resamples, sentences, statistics] float32 at once: 10,000
# resamples of WMT14's 3,003 test sentences are 1.2 GB for each score (10x its default).
MAX_BOOTSTRAP = 10_000

EVAL_FLAG_RULES: dict[str, Rule] = {
  **DECODE_RULES,
  'seed': integer(0),
  'batch_size': integer(1, MAX_EVAL_BATCH_ROWS),
  'max_tokens': integer(1, MAX_EVAL_BATCH_TOKENS),  # Source token slots per decoding batch.
  'n_bootstrap': integer(1, MAX_BOOTSTRAP),  # 1: no confidence interval.
  'poll_seconds': POSITIVE_REAL,
  'lengths': Rule(
    'None or positive integers',
    lambda v: v is None or all(str(x).isdigit() and int(x) > 0 for x in v),
  ),  # A list flag: strings.
}


def decode_errors(options: Mapping[str, Any], prefix: str = '') -> list[str]:
  """Errors of decoding options (`DecodeOptions` fields); names get `prefix` ('--' for flags)."""
  return [
    e
    for k, rule in DECODE_RULES.items()
    if k in options
    if (e := rule.error(prefix + k, options[k]))
  ]


def eval_flag_errors(values: Mapping[str, Any]) -> list[str]:
  """Errors of eval.py's flags `{name: value}`, each named `--name=value`."""
  return [
    e
    for k, rule in EVAL_FLAG_RULES.items()
    if k in values
    if (e := rule.error(f'--{k}', values[k]))
  ]
