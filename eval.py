"""Evaluates checkpoints: `python eval.py --workdir=DIR [--checkpoint=latest|STEP|avg:N]`.

Reads the run's resolved config from WORKDIR/config.json, decodes a split (beam
search by default, as in the paper: beam 4, alpha 0.6, max length = source + 50)
and writes WORKDIR/eval/<checkpoint>-<split>.txt and .json (with a suffix such as
`-greedy` for other decoding settings) (sacreBLEU, chrF, each with its bootstrap
95% confidence interval (--n_bootstrap), length ratio, decode speed), and the
references scored against (WORKDIR/eval/references-<split>.txt; compare.py tests
two results for a significant difference). Also translates arbitrary text (--input_file),
follows a training run (--watch) and draws attention maps (--attention_plot).

For a decoder-only language model (config.model.architecture='decoder_only'):
perplexity of a split (WORKDIR/eval/<checkpoint>-<split>-perplexity.json), the
same at several window lengths (--lengths=64,128,256: length extrapolation,
...-extrapolation.json), or continuations of prompts (--prompt, repeatable, or
--input_file, one prompt per line) with --decoder=greedy (the default for a
language model) or sample (--temperature, --top_k, --top_p, --seed); at most
--max_extra_len new tokens each.
"""

import json
import os
import sys

from absl import app, flags, logging

from transformer import config as config_lib
from transformer import evaluation, inference, lm_evaluation, scoring, training

_WORKDIR = flags.DEFINE_string('workdir', None, 'A directory written by train.py.')
_CHECKPOINT = flags.DEFINE_string(
  'checkpoint', 'latest', "'latest', a step number, or 'avg:N' (average the last N).")
_SPLIT = flags.DEFINE_string('split', None, "Split to evaluate (default: config's test_split).")
_DECODER = flags.DEFINE_enum('decoder', 'beam', inference.DECODERS, 'Decoding algorithm.')
_BEAM_SIZE = flags.DEFINE_integer('beam_size', 4, 'Beam width (paper: 4).')
_ALPHA = flags.DEFINE_float('alpha', 0.6, 'Length penalty exponent (paper: 0.6).')
_MAX_EXTRA_LEN = flags.DEFINE_integer('max_extra_len', 50, 'Output limit: input length + this.')
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'Sampling temperature (0: greedy).')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample from the k most likely tokens (0: all).')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass (1.0: all).')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
_N_BOOTSTRAP = flags.DEFINE_integer(
  'n_bootstrap', scoring.DEFAULT_BOOTSTRAP, "Bootstrap resamples for each score's 95% "
  'confidence interval (sacreBLEU\'s, seeded by SACREBLEU_SEED, default 12345); 1: none.')
_BATCH_SIZE = flags.DEFINE_integer(
  'batch_size', inference.MAX_DECODE_ROWS, 'Most sentences decoded at once.')
_MAX_TOKENS = flags.DEFINE_integer(
  'max_tokens', inference.MAX_DECODE_TOKENS,
  'Translation: source token slots per batch (sentences are decoded sorted by length).')
_INPUT_FILE = flags.DEFINE_string('input_file', None, "Translate this file ('-': stdin).")
_OUTPUT_FILE = flags.DEFINE_string('output_file', '-', "Where --input_file's translation goes.")
_WATCH = flags.DEFINE_bool('watch', False, 'Evaluate every new checkpoint until the final one.')
_POLL_SECONDS = flags.DEFINE_float('poll_seconds', 30.0, 'With --watch: seconds between looks.')
_ATTENTION_PLOT = flags.DEFINE_string('attention_plot', None, 'Directory for attention PNGs.')
_INPUT_TEXT = flags.DEFINE_string('input_text', None, 'Sentence for --attention_plot.')
_PROMPT = flags.DEFINE_multi_string(
  'prompt', None, 'Language model: continue this text (repeatable; an empty prompt writes a '
  'document from scratch).')
