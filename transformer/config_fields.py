"""Every config field, declared once: its default, its domain, what a change means on resume.

`FIELDS` is the one declaration of each leaf of a training config. Everything else is
derived from it:
- `defaults()`: the `ml_collections.ConfigDict` that configs/default.py returns, which every
  config in configs/ starts from (a config file stays a plain Python file that changes it);
- `config.CONFIG_RULES`: the domain each value is checked against (`config.validate`);
- `config.ModelConfig`: the model's frozen dataclass, one field per `model.` key with the
  same default (plus the vocabulary size and dtype from the top of the config);
- `runs`: which changes a resume allows (`on_resume`), and the value a run written before a
  field existed had (`added_keys`, filled into its config.json by `runs.upgrade`);
- docs/config.md: the reference table (`reference_table`, written by
  `python -m transformer.tools.config_reference`; a test keeps it current);
- the parts handed down (`Part`): frozen dataclasses of the fields one piece of the library
  reads, by name (`optim.OptimizerConfig`, `train_steps.StepConfig`, ...).

A new field is one `Field(...)` line here (a model switch: this line, its implementation and
its test). `before=` says what older runs did without it, so they resume and evaluate as they
were trained.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Iterator
from typing import Any

import ml_collections
from ml_collections import config_dict

from transformer import checkpoint_spec, paper, ranking
from transformer.domains import (
  BOOLEAN,
  NAME,
  OPTIONAL_PATH,
  OPTIONAL_POSITIVE_REAL,
  POSITIVE_INT,
  POSITIVE_REAL,
  PROBABILITY,
  Rule,
  integer,
  is_int,
  one_of,
  real,
)
from transformer.sharding import LOGICAL_AXIS_RULES

# --- The choices of each switch (the first is the paper's, or the default) -----------------------

ARCHITECTURES = ('encoder_decoder', 'decoder_only')
NORMS = ('post_ln', 'pre_ln', 'rmsnorm')
POSITIONS = ('sinusoidal', 'learned', 'rope', 'alibi')
FFN_ACTIVATIONS = ('relu', 'gelu', 'swiglu', 'swish')
# Learning-rate decay after warmup (`optim.learning_rate_schedule`).
SCHEDULES = ('inverse_sqrt', 'linear', 'cosine')
# Schedules that decay to config.num_train_steps: a run's early checkpoints are not a shorter run's.
DECAYING_TO_LAST_STEP = ('linear', 'cosine')
# How attention runs (transformer/attention.py): the fused kernel where it applies, or XLA.
ATTENTION_IMPLS = ('auto', 'xla', 'cudnn', 'pallas')
REMATS = ('none', 'layer')
DTYPE_NAMES = ('float32', 'bfloat16')
# SentencePiece's algorithms and normalization rules: NFKC, or NFKC with case folding (a
# vocabulary that lowercases everything it reads).
SPM_MODEL_TYPES = ('unigram', 'bpe')
SPM_NORMALIZATIONS = ('nmt_nfkc', 'nmt_nfkc_cf')
EVAL_BLEU_DECODERS = ('greedy', 'beam')
WANDB_MODES = ('online', 'offline')


def dataset_registry() -> dict[str, Any]:
  """The dataset registry (`datasets.registry.DATASETS`), by name.

  Imported on first use, not with this module: the model imports the config's module
  (`ModelConfig`), and must not load the data code (TFDS) with it.
  """
  from transformer.datasets import registry  # pylint: disable=g-import-not-at-top

  return registry.DATASETS


DATASET = Rule(lambda: f'one of {tuple(dataset_registry())}', lambda v: v in dataset_registry())
LANGUAGE = Rule(
  'a string (a language code; empty only for a language model)', lambda v: isinstance(v, str)
)
MESH_SIZE = Rule(
  'a positive integer or -1 (all remaining devices)', lambda v: is_int(v) and (v >= 1 or v == -1)
)
# W&B refuses project, entity and group names with any of these characters.
WANDB_NAME = Rule(
  "'' or a name of at most 128 characters without / \\ # ? % :",
  lambda v: isinstance(v, str) and len(v) <= 128 and not set('/\\#?%:') & set(v),
)
INIT_SOURCE = Rule(
  "'' (random parameters), the workdir of a training run (a path or a gs:// URL), or "
  'hf:DIR (a Hugging Face Marian directory, named after the hf:)',
  lambda v: isinstance(v, str) and v == v.strip() and v.strip() != 'hf:',
)
AXIS_RULES = Rule(
  'a sequence of (logical axis, mesh axes) pairs',
  lambda v: (
    isinstance(v, list | tuple) and all(isinstance(e, list | tuple) and len(e) == 2 for e in v)
  ),
)


class OnResume(enum.Enum):
  """What changing a field's value means when a run is resumed (`runs.check_resume`)."""

  FREE = 'may change (logged): neither the model nor the optimizer state depends on it'
  WARN = 'may change (warned): training goes on differently from the checkpoint'
  WEIGHTS = "refused: the checkpoints' weights would be read as another model's"
  START = 'refused: where the parameters started (a resume never initialises again)'


