"""The one validation table: every config field has a domain, and values outside it are named."""

import dataclasses
import importlib
import math
import pathlib

import ml_collections
import pytest

from configs import default, lm_default, tiny
from transformer import config as config_lib
from transformer import inference, path_checks, ranking, runs
from transformer.tools import sweeps

CONFIGS = sorted(
  p.stem
  for p in (pathlib.Path(__file__).parents[1] / 'configs').glob('*.py')
  if p.stem != '__init__'
)


@pytest.mark.parametrize('name', CONFIGS)
def test_every_field_of_every_config_has_a_rule_and_is_valid(name):
  config = importlib.import_module(f'configs.{name}').get_config()
  keys = list(config_lib.flatten(config))
  assert not sorted(set(keys) - set(config_lib.CONFIG_RULES)), (
    f'configs/{name}.py has fields without a rule in config_lib.CONFIG_RULES: add one line '
    'per field there.'
  )
  assert config_lib.config_errors(config) == []


@pytest.mark.parametrize(
  ('key', 'value', 'message'),
  [
    ('model.dropout_rate', 1.0, 'config.model.dropout_rate=1.0 must be a finite number in [0, 1)'),
    ('label_smoothing', -0.1, 'config.label_smoothing=-0.1 must be a finite number in [0, 1)'),
    ('adam_b2', math.nan, 'config.adam_b2=nan must be a finite number in [0, 1)'),
    ('lr_scale', 0.0, 'config.lr_scale=0.0 must be a finite positive number'),
    ('adam_eps', math.inf, 'config.adam_eps=inf must be a finite positive number'),
    ('warmup_steps', 0, 'config.warmup_steps=0 must be a positive integer'),
    ('data.tokens_per_batch', -4096, 'config.data.tokens_per_batch=-4096 must be a positive'),
    ('eval_bleu_sentences', -1, 'config.eval_bleu_sentences=-1 must be an integer >= 0'),
    ('eval_bleu_decoder', 'sample', "config.eval_bleu_decoder='sample' is not one of"),
    (
      'target_metric',
      'bleu',
      "config.target_metric='bleu' is not one of ('eval_bleu', 'eval_bleu_lc', 'eval_loss')",
    ),
    ('data.dataset', 'multi31k', "config.data.dataset='multi31k' is not one of"),
    ('dtype', 'float16', "config.dtype='float16' is not one of ('float32', 'bfloat16')"),
    ('mesh.fsdp', 0, 'config.mesh.fsdp=0 must be a positive integer or -1'),
    ('grad_clip_norm', -1.0, 'config.grad_clip_norm=-1.0 must be a finite number in [0, inf)'),
    ('schedule', 'exponential', "config.schedule='exponential' is not one of ('inverse_sqrt',"),
    ('peak_learning_rate', 0.0, 'config.peak_learning_rate=0.0 must be None or a finite positive'),
    ('final_lr_fraction', 1.5, 'config.final_lr_fraction=1.5 must be a finite number in [0, 1]'),
    ('weight_decay', -0.01, 'config.weight_decay=-0.01 must be a finite number in [0, inf)'),
    ('decode.beam_size', 0, 'config.decode.beam_size=0 must be a positive integer'),
    ('decode.alpha', -0.5, 'config.decode.alpha=-0.5 must be a finite number in [0, inf)'),
    ('decode.checkpoint', 'avg:0', "config.decode.checkpoint='avg:0' must be 'latest', a step"),
    ('decode.checkpoint', 'last', "config.decode.checkpoint='last' must be 'latest', a step"),
    ('data.spm_model_type', 'char', "config.data.spm_model_type='char' is not one of ('unigram',"),
    (
      'data.spm_normalization',
      'lower',
      "config.data.spm_normalization='lower' is not one of ('nmt_nfkc', 'nmt_nfkc_cf')",
    ),
    ('keep_best_checkpoints', -1, 'config.keep_best_checkpoints=-1 must be an integer >= 0'),
    ('early_stopping_patience', -2, 'config.early_stopping_patience=-2 must be an integer >= 0'),
  ],
)
def test_a_value_outside_its_domain_is_named(key, value, message):
  config = sweeps.apply_overrides(tiny.get_config(), {key: value})
  with pytest.raises(config_lib.ConfigError, match='Invalid config') as error:
    config_lib.validate(config, num_devices=1)
  assert message in str(error.value)


def test_every_error_is_listed_at_once():
  config = sweeps.apply_overrides(
    default.get_config(), {'lr_scale': -1.0, 'seed': -3, 'model.num_heads': 0}
  )
  errors = config_lib.config_errors(config)
  assert errors == [
    'config.seed=-3 must be an integer >= 0.',
    'config.lr_scale=-1.0 must be a finite positive number.',
    'config.model.num_heads=0 must be a positive integer.',
  ]


