"""eval.py end to end on a tiny trained run: BLEU files, averaging, text input, bad input."""

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import sacrebleu

from configs import tiny
from transformer import checkpoint_spec, errors, evaluation, inference, training
from transformer.tasks import translation

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope='module')
def run(tmp_path_factory, synthetic_multi30k_dir, synthetic_multi30k_data_dir):
  """A tiny model trained for 60 steps (checkpoints at 30 and 60, both also kept as best
  checkpoints) on a made-up corpus."""
  workdir = tmp_path_factory.mktemp('run')
  config = tiny.get_config()
  config.keep_best_checkpoints = 2
  config.data.manual_dir = str(synthetic_multi30k_dir)
  config.data.data_dir = str(synthetic_multi30k_data_dir)
  training.train_and_evaluate(config, str(workdir))
  return str(workdir), evaluation.load_run_config(str(workdir))


def _eval_py(*args):
  return subprocess.run(
    [sys.executable, 'eval.py', *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )


def test_beam_eval_writes_translations_and_bleu_equal_to_sacrebleu_by_hand(run):
  workdir, config = run
  result = _eval_py(f'--workdir={workdir}', '--split=validation', '--batch_size=256')
  assert result.returncode == 0, result.stderr[-3000:]
  out = Path(workdir) / 'eval'
  scores = json.loads((out / 'step_60-validation.json').read_text())
  hypotheses = (out / 'step_60-validation.txt').read_text(encoding='utf-8').split('\n')[:-1]
  with open(Path(config.data.manual_dir) / 'val.de.gz', 'rb') as f:
    import gzip

    references = gzip.decompress(f.read()).decode('utf-8').rstrip('\n').split('\n')
  assert len(hypotheses) == len(references) == scores['num_sentences'] == 200
  by_hand = sacrebleu.corpus_bleu(hypotheses, [references])
  assert scores['bleu'] == pytest.approx(by_hand.score, abs=1e-9)
  assert scores['bleu_signature'].startswith('nrefs:1|bs:1000|seed:12345|case:mixed|eff:no|tok:13a')
  for key in (
    'chrf',
    'length_ratio',
    'sentences_per_sec',
    'tokens_per_sec',
    'bleu_tokenized_compound_split',
  ):
    assert np.isfinite(scores[key]), key
  assert scores['checkpoint'] == 'step_60' and scores['decoder'] == 'beam'
  # Bootstrap 95% intervals (sacreBLEU's, seeded) on every score, and on the console.
  by_hand = sacrebleu.metrics.BLEU().corpus_score(hypotheses, [references], n_bootstrap=1000)
  assert scores['bleu_ci'] == pytest.approx(by_hand._ci, abs=1e-9)
  # BLEU on lowercased text, the Multi30k literature's: `sacrebleu -lc`.
  lowercased = sacrebleu.metrics.BLEU(lowercase=True)
  by_hand = lowercased.corpus_score(hypotheses, [references], n_bootstrap=1000)
  assert scores['bleu_lc'] == pytest.approx(by_hand.score, abs=1e-9)
  assert scores['bleu_lc_ci'] == pytest.approx(by_hand._ci, abs=1e-9)
  assert '|case:lc|eff:no|tok:13a|' in scores['bleu_lc_signature']
  for key in ('bleu', 'bleu_lc', 'chrf', 'bleu_tokenized_compound_split'):
    assert 0 < scores[f'{key}_ci'] < 5, key
  assert (
    f'step_60 validation (200 sentences): BLEU {scores["bleu"]:.2f} ± '
    f'{scores["bleu_ci"]:.2f}, chrF {scores["chrf"]:.2f} ± {scores["chrf_ci"]:.2f}, '
    f'lowercased BLEU {scores["bleu_lc"]:.2f} ± {scores["bleu_lc_ci"]:.2f}'
  ) in (result.stdout)
  # The references scored against lie beside the results, for compare.py and sacreBLEU's CLI.
  assert (out / 'references-validation.txt').read_text(encoding='utf-8').split('\n')[:-1] == (
    references
  )
  assert scores['unscored_lines'] == []


def test_decoding_settings_default_to_the_runs_config_and_flags_override_them(run, tmp_path):
  workdir, _ = run
  copy = tmp_path / 'run'
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns('eval'))
  saved = json.loads((copy / 'config.json').read_text())
  saved['decode'] = {'beam_size': 2, 'alpha': 1.0, 'max_extra_len': 20, 'checkpoint': 'avg:2'}
  (copy / 'config.json').write_text(json.dumps(saved))
  result = _eval_py(f'--workdir={copy}', '--split=validation', '--alpha=0.6', '--n_bootstrap=1')
  assert result.returncode == 0, result.stderr[-3000:]
  # Checkpoints, beam width and length limit from the run's config, alpha from the flag.
  [path] = (copy / 'eval').glob('*-validation*.json')
  assert path.name == 'avg2_30-60-validation-beam2_alpha0.6_extra20.json'
  scores = json.loads(path.read_text())
  assert (scores['decoder'], scores['beam_size'], scores['alpha']) == ('beam', 2, 0.6)