_ALWAYS = object()  # `Field.before` of a field that every run's config.json has.


@dataclasses.dataclass(frozen=True)
class Follows:
  """A default that is another field's value until the field is set (`follows`)."""

  key: str  # The dotted key followed.

  def __repr__(self) -> str:
    return f'follows({self.key!r})'


def follows(key: str) -> Follows:
  """The default of a field that takes `key`'s value (an override of `key` moves it too)
  until it is set itself: `ml_collections`' derived `FieldReference`."""
  return Follows(key)


@dataclasses.dataclass(frozen=True)
class Requirement:
  """A rule across fields, declared with the field it constrains (`Field.requires`).

  `holds(config)` is checked once every value is in its domain (`config.config_errors`);
  `message(config)` says what is wrong, naming the keys.
  """

  holds: Callable[[ml_collections.ConfigDict], bool]
  message: Callable[[ml_collections.ConfigDict], str]


@dataclasses.dataclass(frozen=True)
class Field:
  """One leaf of the config: `key` (dotted), its default, domain, resume meaning and doc.

  `before`: the value that runs written before the field existed had (`added_keys`);
  `placeholder`: the type of a default of None (`ml_collections` placeholders keep overrides
  typed). A default or `before` may be `follows(KEY)`: another field's value. `requires`: the
  rules across fields this one must keep (`Requirement`).
  """

  key: str
  default: Any
  domain: Rule
  on_resume: OnResume
  doc: str
  before: Any = _ALWAYS
  placeholder: type | None = None
  requires: tuple[Requirement, ...] = ()


FREE, WARN, WEIGHTS, START = OnResume.FREE, OnResume.WARN, OnResume.WEIGHTS, OnResume.START