def test_a_field_following_an_invalid_value_is_not_named_twice():
  """model.num_kv_heads follows model.num_heads: its own error only when it is set apart."""
  assert config_lib.model_errors(
    sweeps.apply_overrides(default.get_config(), {'model.num_heads': 0})
  ) == ['config.model.num_heads=0 must be a positive integer.']
  assert config_lib.config_errors(
    sweeps.apply_overrides(default.get_config(), {'model.num_kv_heads': 0})
  ) == ['config.model.num_kv_heads=0 must be a positive integer.']
  assert config_lib.config_errors(
    sweeps.apply_overrides(default.get_config(), {'model.num_heads': -1, 'model.num_kv_heads': 0})
  ) == [
    'config.model.num_heads=-1 must be a positive integer.',
    'config.model.num_kv_heads=0 must be a positive integer.',
  ]


@pytest.mark.parametrize(
  ('overrides', 'message'),
  [
    (
      {'data.max_len': 48, 'data.tokens_per_batch': 100},
      'config.data.tokens_per_batch=100 must be a positive multiple of config.data.max_len=48',
    ),
    ({'data.max_eval_len': 600}, 'must not exceed config.model.max_len=512'),
    ({'data.source_lang': 'de'}, "config.data.source_lang and target_lang are both 'de'"),
    ({'model.position': 'rope', 'model.d_model': 24, 'model.num_heads': 8}, 'must be even'),
    (
      {'schedule': 'cosine', 'num_train_steps': 400, 'warmup_steps': 400},
      'config.num_train_steps=400 must exceed config.warmup_steps=400',
    ),
    (
      {'keep_best_checkpoints': 3, 'early_stopping_patience': 5, 'eval_bleu_sentences': 0},
      'config.keep_best_checkpoints=3 and config.early_stopping_patience=5: selecting by '
      'validation BLEU needs config.eval_bleu_sentences > 0',
    ),
    (
      {'data.spm_normalization': 'nmt_nfkc_cf', 'early_stopping_patience': 5},
      "config.early_stopping_patience=5 select by config.target_metric='eval_bleu', which selects "
      "by cased BLEU (eval_bleu), but config.data.spm_normalization='nmt_nfkc_cf' translates into "
      "lowercase: set config.target_metric='eval_bleu_lc'.",
    ),
    (
      {'decode.checkpoint': 'avg:10', 'keep_checkpoints': 5},
      "config.decode.checkpoint='avg:10' averages the last 10 checkpoints, but "
      'config.keep_checkpoints=5 keeps 5.',
    ),
    (
      {'decode.checkpoint': 'best'},
      "config.decode.checkpoint='best' reads the best checkpoint by validation BLEU, but "
      'config.keep_best_checkpoints=0 keeps none.',
    ),
    (
      {'decode.checkpoint': 'avg_best:3', 'keep_best_checkpoints': 2},
      'config.keep_best_checkpoints=2 keeps 2.',
    ),
  ],
)
def test_rules_across_keys(overrides, message):
  errors = config_lib.config_errors(sweeps.apply_overrides(default.get_config(), overrides))
  assert any(message in e for e in errors), errors


def test_a_language_model_config_is_checked_as_one():
  config = sweeps.apply_overrides(lm_default.get_config(), {'data.dataset': 'multi30k'})
  [error] = config_lib.config_errors(config)
  assert "config.model.architecture='decoder_only' does not fit" in error
  config = sweeps.apply_overrides(lm_default.get_config(), {'target_metric': 'eval_bleu_lc'})
  [error] = config_lib.config_errors(config)
  assert "config.target_metric='eval_bleu_lc' ranks translations; use 'eval_loss'" in error


def test_a_case_folding_run_selects_by_the_lowercased_bleu_once_it_targets_it():
  folded = {'data.spm_normalization': 'nmt_nfkc_cf', 'keep_best_checkpoints': 3}
  assert config_lib.config_errors(sweeps.apply_overrides(default.get_config(), folded))
  folded['target_metric'] = 'eval_bleu_lc'
  assert not config_lib.config_errors(sweeps.apply_overrides(default.get_config(), folded))
  assert ranking.selection_metric('eval_bleu_lc') == 'eval_bleu_lc'
  assert ranking.selection_metric('eval_loss') == ranking.selection_metric('eval_bleu')
  assert ranking.selection_metric('eval_bleu') == 'eval_bleu'


