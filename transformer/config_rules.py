"""The rules across config keys: each takes a config whose single values are in their domains
(`config.config_errors` checks those first) and returns errors naming the keys.

A rule that relates fields of one group is declared beside them (`config_fields.Requirement`,
read by `requirement_errors`); the rules here are those that read several groups or the
registries. `CROSS_CHECKS` is what `config.config_errors` runs; `platform_errors`,
`checkpoint_kept_errors` and `sweep_target_errors` are called by the commands that know the
devices, the checkpoint asked for, or that a sweep ranks its trials.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import ml_collections

from transformer import checkpoint_spec, config_fields, ranking, sharding
from transformer.config_fields import DECAYING_TO_LAST_STEP


def requirement_errors(c, group: str = 'model') -> list[str]:
  """The broken rules declared with the fields (`config_fields.Requirement`): of the fields of
  `group` ('model'), or of every other field (`group=''`)."""
  return [
    requirement.message(c)
    for field in config_fields.FIELDS
    if field.key.startswith('model.') == (group == 'model')
    for requirement in field.requires
    if not requirement.holds(c)
  ]


def model_rule_errors(c) -> list[str]:
  m = c.model
  errors = requirement_errors(c)
  if m.num_heads >= 1 and m.d_model % m.num_heads:
    errors.append(
      f'config.model.d_model={m.d_model} is not divisible by config.model.num_heads={m.num_heads}.'
    )
  elif m.position == 'rope' and m.num_heads >= 1 and m.d_model % (2 * m.num_heads):
    errors.append(
      f"config.model.position='rope' rotates pairs of dimensions: the head dim "
      f'config.model.d_model / num_heads = {m.d_model / m.num_heads:g} must be even.'
    )
  return errors


def _schedule_errors(c) -> list[str]:
  if c.schedule in DECAYING_TO_LAST_STEP and c.num_train_steps <= c.warmup_steps:
    return [
      f'config.schedule={c.schedule!r} decays from the end of warmup to config.num_train_steps: '
      f'config.num_train_steps={c.num_train_steps} must exceed '
      f'config.warmup_steps={c.warmup_steps}.'
    ]
  return []


def _decode_checkpoint_errors(c) -> list[str]:
  """eval.py's default checkpoint must be one the run keeps."""
  return checkpoint_kept_errors(c, c.decode.checkpoint, 'config.decode.checkpoint')


def checkpoint_kept_errors(c, spec: str, name: str, advice: bool = False) -> list[str]:
  """[An error] if a run of config `c` keeps fewer checkpoints than eval.py's `spec` reads.

  'avg:N' reads the last N of the `keep_checkpoints`, 'best' and 'avg_best:N' the best of
  the `keep_best_checkpoints`; `name` names the value ('--checkpoint', ...), `advice` adds
  what to do instead. `spec` is in its domain (`checkpoint_spec.RULE`).
  """
  parsed = checkpoint_spec.parse(spec)
  count = parsed.count
  if parsed.kind == 'avg' and count > c.keep_checkpoints:
    return [
      f'{name}={spec!r} averages the last {count} checkpoints, but '
      f'config.keep_checkpoints={c.keep_checkpoints} keeps {c.keep_checkpoints}.'
      + (f' Average at most {c.keep_checkpoints}.' if advice else '')
    ]
  if parsed.is_best and count > c.keep_best_checkpoints:
    best = 'the best checkpoint' if count == 1 else f'the {count} best checkpoints'
    return [
      f'{name}={spec!r} reads {best} by validation '
      f'BLEU, but config.keep_best_checkpoints={c.keep_best_checkpoints} keeps '
      f'{c.keep_best_checkpoints or "none"}.'
      + (
        f' Train with config.keep_best_checkpoints={count} (and config.eval_bleu_sentences '
        "> 0), or read another checkpoint ('latest', 'avg:N')."
        if advice
        else ''
      )
    ]
  return []


def _init_errors(c) -> list[str]:
  """A checkpoint of config.init_from named without config.init_from would be ignored."""
  if c.init_checkpoint != 'latest' and not c.init_from:
    return [
      f'config.init_checkpoint={c.init_checkpoint!r} names a checkpoint of config.init_from, '
      "which is '' (random parameters): set config.init_from to the run to start from, or "
      'drop the config.init_checkpoint override.'
    ]
  return []


def platform_errors(config: ml_collections.ConfigDict, platform: str) -> list[str]:
  """What `config` cannot run on devices of `platform` ('cpu', 'gpu', 'tpu')."""
  impl = config.model.attention_impl
  needs = {'cudnn': ('gpu', 'NVIDIA GPUs (cuDNN)'), 'pallas': ('tpu', "TPUs (JAX's Pallas kernel)")}
  if impl in needs and platform != needs[impl][0]:
    return [
      f'config.model.attention_impl={impl!r} needs {needs[impl][1]}, but the devices are '
      f"{platform.upper()}s: use 'auto' (the fused kernel where it applies) or 'xla'."
    ]
  return []