FIELDS: tuple[Field, ...] = (
  Field('seed', 0, integer(0), WARN, 'Root of every PRNG key: parameters, dropout and data order.'),
  Field('dtype', 'float32', one_of(DTYPE_NAMES), WARN, "Activation/matmul dtype: 'float32' or 'bfloat16'."),
  Field('vocab_size', 8000, integer(8), WEIGHTS, 'Shared SentencePiece vocabulary size (both languages).'),
  # Optimisation (section 5.3 of the paper).
  Field('num_train_steps', 1500, POSITIVE_INT, FREE, 'Optimizer updates to train for (~15 epochs).'),
  Field('warmup_steps', 400, POSITIVE_INT, WARN, 'Steps of linear warmup to the peak learning rate (paper: 4000).'),
  Field('lr_scale', 0.5, POSITIVE_REAL, WARN, 'Multiplier on d_model^-0.5 * min(step^-0.5, step*warmup^-1.5).'),
  Field('schedule', 'inverse_sqrt', one_of(SCHEDULES), WARN, "After warmup: 'inverse_sqrt' (paper), 'linear' or 'cosine'.", before='inverse_sqrt'),
  Field('peak_learning_rate', None, OPTIONAL_POSITIVE_REAL, WARN, "At warmup's end; None: lr_scale's.", before=None, placeholder=float),
  Field('final_lr_fraction', 0.0, real(0.0, 1.0), WARN, 'linear/cosine: rate at num_train_steps, a fraction of the peak.', before=0.0),
  Field('weight_decay', 0.0, real(0.0), WARN, "AdamW's decoupled decay (0: Adam); not of biases and norm scales.", before=0.0),
  Field('adam_b1', 0.9, PROBABILITY, WARN, 'Adam beta1 (paper: 0.9).'),
  Field('adam_b2', 0.98, PROBABILITY, WARN, 'Adam beta2 (paper: 0.98).'),
  Field('adam_eps', 1e-9, POSITIVE_REAL, WARN, 'Adam epsilon (paper: 1e-9).'),
  Field('label_smoothing', 0.1, PROBABILITY, WARN, 'Label smoothing epsilon_ls (section 5.4).'),
  Field('grad_accum_steps', 1, POSITIVE_INT, WARN, 'Micro-batches accumulated per optimizer update.'),
  Field('grad_clip_norm', 0.0, real(0.0), WARN, 'Clip gradients to this global L2 norm first (0: off, the paper).', before=0.0),
  Field('skip_nonfinite_steps', False, BOOLEAN, FREE, 'NaN/inf loss or grad norm: skip the update, not stop.'),
  # Logging, evaluation and checkpoints.
  Field('log_every_steps', 25, POSITIVE_INT, FREE, 'Console/metrics cadence for training rows.'),
  Field('eval_every_steps', 250, POSITIVE_INT, FREE, 'Validation loss cadence (always also at the end).'),
  Field('eval_bleu_sentences', 512, integer(0), WARN, 'Validation sentences decoded for BLEU per eval (0: off).'),
  Field('eval_bleu_decoder', 'greedy', one_of(EVAL_BLEU_DECODERS), WARN, "'greedy' or 'beam' (config.decode's) for that BLEU."),
  Field('checkpoint_every_steps', 100, POSITIVE_INT, FREE, 'Checkpoint cadence (always also at the end).'),
  Field('keep_checkpoints', 5, POSITIVE_INT, FREE, 'Most recent checkpoints kept on disk.'),
  # The next two select by validation BLEU: eval_bleu_lc where it is config.target_metric, else
  # the cased eval_bleu (`ranking.selection_metric`).
  Field('keep_best_checkpoints', 0, integer(0), FREE, 'Also keep the params of the N best val-BLEU evals (0: none).', before=0),
  Field('early_stopping_patience', 0, integer(0), FREE, 'Stop after N evals without a better val BLEU (0: never).', before=0),
  Field('target_metric', 'eval_bleu', one_of(ranking.TARGET_METRICS), FREE, f'Ranks sweeps: one of {ranking.TARGET_METRICS}.'),
  # Fine-tuning (docs/training.md): the parameters of another run; optimizer, schedule, data anew.
  Field('init_from', '', INIT_SOURCE, START, "That run's workdir (a path or gs://), or hf:DIR; '': random.", before=''),
  Field('init_checkpoint', 'latest', checkpoint_spec.RULE, START, "As eval.py's --checkpoint: 'latest', a step, 'avg:N', 'best'.", before='latest'),
  # Decoding (section 6.1): eval.py's defaults (its flags override them), validation BLEU's beam.
  Field('decode.beam_size', paper.BEAM_SIZE, POSITIVE_INT, FREE, f'Beam width (paper: {paper.BEAM_SIZE}).', before=paper.BEAM_SIZE),
  Field('decode.alpha', paper.LENGTH_PENALTY_ALPHA, real(0.0), FREE, f'GNMT length penalty exponent (paper: {paper.LENGTH_PENALTY_ALPHA}; 0: none).', before=paper.LENGTH_PENALTY_ALPHA),
  Field('decode.max_extra_len', paper.MAX_EXTRA_LEN, POSITIVE_INT, FREE, f'Output limit: source length + this (paper: {paper.MAX_EXTRA_LEN}).', before=paper.MAX_EXTRA_LEN),
  Field('decode.checkpoint', 'latest', checkpoint_spec.RULE, FREE, "Scored: 'latest', a step, 'avg:N', 'best', 'avg_best:N'.", before='latest'),
  # Model (section 3); read through config.ModelConfig.
  Field('model.architecture', 'encoder_decoder', one_of(ARCHITECTURES), WEIGHTS, "Or 'decoder_only' (a language model).", before='encoder_decoder'),
  Field('model.num_layers', 3, POSITIVE_INT, WEIGHTS, 'N: layers in the encoder and in the decoder.'),
  Field('model.d_model', 256, POSITIVE_INT, WEIGHTS, 'd_model: width of the residual stream.'),
  Field('model.num_heads', 4, POSITIVE_INT, WEIGHTS, 'h: attention heads; d_k = d_v = d_model / h.'),
  Field('model.num_kv_heads', follows('model.num_heads'), POSITIVE_INT, WEIGHTS, 'Key/value heads, each shared by num_heads / num_kv_heads query heads (GQA; 1: multi-query).', before=follows('model.num_heads'), requires=(
    Requirement(
      lambda c: c.model.num_heads % c.model.num_kv_heads == 0,
      lambda c: f'config.model.num_kv_heads={c.model.num_kv_heads} must divide config.model.num_heads={c.model.num_heads}: each key/value head serves a group of query heads.',
    ),
    Requirement(  # Where the mesh is known: the tensor axis splits the key/value heads.
      lambda c: 'mesh' not in c or c.mesh.tensor < 1 or c.model.num_kv_heads % c.mesh.tensor == 0,
      lambda c: f'config.model.num_kv_heads={c.model.num_kv_heads} does not divide over config.mesh.tensor={c.mesh.tensor}, which splits the key/value heads: choose a multiple of it, or a smaller config.mesh.tensor.',
    ),
  )),
  Field('model.d_ff', 1024, POSITIVE_INT, WEIGHTS, 'd_ff: inner width of the position-wise FFN.'),
  Field('model.dropout_rate', 0.1, PROBABILITY, WARN, 'P_drop on sub-layer outputs and embedding sums.'),
  Field('model.attention_dropout_rate', 0.0, PROBABILITY, WARN, 'Dropout on attention weights (paper: none).'),
  Field('model.ffn_dropout_rate', 0.0, PROBABILITY, WARN, "Dropout on the FFN's activation, after act() (paper: none).", before=0.0),
  Field('model.norm', 'post_ln', one_of(NORMS), WEIGHTS, "'post_ln' (paper), 'pre_ln' or 'rmsnorm' (pre-norm RMSNorm)."),
  Field('model.position', 'sinusoidal', one_of(POSITIONS), WEIGHTS, "'sinusoidal' (paper), 'learned', 'rope' or 'alibi'.", before='sinusoidal'),
  Field('model.ffn_activation', 'relu', one_of(FFN_ACTIVATIONS), WEIGHTS, "'relu' (paper), 'gelu', 'swiglu' or 'swish' (Marian).", before='relu'),
  Field('model.use_bias', True, BOOLEAN, WEIGHTS, 'Biases in attention/FFN Dense layers and LayerNorm (paper: yes).', before=True),
  Field('model.norm_epsilon', 1e-6, real(0.0, 0.1, low_open=True), WEIGHTS, 'Epsilon of every LayerNorm/RMSNorm (Marian, PyTorch: 1e-5).', before=1e-6),
  Field('model.logits_bias', False, BOOLEAN, WEIGHTS, 'A learned bias on the softmax logits (paper: none).', before=False),
  Field('model.qk_norm', False, BOOLEAN, WEIGHTS, "Normalise each head's queries and keys before q.k (QK-norm; paper: no).", before=False),
  Field('model.share_embeddings', True, BOOLEAN, WEIGHTS, 'One matrix for source, target and softmax (3.4).'),
  Field('model.max_len', 512, POSITIVE_INT, WEIGHTS, 'Longest position the model supports.'),
  Field('model.attention_impl', 'auto', one_of(ATTENTION_IMPLS), FREE, "'auto' (cuDNN on GPUs, Pallas on TPUs where they apply), 'xla', 'cudnn', 'pallas'.", before='auto'),
  Field('model.remat', 'none', one_of(REMATS), FREE, "'layer': recompute each layer's activations for gradients.", before='none'),
  # Data.
  Field('data.dataset', 'multi30k', DATASET, WARN, "'multi30k', 'parallel_text', 'wmt14_translate/de-en'; LMs: 'text_lines', 'lm1b'."),
  Field('data.source_lang', 'en', LANGUAGE, WEIGHTS, 'Source language code (explicit: never reversed).'),
  Field('data.target_lang', 'de', NAME, WEIGHTS, "Target language code (a language model's text_lines language)."),
  Field('data.manual_dir', None, OPTIONAL_PATH, FREE, 'Local raw files; None: download.', placeholder=str),
  Field('data.data_dir', '~/tensorflow_datasets', NAME, FREE, 'Where prepared TFDS data is written.'),
  Field('data.vocab_path', None, OPTIONAL_PATH, FREE, 'SentencePiece model; None: beside data.', placeholder=str),
  Field('data.target_vocab_path', None, OPTIONAL_PATH, FREE, 'Imported target model; None: one (by path: its content is a recorded input).', before=None, placeholder=str),
  Field('data.train_split', 'train', NAME, WARN, 'Split to train on.'),
  Field('data.eval_split', 'validation', NAME, WARN, 'Split for validation loss.'),
  Field('data.test_split', 'test_2016_flickr', NAME, WARN, 'Default split for eval.py.'),
  Field('data.max_len', 64, integer(2), WARN, 'Max tokens per side (with EOS) in training; longer is dropped.'),
  Field('data.max_eval_len', 256, integer(2), WARN, 'Packed row length for evaluation (never drops a line).'),
  Field('data.tokens_per_batch', 4096, POSITIVE_INT, WARN, 'Global token budget per side per batch.'),
  Field('data.spm_train_sentences', 1_000_000, POSITIVE_INT, WARN, 'Sentences sampled to train SentencePiece.'),
  Field('data.spm_model_type', 'unigram', one_of(SPM_MODEL_TYPES), WEIGHTS, "SentencePiece's 'unigram' or 'bpe' (a vocabulary each).", before='unigram'),
  Field('data.spm_normalization', 'nmt_nfkc', one_of(SPM_NORMALIZATIONS), WEIGHTS, "'nmt_nfkc', or 'nmt_nfkc_cf': lowercases all text.", before='nmt_nfkc'),
  Field('data.num_workers', 0, integer(0), WARN, 'Grain worker processes reading/packing training batches (0: none).'),
  Field('data.lines_per_document', 1, POSITIVE_INT, WARN, 'Language models: consecutive lines joined per document.'),
  # Device mesh; one axis may be -1 (all remaining devices).
  Field('mesh.data', -1, MESH_SIZE, WARN, 'Data-parallel replicas.'),
  Field('mesh.fsdp', 1, MESH_SIZE, WARN, 'Fully sharded data parallel (params and optimizer state).'),
  Field('mesh.tensor', 1, MESH_SIZE, WARN, 'Tensor parallel (heads, mlp, vocab).'),
  Field('mesh.rules', LOGICAL_AXIS_RULES, AXIS_RULES, WARN, 'Logical axis -> mesh axes (sharding.LOGICAL_AXIS_RULES).', before=LOGICAL_AXIS_RULES),
  # Processes of the run, as `sweep.py --launcher=slurm` asks Slurm for them (one srun task each;
  # train.py itself runs with the processes it is started with, see transformer/distributed.py).
  Field('launch.nodes', 1, POSITIVE_INT, FREE, 'Hosts (Slurm nodes) the run spans.', before=1),
  Field('launch.tasks_per_node', 1, POSITIVE_INT, FREE, 'Processes per host: 1 with all its devices, or 1 per GPU.', before=1),
  # Weights & Biases, opt-in (transformer/wandb_run.py): the rows and config of the run.
  Field('wandb.project', '', WANDB_NAME, FREE, "W&B project to log to ('': off; needs requirements/tracking.txt).", before=''),
  Field('wandb.entity', '', WANDB_NAME, FREE, "W&B user or team ('': the login's default).", before=''),
  Field('wandb.group', '', WANDB_NAME, FREE, "Groups runs in W&B, e.g. a sweep's trials ('': none).", before=''),
  Field('wandb.mode', 'online', one_of(WANDB_MODES), FREE, "'offline': kept under WORKDIR/wandb/ for a later `wandb sync`.", before='online'),
)  # fmt: skip