_LENGTHS = flags.DEFINE_list(
  'lengths', None, 'Language model: perplexity of the split in windows of each of these lengths '
  '(e.g. 64,128,256: length extrapolation).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if _WORKDIR.value is None:
    raise app.UsageError('--workdir is required.')
  if _ATTENTION_PLOT.value and not _INPUT_TEXT.value:
    raise app.UsageError('--attention_plot needs --input_text.')
  _check_flags()
  config = evaluation.load_run_config(_WORKDIR.value)
  if training.is_language_model(config):
    _language_model(config)
    return
  if _PROMPT.value or _LENGTHS.value:
    raise app.UsageError('--prompt and --lengths are for decoder-only language models.')
  options = inference.DecodeOptions(
    decoder=_DECODER.value, beam_size=_BEAM_SIZE.value, alpha=_ALPHA.value,
    max_extra_len=_MAX_EXTRA_LEN.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
    top_p=_TOP_P.value)
  split = _SPLIT.value or config.data.test_split
  longest = config.data.max_eval_len + options.max_extra_len
  if longest > config.model.max_len:
    raise app.UsageError(
      f'--max_extra_len={options.max_extra_len}: outputs of up to config.data.max_eval_len + '
      f'{options.max_extra_len} = {longest} tokens exceed config.model.max_len='
      f'{config.model.max_len}, the longest position the model supports.')

  if _WATCH.value:
    evaluation.watch(config, _WORKDIR.value, split=split, options=options,
                     batch_size=_BATCH_SIZE.value, max_tokens=_MAX_TOKENS.value,
                     poll_seconds=_POLL_SECONDS.value)
    return

  if _INPUT_FILE.value is not None:
    lines = evaluation.read_input_lines(_INPUT_FILE.value)  # Fails before any restore.
  params, label = evaluation.restore_params(config, _WORKDIR.value, _CHECKPOINT.value)

  if _ATTENTION_PLOT.value:
    paths = evaluation.plot_attention(config, params, _INPUT_TEXT.value, options,
                                      _ATTENTION_PLOT.value)
    logging.info('Wrote %d attention maps to %s.', len(paths), _ATTENTION_PLOT.value)
    return

  if _INPUT_FILE.value is not None:
    _write_output(evaluation.translate_lines(
      config, params, lines, options=options, batch_size=_BATCH_SIZE.value,
      max_tokens=_MAX_TOKENS.value, seed=_SEED.value))
    return

  lines, results = evaluation.evaluate_split(
    config, params, split=split, options=options, batch_size=_BATCH_SIZE.value,
    max_tokens=_MAX_TOKENS.value, seed=_SEED.value, n_bootstrap=_N_BOOTSTRAP.value)
  results.update(checkpoint=label, split=split, decoder=options.decoder,
                 beam_size=options.beam_size, alpha=options.alpha)
  tag = options.tag() + (f'_seed{_SEED.value}' if options.decoder == 'sample' else '')
  path = evaluation.write_split_results(_WORKDIR.value, label, split, lines, results, tag)
  evaluation.write_references(config, _WORKDIR.value, split)
  interval = (f' (± 95% bootstrap interval, {_N_BOOTSTRAP.value} resamples)'
              if _N_BOOTSTRAP.value > 1 else '')
  print(f'{label} {split} ({results["num_sentences"]} sentences): BLEU '
        f'{scoring.format_score(results, "bleu")}, chrF {scoring.format_score(results, "chrf")}'
        f'{interval}')
  print(json.dumps({k: v for k, v in results.items()
                    if k in ('bleu', 'bleu_ci', 'chrf', 'chrf_ci', 'num_sentences')}))
  logging.info('Wrote %s', path)


def _check_flags() -> None:
  """Every flag in its domain and every output location writable, before anything is read."""
  errors = config_lib.eval_flag_errors(
    {name: flags.FLAGS[name].value for name in config_lib.EVAL_FLAG_RULES})
  if _INPUT_FILE.value is not None:
    errors += config_lib.writable_file_errors(_OUTPUT_FILE.value, '--output_file')
  elif _ATTENTION_PLOT.value:
    errors += config_lib.writable_dir_errors(_ATTENTION_PLOT.value, '--attention_plot')
  else:  # Results go to WORKDIR/eval/.
    errors += config_lib.writable_dir_errors(
      os.path.join(_WORKDIR.value, 'eval'), '--workdir')
  if errors:
    raise app.UsageError('Invalid flags:\n  ' + '\n  '.join(errors))


def _write_output(lines) -> None:
  """One line per input line, to --output_file ('-': stdout)."""
  text = ''.join(line + '\n' for line in lines)
  if _OUTPUT_FILE.value == '-':
    sys.stdout.write(text)
  else:
    with open(_OUTPUT_FILE.value, 'w', encoding='utf-8') as f:
      f.write(text)


def _language_model(config) -> None:
  """Perplexity, length extrapolation or prompt continuation of a decoder-only model."""
  if _WATCH.value or _ATTENTION_PLOT.value:
    raise app.UsageError('--watch and --attention_plot are for translation models.')
  # Beam search is for translation; a language model decodes greedily unless told to sample.
  decoder = _DECODER.value if flags.FLAGS['decoder'].present else 'greedy'
  options = inference.DecodeOptions(
    decoder=decoder, max_extra_len=_MAX_EXTRA_LEN.value, temperature=_TEMPERATURE.value,
    top_k=_TOP_K.value, top_p=_TOP_P.value)
  if options.decoder == 'beam':
    raise app.UsageError('A language model continues prompts with --decoder=greedy or sample.')
  lengths = [int(length) for length in _LENGTHS.value or []]  # Checked by _check_flags.
  prompts = None
  if _INPUT_FILE.value is not None:
    prompts = evaluation.read_input_lines(_INPUT_FILE.value)
  if _PROMPT.value:
    prompts = (prompts or []) + list(_PROMPT.value)
  params, label = evaluation.restore_params(config, _WORKDIR.value, _CHECKPOINT.value)

  if prompts is not None:
    _write_output(lm_evaluation.continue_prompts(
      config, params, prompts, options=options, batch_size=_BATCH_SIZE.value, seed=_SEED.value))
    return

  split = _SPLIT.value or config.data.test_split
  if lengths:
    results = lm_evaluation.length_extrapolation(config, params, split, lengths)
    tag = 'extrapolation'
  else:
    results = lm_evaluation.score_split(config, params, split)
    tag = 'perplexity'
  results['checkpoint'] = label
  path = lm_evaluation.write_results(_WORKDIR.value, label, split, tag, results)
  print(json.dumps(results))
  logging.info('Wrote %s', path)


if __name__ == '__main__':
  app.run(main)