def _attention_errors(c) -> list[str]:
  impl, m = c.model.attention_impl, c.model
  errors = []
  if impl == 'cudnn' and c.dtype != 'bfloat16':
    errors.append(
      f"config.model.attention_impl='cudnn' runs in bfloat16 only: set config.dtype='bfloat16' "
      f"(it is {c.dtype!r}), or attention_impl='auto'."
    )
  if impl == 'pallas':
    # What TPUs' splash attention (transformer/tpu_attention.py) cannot express: every training
    # call would take another path, so the run is refused rather than served by XLA unannounced.
    refused = []
    if m.position == 'alibi':
      refused.append(("config.model.position='alibi'", 'adds no bias to the logits'))
    if m.attention_dropout_rate > 0:
      setting = f'config.model.attention_dropout_rate={m.attention_dropout_rate}'
      refused.append((setting, 'drops no attention weights'))
    errors += [
      f"config.model.attention_impl='pallas' cannot take {setting}: the TPU kernel (splash "
      f"attention) {reason}. Use attention_impl='auto' (such attention then runs in the "
      'einsum) or drop the setting.'
      for setting, reason in refused
    ]
  return errors


def _length_errors(c) -> list[str]:
  d = c.data
  errors = []
  if d.max_len > c.model.max_len or d.max_eval_len > c.model.max_len:
    errors.append(
      f'config.data.max_len={d.max_len} and config.data.max_eval_len={d.max_eval_len} must '
      f'not exceed config.model.max_len={c.model.max_len}.'
    )
  if d.tokens_per_batch % d.max_len:
    errors.append(
      f'config.data.tokens_per_batch={d.tokens_per_batch} must be a positive '
      f'multiple of config.data.max_len={d.max_len}.'
    )
  return errors


def _task_errors(c) -> list[str]:
  """A language model and its data, or a translation model and its languages, fit together."""
  decoder_only = c.model.architecture == 'decoder_only'
  monolingual = tuple(
    name for name, entry in config_fields.dataset_registry().items() if entry.monolingual
  )
  errors = []
  if decoder_only and c.data.get('target_vocab_path'):
    errors.append(
      f'config.data.target_vocab_path={c.data.target_vocab_path!r} names a vocabulary of a '
      'target side, which a decoder_only model on monolingual text has not: leave it unset.'
    )
  target, source = c.data.get('target_vocab_path'), c.data.vocab_path
  if (
    target
    and source
    and os.path.abspath(os.path.expanduser(target)) == os.path.abspath(os.path.expanduser(source))
  ):
    errors.append(
      f'config.data.target_vocab_path={target!r} names the file of config.data.vocab_path: '
      "the target side's own vocabulary is another file (a new one is written there from an "
      'imported model); leave it unset where one vocabulary segments both sides.'
    )
  if decoder_only != (c.data.dataset in monolingual):
    errors.append(
      f'config.model.architecture={c.model.architecture!r} does not fit '
      f'config.data.dataset={c.data.dataset!r}: a decoder_only model trains on '
      f'monolingual text {monolingual}, an encoder_decoder one on parallel text.'
    )
  uses_bleu = [
    f'config.{key}={c[key]}'
    for key in ('keep_best_checkpoints', 'early_stopping_patience')
    if c[key]
  ]
  if uses_bleu and not c.eval_bleu_sentences:
    errors.append(
      f'{" and ".join(uses_bleu)}: selecting by validation BLEU needs '
      'config.eval_bleu_sentences > 0 (a translation model); it is 0.'
    )
  if decoder_only and c.eval_bleu_sentences:
    errors.append(
      f'config.eval_bleu_sentences={c.eval_bleu_sentences} must be 0 for a '
      'decoder_only model: BLEU scores translations.'
    )
  if decoder_only and c.target_metric != 'eval_loss':
    errors.append(
      f'config.target_metric={c.target_metric!r} ranks translations; use '
      "'eval_loss' for a decoder_only model."
    )
  folded = c.data.spm_normalization == 'nmt_nfkc_cf'
  if uses_bleu and folded and ranking.selection_metric(c.target_metric) == 'eval_bleu':
    errors.append(
      f'{" and ".join(uses_bleu)} select by config.target_metric={c.target_metric!r}, '
      "which selects by cased BLEU (eval_bleu), but config.data.spm_normalization='nmt_nfkc_cf' "
      "translates into lowercase: set config.target_metric='eval_bleu_lc'."
    )
  if not decoder_only and not c.data.source_lang.strip():
    errors.append('config.data.source_lang is empty: a translation model needs a source language.')
  elif not decoder_only and c.data.source_lang == c.data.target_lang:
    errors.append(f'config.data.source_lang and target_lang are both {c.data.source_lang!r}.')
  return errors


def sweep_target_errors(c) -> list[str]:
  """[An error] if nothing a run of `c` writes ranks it by `config.target_metric` (a sweep's).

  A BLEU target needs the validation BLEU of `config.eval_bleu_sentences` sentences. A single
  train.py run may do without (the target only ranks a sweep's trials); a sweep may not.
  """
  if c.target_metric in ranking.SELECTION_METRICS and not c.eval_bleu_sentences:
    return [
      f'config.target_metric={c.target_metric!r} ranks the trials by their validation BLEU, '
      f'but config.eval_bleu_sentences={c.eval_bleu_sentences} computes none, so no trial '
      'could be ranked: set config.eval_bleu_sentences > 0 (validation sentences decoded '
      "for BLEU at each evaluation), or config.target_metric='eval_loss'."
    ]
  return []


def _mesh_rule_errors(c) -> list[str]:
  try:
    sharding.axis_rules(c.mesh)
  except ValueError as e:
    return [str(e)]
  return []


# Each takes a config whose single values are in their domains; returns errors naming the keys.
CROSS_CHECKS: tuple[Callable[[ml_collections.ConfigDict], list[str]], ...] = (
  model_rule_errors,
  lambda c: requirement_errors(c, group=''),
  _schedule_errors,
  _decode_checkpoint_errors,
  _init_errors,
  _attention_errors,
  _length_errors,
  _task_errors,
  _mesh_rule_errors,
)