BY_KEY: dict[str, Field] = {field.key: field for field in FIELDS}


def defaults() -> ml_collections.ConfigDict:
  """A new config holding every field's default (what configs/default.py returns)."""
  config = ml_collections.ConfigDict()
  following = []
  for field in FIELDS:
    *groups, leaf = field.key.split('.')
    target = config
    for group in groups:
      if group not in target:
        target[group] = ml_collections.ConfigDict()
      target = target[group]
    value = field.default
    if value is None and field.placeholder is not None:
      value = config_dict.placeholder(field.placeholder)
    if isinstance(value, Follows):
      following.append((target, leaf, value.key))
      continue
    target[leaf] = value
  for target, leaf, key in following:  # Once the followed fields exist.
    *groups, followed = key.split('.')
    source = config
    for group in groups:
      source = source[group]
    target[leaf] = source.get_ref(followed).identity()
  return config


def value_of(config: ml_collections.ConfigDict | dict, key: str) -> Any:
  """The value of dotted `key` in `config`."""
  for name in key.split('.'):
    config = config[name]
  return config


def with_values(
  config: ml_collections.ConfigDict, values: dict[str, Any]
) -> ml_collections.ConfigDict:
  """A copy of `config` with `{'model.d_ff': 48, ...}` set (dotted keys; `config` is kept).

  A deep copy keeps the references of following defaults (`follows`): setting
  `model.num_heads` moves `model.num_kv_heads` along, as the command line does.
  """
  copied = copy.deepcopy(config)
  for key, value in values.items():
    *parents, leaf = key.split('.')
    node = copied
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return copied