@pytest.mark.parametrize(
  'steps, label, budget',
  [([1500], 'step_1500', (1500, 1)), ([1100, 1200, 1300, 1400, 1500], 'avg5_1100-1500', (1500, 5))],
)
def test_a_label_of_the_last_checkpoints_names_its_step_budget(steps, label, budget):
  assert checkpoint_spec.last_checkpoints_label(steps) == label
  assert checkpoint_spec.step_budget(label) == budget


@pytest.mark.parametrize(
  'label', ['best_step_1200', 'avg_best3_900-1200-1500', 'step_', 'avg5_1500', 'final', 'step_12a']
)
def test_other_labels_name_no_step_budget(label):
  assert checkpoint_spec.step_budget(label) is None


def test_checkpoint_averaging_averages_parameters(run):
  workdir, config = run
  target = evaluation.setup(config).abstract_state
  averaged, label = evaluation.load_params(workdir, target, 'avg:2')
  assert label == 'avg2_30-60'
  assert checkpoint_spec.step_budget(label) == (60, 2)
  p30, _ = evaluation.load_params(workdir, target, '30')
  p60, _ = evaluation.load_params(workdir, target, 'latest')
  leaf = lambda p: np.asarray(p['encoder']['layer_0']['ffn']['wi']['kernel'])
  np.testing.assert_allclose(leaf(averaged), (leaf(p30) + leaf(p60)) / 2, rtol=1e-6)


def test_best_checkpoints_are_chosen_by_validation_bleu(run):
  workdir, config = run
  target = evaluation.setup(config).abstract_state
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    bleus = {r['step']: r['eval_bleu'] for r in map(json.loads, f) if 'eval_bleu' in r}
  assert sorted(bleus) == [30, 60]
  best_step = max(sorted(bleus), key=lambda step: bleus[step])  # The earlier one on a tie.
  best, label = evaluation.load_params(workdir, target, 'best')
  assert label == f'best_step_{best_step}'
  assert checkpoint_spec.step_budget(label) is None  # Chosen by validation BLEU, not a budget.
  same, _ = evaluation.load_params(workdir, target, str(best_step))
  jax.tree.map(np.testing.assert_array_equal, best, same)
  # Ranked by the lowercased BLEU, stored with them too (config.target_metric='eval_bleu_lc').
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    lowercased = {r['step']: r['eval_bleu_lc'] for r in map(json.loads, f) if 'eval_bleu_lc' in r}
  best_lc_step = max(sorted(lowercased), key=lambda step: lowercased[step])
  _, label = evaluation.load_params(workdir, target, 'best', best_metric='eval_bleu_lc')
  assert label == f'best_step_{best_lc_step}'
  # The 2 best are steps 30 and 60: their average is avg:2's.
  averaged, label = evaluation.load_params(workdir, target, 'avg_best:2')
  assert label == 'avg_best2_30-60'
  last_two, _ = evaluation.load_params(workdir, target, 'avg:2')
  jax.tree.map(np.testing.assert_array_equal, averaged, last_two)
  with pytest.raises(
    ValueError, match=r"'avg_best:3' needs 3 best checkpoints, but the run kept 2"
  ):
    evaluation.load_params(workdir, target, 'avg_best:3')
  with pytest.raises(ValueError, match='expected avg_best:N with N a positive integer'):
    evaluation.load_params(workdir, target, 'avg_best:0')


def test_best_checkpoint_of_a_run_that_kept_none_names_the_key(tmp_path):
  with pytest.raises(FileNotFoundError, match=r'kept none \(config.keep_best_checkpoints=0\)'):
    evaluation.load_params(str(tmp_path), None, 'best')


