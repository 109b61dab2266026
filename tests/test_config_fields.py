"""The one declaration of each config field and what is derived from it."""

import dataclasses

import ml_collections
import pytest

from configs import default
from transformer import config as config_lib
from transformer import config_fields, runs
from transformer.tools import config_reference


def test_the_reference_table_in_the_docs_is_current():
  with open(config_reference.PATH, encoding='utf-8') as f:
    assert f.read() == config_reference.text(), (
      'docs/config.md is out of date: python -m transformer.tools.config_reference'
    )


def test_each_key_is_declared_once_with_a_default_in_its_domain():
  keys = [field.key for field in config_fields.FIELDS]
  assert len(keys) == len(set(keys))
  for field in config_fields.FIELDS:
    value = config_fields.resolved_default(field)  # A following default: the followed's.
    assert field.domain.error(field.key, value) is None, field.key
    assert field.doc.strip() and len(field.doc) <= 100, field.key
    if field.default is None:
      assert field.placeholder is not None, f'{field.key}: a None default needs its type'
  assert config_lib.flatten(default.get_config()) == {
    field.key: config_fields.resolved_default(field) for field in config_fields.FIELDS
  }


def test_the_model_dataclass_has_the_declared_defaults_and_no_others():
  fields = {f.name: f.default for f in dataclasses.fields(config_lib.ModelConfig)}
  declared = {  # A following default is None until __post_init__ fills it in.
    key.split('.', 1)[1]: None
    if isinstance(config_fields.BY_KEY[key].default, config_fields.Follows)
    else config_fields.BY_KEY[key].default
    for key in config_fields.keys(group='model')
  }
  assert {name: fields[name] for name in declared} == declared
  extra = set(fields) - set(declared)
  assert extra == {'vocab_size', 'dtype', 'deterministic', 'decode', 'max_decode_len'}
  model = config_lib.ModelConfig.from_config(default.get_config())
  assert model == config_lib.ModelConfig(vocab_size=default.get_config().vocab_size)
  with pytest.raises(config_lib.ConfigError, match='config.model.num_heads=0'):
    config_lib.ModelConfig(vocab_size=10, num_heads=0)


def test_what_a_change_on_resume_means_comes_from_the_declaration():
  weights = set(config_fields.keys(config_fields.OnResume.WEIGHTS))
  before = {'model.d_model': 256, 'model.dropout_rate': 0.1, 'num_train_steps': 10}
  after = {'model.d_model': 128, 'model.dropout_rate': 0.3, 'num_train_steps': 20}
  assert runs.weight_meaning_changes(before, after) == ['config.model.d_model: 256 -> 128']
  assert 'model.d_model' in weights and 'model.dropout_rate' not in weights
  assert set(runs.RESUMABLE_KEYS) == set(config_fields.keys(config_fields.OnResume.FREE))
  # A model key that an older run has and the project no longer declares is read as a model
  # field: changing it is refused rather than silently accepted.
  assert config_fields.on_resume('model.retired_switch') == config_fields.OnResume.WEIGHTS
  assert config_fields.on_resume('retired_setting') == config_fields.OnResume.WARN


def test_a_run_written_before_its_fields_existed_reads_them_as_it_had_them():
  config = default.get_config().to_dict()
  for key in runs.ADDED_KEYS:
    *groups, leaf = key.split('.')
    target = config
    for group in groups:
      target = target[group]
    del target[leaf]
  upgraded = config_lib.flatten(runs.upgrade(ml_collections.ConfigDict(config)))
  before = {  # A following value: that of the key it follows, in the run's own config.
    key: upgraded[value.key] if isinstance(value, config_fields.Follows) else value
    for key, value in config_fields.added_keys().items()
  }
  assert {key: upgraded[key] for key in runs.ADDED_KEYS} == before
  assert upgraded['model.num_kv_heads'] == upgraded['model.num_heads'] == 4


def test_each_part_handed_down_reads_declared_fields_from_the_config():
  from transformer import optim, tasks, train_steps, training  # pylint: disable=g-import-not-at-top

  parts = set(config_fields.Part.__subclasses__())
  assert {
    optim.OptimizerConfig,
    train_steps.StepConfig,
    training.LoopConfig,
    tasks.ValidationConfig,
  } <= parts
  config = default.get_config()
  config.model.d_model, config.decode.alpha, config.seed, config.data.num_workers = 64, 1.5, 7, 2
  flat = config_lib.flatten(config)
  for part in parts:
    assert set(part.config_keys()) <= set(config_fields.keys()), part.__name__
    values = part.from_config(config)
    assert {
      key: getattr(values, f.name)
      for f, key in zip(dataclasses.fields(part), part.config_keys(), strict=True)
    } == {key: flat[key] for key in part.config_keys()}
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(values, dataclasses.fields(part)[0].name, None)
  assert optim.OptimizerConfig.from_config(config).d_model == 64
  assert training.LoopConfig.from_config(config).num_workers == 2
  assert tasks.ValidationConfig.from_config(config).decode_options() == (
    tasks.task.inference.DecodeOptions.from_config(config, config.eval_bleu_decoder)
  )