def resolved_default(field: Field) -> Any:
  """`field`'s default value: its own, or that of the field it follows (`follows`)."""
  default = field.default
  return resolved_default(BY_KEY[default.key]) if isinstance(default, Follows) else default


def default_type(field: Field) -> type:
  """The type of `field`'s values: its default's, or that of the field it follows."""
  return type(resolved_default(field))


def keys(on_resume: OnResume | None = None, group: str = '') -> tuple[str, ...]:
  """The dotted keys (of `on_resume`, of the group `group`, e.g. 'model'), in declared order."""
  prefix = f'{group}.' if group else ''
  return tuple(
    f.key
    for f in FIELDS
    if f.key.startswith(prefix) and (on_resume is None or f.on_resume == on_resume)
  )


def on_resume(key: str) -> OnResume:
  """What a change of `key` means on resume; a key no longer declared (in an older run's
  config.json) counts as a model field if it is one, else as a warned change."""
  if key in BY_KEY:
    return BY_KEY[key].on_resume
  return WEIGHTS if key.startswith('model.') else WARN


def added_keys() -> dict[str, Any]:
  """{key: the value runs written before it existed had} (`runs.upgrade` fills them in)."""
  return {f.key: f.before for f in FIELDS if f.before is not _ALWAYS}


def model_fields() -> Iterator[Field]:
  """The `model.` fields, in declared order: `config.ModelConfig`'s fields."""
  return (f for f in FIELDS if f.key.startswith('model.'))