def test_greedy_results_do_not_overwrite_beam_results(run):
  workdir, _ = run
  result = _eval_py(
    f'--workdir={workdir}',
    '--split=validation',
    '--batch_size=256',
    '--decoder=greedy',
    '--checkpoint=30',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  scores = json.loads((Path(workdir) / 'eval' / 'step_30-validation-greedy.json').read_text())
  assert scores['decoder'] == 'greedy' and scores['checkpoint'] == 'step_30'


def test_translate_lines_keeps_empty_lines_and_alignment(run):
  workdir, config = run
  run = evaluation.setup(config)
  params, _ = evaluation.restore_params(run, workdir, 'latest')
  lines = ['A man is riding a bike.', '', '   ', 'Two dogs play in the snow.']
  options = inference.DecodeOptions(decoder='greedy')
  outputs = translation.decode.translate_lines(
    config, run.model_config, params, lines, options=options, batch_size=2
  )
  assert len(outputs) == 4
  assert outputs[1] == '' and outputs[2] == ''
  assert outputs[0] and outputs[3]
  alone = translation.decode.translate_lines(
    config, run.model_config, params, lines[3:], options=options, batch_size=2
  )
  assert alone == outputs[3:]


def test_translate_lines_compiles_once_for_any_parameters(run):
  """A second call with the same model and options reuses the compiled decoder; the parameters
  are its arguments, so other parameters translate as their own."""
  workdir, config = run
  run = evaluation.setup(config)
  params, _ = evaluation.restore_params(run, workdir, 'latest')
  other = jax.tree.map(lambda x: x * 0.5, params)
  lines = ['A man is riding a bike.', 'Two dogs play in the snow.']
  options = inference.DecodeOptions(decoder='greedy', max_extra_len=7)  # Options of its own.
  translate = functools.partial(
    translation.decode.translate_lines, config, run.model_config, options=options, batch_size=2
  )
  before = translation.decode._cached_translate_fn.cache_info()
  first, halved, again = translate(params, lines), translate(other, lines), translate(params, lines)
  after = translation.decode._cached_translate_fn.cache_info()
  assert (after.misses - before.misses, after.hits - before.hits) == (1, 2)
  assert again == first and halved != first


def test_missing_checkpoint_lists_existing_steps(run):
  workdir, _ = run
  with pytest.raises(ValueError, match=r"checkpoint='45' does not exist.*\[30, 60\]"):
    checkpoint_spec.select_steps([30, 60], '45')
  with pytest.raises(ValueError, match='needs 3 checkpoints, but there are only 2'):
    checkpoint_spec.select_steps([30, 60], 'avg:3')
  result = _eval_py(f'--workdir={workdir}', '--checkpoint=avg:5')
  assert result.returncode != 0 and 'there are only 2' in result.stderr


def test_average_up_to_a_step_reads_a_shorter_runs_last_checkpoints(run, caplog):
  steps = list(range(100, 1100, 100))
  assert checkpoint_spec.select_steps(steps, 'avg:3@500') == [300, 400, 500]
  latest3 = checkpoint_spec.select_steps(steps, 'avg:3')
  assert checkpoint_spec.select_steps(steps, 'avg:3@1000') == latest3
  assert checkpoint_spec.select_steps(steps, 'avg:1@100') == [100]
  with pytest.raises(ValueError, match=r"'avg:3@450': there is no checkpoint at step 450; .*\[100"):
    checkpoint_spec.select_steps(steps, 'avg:3@450')
  with pytest.raises(ValueError, match=r'needs 3 checkpoints, but there are only 2 up to step 200'):
    checkpoint_spec.select_steps(steps, 'avg:3@200')
  for spec in ('avg:3@', 'avg:3@x', 'avg:0@500', 'avg:@500', 'avg_best:2@500'):
    assert checkpoint_spec.error(spec), spec
  assert checkpoint_spec.error('avg:3@500') is None
  assert checkpoint_spec.parse('avg:3@500') == checkpoint_spec.CheckpointSpec('avg', 3, 500)
  assert checkpoint_spec.parse('avg:3').step is None
  # The fixture's run saved steps 30 and 60: 'avg:1@30' is step 30, 'avg:2@60' is 'avg:2'.
  workdir, config = run
  setup = evaluation.setup(config)
  first, label = evaluation.restore_params(setup, workdir, 'avg:1@30')
  assert label == 'step_30'
  jax.tree.map(
    np.testing.assert_array_equal, first, evaluation.restore_params(setup, workdir, '30')[0]
  )
  both, label = evaluation.restore_params(setup, workdir, 'avg:2@60')
  assert label == 'avg2_30-60'
  jax.tree.map(
    np.testing.assert_array_equal, both, evaluation.restore_params(setup, workdir, 'avg:2')[0]
  )
  assert 'not what a run of that many steps would have saved' not in caplog.text
  # Under a schedule that decays to num_train_steps, earlier checkpoints are not a shorter run's.
  decaying = config.copy_and_resolve_references()
  decaying.schedule = 'linear'
  evaluation.restore_params(evaluation.setup(decaying), workdir, 'avg:1@30')
  assert "config.schedule='linear'): they are not what a run of that many steps" in caplog.text


def test_workdir_without_config_names_the_file(tmp_path):
  result = _eval_py(f'--workdir={tmp_path}')
  assert result.returncode != 0
  assert f'No resolved config at {tmp_path}/config.json' in result.stderr


def test_invalid_utf8_input_names_the_line(tmp_path):
  path = tmp_path / 'in.txt'
  path.write_bytes(b'good line\n\xff\xfe bad\n')
  with pytest.raises(ValueError, match=r'in.txt: line 2 is not valid UTF-8'):
    evaluation.read_input_lines(str(path))


@pytest.mark.parametrize(
  ('data', 'message'),
  [
    (b'Hello.\nZw\x00ei.\n', 'line 2 holds a NUL byte (byte 3 of the line)'),
    ('Hello.\nZwei.\n'.encode('utf-16-le'), 'line 1 holds a NUL byte (byte 2 of the line)'),
    ('Hello.\nZwei.\n'.encode('utf-16'), 'starts with a UTF-16 byte order mark'),
    ('Hello.\nCaf\u00e9.\n'.encode('latin-1'), 'line 2 is not valid UTF-8 (invalid '),
  ],
  ids=['nul', 'utf16_without_bom', 'utf16_with_bom', 'latin1'],
)
def test_input_in_another_encoding_is_refused_naming_the_file_and_line(tmp_path, data, message):
  path = tmp_path / 'in.txt'
  path.write_bytes(data)
  with pytest.raises(errors.InvalidInput) as error:
    evaluation.read_input_lines(str(path))
  assert str(error.value).startswith(f'--input_file={path}'), error.value
  assert message in str(error.value) and 'iconv -f ' in str(error.value)


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
  path = tmp_path / 'in.txt'
  path.write_bytes('Hello.\r\nZwei.\n'.encode('utf-8-sig'))
  assert evaluation.read_input_lines(str(path)) == ['Hello.', 'Zwei.']


def test_attention_plot_writes_one_png_per_kind_and_layer(run, tmp_path):
  workdir, _ = run
  out = tmp_path / 'maps'
  result = _eval_py(
    f'--workdir={workdir}',
    f'--attention_plot={out}',
    '--decoder=greedy',
    '--input_text=A dog runs on the beach.',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  names = sorted(p.name for p in out.iterdir())
  assert names == [
    'cross_attention_layer0.png',
    'decoder_self_attention_layer0.png',
    'encoder_self_attention_layer0.png',
  ]
  assert all((out / n).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' for n in names)


def _ensure_eval(workdir, result, *flags):
  """eval.py's result file `result` in WORKDIR/eval, written now unless an earlier test did."""
  path = Path(workdir) / 'eval' / result
  if not path.exists():
    output = _eval_py(f'--workdir={workdir}', '--split=validation', '--batch_size=256', *flags)
    assert output.returncode == 0, output.stderr[-3000:]
  return path


def test_two_checkpoints_compare_as_sacrebleus_command_line_does(run, tmp_path):
  workdir, _ = run
  beam_60 = _ensure_eval(workdir, 'step_60-validation.json')
  greedy_30 = _ensure_eval(
    workdir, 'step_30-validation-greedy.json', '--decoder=greedy', '--checkpoint=30'
  )
  out = tmp_path / 'comparison.json'
  env = {**os.environ, 'SACREBLEU_SEED': '12345'}
  result = subprocess.run(
    [sys.executable, 'compare.py', str(greedy_30), str(beam_60), f'--output={out}'],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  comparison = json.loads(out.read_text())
  references = Path(workdir) / 'eval' / 'references-validation.txt'
  cli = subprocess.run(
    [
      sys.executable,  # sacreBLEU's command line through this interpreter: no PATH needed.
      '-m',
      'sacrebleu',
      str(references),
      '-i',
      str(greedy_30).replace('.json', '.txt'),
      str(beam_60).replace('.json', '.txt'),
      '--paired-bs',
      '-m',
      'bleu',
      '-f',
      'json',
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert cli.returncode == 0, cli.stderr[-3000:]
  [cli_base, cli_other] = json.loads(cli.stdout)
  [base, other] = comparison['systems']
  assert other['scores']['BLEU']['p_value'] == pytest.approx(
    cli_other['BLEU']['p_value'], abs=1e-12
  )
  assert base['scores']['BLEU']['ci'] == pytest.approx(cli_base['BLEU']['ci'], abs=1e-9)
  assert base['scores']['BLEU']['ci'] == pytest.approx(
    json.loads(greedy_30.read_text())['bleu_ci'], abs=1e-9
  )
  assert 'against the baseline, p = ' in result.stdout