@pytest.mark.parametrize(
  ('flag', 'value', 'message'),
  [
    ('alpha', math.nan, '--alpha=nan must be a finite number in [0, inf)'),
    ('alpha', -0.6, '--alpha=-0.6 must be a finite number'),
    ('temperature', -1.0, '--temperature=-1.0 must be a finite number'),
    ('temperature', math.inf, '--temperature=inf must be a finite number'),
    ('top_k', -5, '--top_k=-5 must be an integer >= 0'),
    ('top_p', 0.0, '--top_p=0.0 must be a finite number in (0, 1]'),
    ('top_p', 1.5, '--top_p=1.5 must be a finite number in (0, 1]'),
    ('beam_size', 0, '--beam_size=0 must be a positive integer'),
    ('max_extra_len', -1, '--max_extra_len=-1 must be a positive integer'),
    ('batch_size', 0, '--batch_size=0 must be an integer in [1, 65536]'),
    ('batch_size', 2**16 + 1, '--batch_size=65537 must be an integer in [1, 65536]'),
    ('max_tokens', 0, '--max_tokens=0 must be an integer in [1, 1048576]'),
    ('max_tokens', 2**20 + 1, '--max_tokens=1048577 must be an integer in [1, 1048576]'),
    ('n_bootstrap', 0, '--n_bootstrap=0 must be an integer in [1, 10000]'),
    ('n_bootstrap', 10**6, '--n_bootstrap=1000000 must be an integer in [1, 10000]'),
    ('poll_seconds', 0.0, '--poll_seconds=0.0 must be a finite positive number'),
    ('lengths', ['64', '0'], "--lengths=['64', '0'] must be None or positive integers"),
    ('lengths', ['64', 'x'], "--lengths=['64', 'x'] must be None or positive integers"),
  ],
)
def test_eval_flags_outside_their_domains_are_named(flag, value, message):
  [error] = config_lib.eval_flag_errors({flag: value})
  assert error.startswith(message), error


def test_decode_options_are_checked_where_they_are_built():
  with pytest.raises(ValueError, match='temperature=-1.0 must be a finite number'):
    inference.DecodeOptions(decoder='sample', temperature=-1.0)
  assert config_lib.decode_errors(vars(inference.DecodeOptions())) == []


def test_output_file_is_checked_before_any_work(tmp_path):
  assert path_checks.writable_file_errors(str(tmp_path / 'out.txt'), '--output_file') == []
  assert path_checks.writable_file_errors('-', '--output_file') == []
  missing = str(tmp_path / 'no' / 'out.txt')
  [error] = path_checks.writable_file_errors(missing, '--output_file')
  assert f'the folder {tmp_path / "no"} does not exist' in error
  [error] = path_checks.writable_file_errors(str(tmp_path), '--output_file')
  assert 'is a directory' in error


# Keys added with the recipe switches (issue 24): a run's config.json written before them.
RECIPE_KEYS = (
  'schedule',
  'peak_learning_rate',
  'final_lr_fraction',
  'weight_decay',
  'model.ffn_dropout_rate',
  'decode.beam_size',
  'decode.alpha',
  'decode.max_extra_len',
  'decode.checkpoint',
  'data.spm_model_type',
  'data.spm_normalization',
  'keep_best_checkpoints',
  'early_stopping_patience',
)


def test_runs_written_before_the_recipe_switches_load_with_their_behaviour():
  config = default.get_config().to_dict()
  for key in RECIPE_KEYS:
    *groups, leaf = key.split('.')
    target = config
    for group in groups:
      target = target[group]
    del target[leaf]
  del config['decode']  # Empty now: a config.json written before the group existed.
  upgraded = runs.upgrade(ml_collections.ConfigDict(config))
  # Today's defaults are what those runs did: the paper's schedule, Adam, no FFN dropout, the
  # unigram vocabulary, no best checkpoints or early stopping, and eval.py's decoding defaults
  # (beam 4, alpha 0.6, source length + 50).
  assert config_lib.flatten(upgraded) == config_lib.flatten(default.get_config())
  assert (
    upgraded.decode.beam_size,
    upgraded.decode.alpha,
    upgraded.decode.max_extra_len,
    upgraded.decode.checkpoint,
  ) == (4, 0.6, 50, 'latest')
  config_lib.validate(upgraded, num_devices=1)


def test_model_config_reads_every_model_key_under_its_own_name():
  config = default.get_config()
  model_keys = {key.split('.', 1)[1] for key in config_lib.CONFIG_RULES if key.startswith('model.')}
  assert set(config.model) == model_keys
  fields = {field.name for field in dataclasses.fields(config_lib.ModelConfig)}
  assert model_keys <= fields, f'keys without a ModelConfig field: {model_keys - fields}'
  # Each value arrives, also where it differs from the dataclass's default.
  config.model.update(
    dropout_rate=0.2,
    attention_dropout_rate=0.1,
    ffn_dropout_rate=0.3,
    norm='rmsnorm',
    position='rope',
    ffn_activation='swiglu',
    use_bias=False,
    share_embeddings=False,
    max_len=96,
    attention_impl='xla',
    remat='layer',
  )
  config.dtype, config.vocab_size = 'bfloat16', 1000
  model_config = config_lib.ModelConfig.from_config(config)
  assert {key: getattr(model_config, key) for key in model_keys} == dict(config.model)
  assert (model_config.vocab_size, model_config.dtype) == (1000, config_lib.DTYPES['bfloat16'])