def unmapped_switches(mapped: tuple[str, ...], model_config: Any) -> list[str]:
  """`model.` keys outside `mapped` (an exporter's) whose value makes another model than
  their default would: the value itself is compared, so a following default
  (`num_kv_heads` equal to `num_heads`) is the model the exporter knows.

  An exporter names the fields its format expresses; a switch declared after it was written
  is then refused by name instead of exported wrongly.
  """
  name = lambda key: key.split('.', 1)[1]

  def default(field: Field) -> Any:
    following = isinstance(field.default, Follows)
    return getattr(model_config, name(field.default.key)) if following else field.default

  return [
    f'config.{f.key}={getattr(model_config, name(f.key))!r}'
    for f in model_fields()
    if f.key not in mapped
    and f.on_resume == WEIGHTS
    and getattr(model_config, name(f.key)) != default(f)
  ]


def from_key(config_key: str) -> Any:
  """A `Part` field read from the config field `config_key` (dotted) instead of its own name."""
  return dataclasses.field(metadata={'key': config_key})


class Part:
  """Base of a frozen dataclass of some config fields: what one part of the library reads.

  The config is checked once (`config.validate`) and handed down in parts: the optimizer gets
  `optim.OptimizerConfig`, the jitted step `train_steps.StepConfig`, and so on, never the whole
  `ConfigDict`. Each dataclass field is the declared field of its own name (or `from_key`'s);
  defaults and domains stay in `FIELDS` alone, and a test checks that every part's keys are
  declared.
  """

  @classmethod
  def config_keys(cls) -> tuple[str, ...]:
    """The dotted config key of each field, in field order."""
    return tuple(f.metadata.get('key', f.name) for f in dataclasses.fields(cls))

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict):
    """The part's fields read from `config` (a checked training config)."""
    fields = zip(dataclasses.fields(cls), cls.config_keys(), strict=True)
    return cls(**{field.name: value_of(config, key) for field, key in fields})


def reference_table() -> str:
  """docs/config.md's table: every field, its default, domain and resume meaning."""
  meaning = {FREE: 'free', WARN: 'warned', WEIGHTS: 'refused (weights)', START: 'refused (start)'}
  rows = [
    '| key | default | domain | on resume | runs before it | what it is |',
    '| --- | --- | --- | --- | --- | --- |',
  ]
  for f in FIELDS:
    text = f.domain.text if isinstance(f.domain.text, str) else f.domain.text()
    before = '' if f.before is _ALWAYS else f'`{f.before!r}`'
    default = f'`{f.default!r}`'  # follows('model.num_heads') for a following default.
    if f.key == 'mesh.rules':
      default = before = '`sharding.LOGICAL_AXIS_RULES`'
    rows.append(
      f'| `{f.key}` | {default} | {text.replace("|", "/")} | {meaning[f.on_resume]} | '
      f'{before} | {f.doc.replace("|", "/")} |'
    )
  return '\n'.join(rows) + '\n'
