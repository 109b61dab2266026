"""Evaluates checkpoints: `python eval.py --workdir=DIR [--checkpoint=latest|STEP|avg:N|best]`.

Reads the run's resolved config from WORKDIR/config.json, decodes a split (beam
search by default, with the run's config.decode settings, by default the paper's:
beam 4, alpha 0.6, max length = source + 50, on the latest checkpoint; --beam_size,
--alpha, --max_extra_len and --checkpoint override them)
and writes WORKDIR/eval/<checkpoint>-<split>.txt and .json (with a suffix such as
`-greedy` for other decoding settings) (sacreBLEU cased and lowercased, chrF, each with
its bootstrap 95% confidence interval (--n_bootstrap), length ratio, decode speed), and the
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

import signal
import sys

# Ctrl-C ends this process at once while the libraries import (as in train.py); `main` makes it
# a KeyboardInterrupt again.
signal.signal(signal.SIGINT, signal.SIG_DFL)

from absl import app, flags, logging  # noqa: E402

from transformer import (  # noqa: E402
  checkpoint_spec,
  config_rules,
  datasets,
  errors,
  evaluation,
  inference,
  outputs,
  path_checks,
  scoring,
  shutdown,
  storage,
  tasks,
)
from transformer import config as config_lib  # noqa: E402
from transformer.tools import attention_maps  # noqa: E402

_WORKDIR = flags.DEFINE_string('workdir', None, 'A directory written by train.py.')
# Defaults None: what runs unless a flag is given is the run's config (config.decode, the task's
# decoder), which --help cannot know.
_CHECKPOINT = flags.DEFINE_string(
  'checkpoint',
  None,
  "'latest', a step number, 'avg:N' (average the last N), 'avg:N@STEP' (the last N up to "
  "STEP: a shorter inverse_sqrt run's 'avg:N'), 'best' (the best validation BLEU kept by "
  "config.keep_best_checkpoints) or 'avg_best:N' (average the N best) (default: the run's "
  "config.decode.checkpoint, e.g. 'latest').",
)
_SPLIT = flags.DEFINE_string('split', None, "Split to evaluate (default: config's test_split).")
_DECODER = flags.DEFINE_enum(
  'decoder',
  None,
  inference.DECODERS,
  'Decoding algorithm (default: beam for translation, greedy for a language model).',
)
# Unless given, the run's config.decode values (runs older than config.decode: the defaults).
_BEAM_SIZE = flags.DEFINE_integer(
  'beam_size', None, "Beam width (default: the run's config.decode.beam_size, e.g. 4)."
)
_ALPHA = flags.DEFINE_float(
  'alpha', None, "Length penalty exponent (default: the run's config.decode.alpha, e.g. 0.6)."
)
_MAX_EXTRA_LEN = flags.DEFINE_integer(
  'max_extra_len',
  None,
  "Output limit: input length + this (default: the run's config.decode.max_extra_len, e.g. 50).",
)
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'Sampling temperature (0: greedy).')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample from the k most likely tokens (0: all).')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass (1.0: all).')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
_N_BOOTSTRAP = flags.DEFINE_integer(
  'n_bootstrap',
  scoring.DEFAULT_BOOTSTRAP,
  "Bootstrap resamples for each score's 95% "
  "confidence interval (sacreBLEU's, seeded by SACREBLEU_SEED, default 12345); 1: none.",
)
_BATCH_SIZE = flags.DEFINE_integer(
  'batch_size',
  None,
  f'Most sentences decoded at once (default: {inference.MAX_DECODE_ROWS} on accelerators; on '
  f'one CPU device {inference.CPU_DECODE_HYPOTHESES} hypotheses, sentences x beams, with a '
  'batch decoding on each core).',
)
_MAX_TOKENS = flags.DEFINE_integer(
  'max_tokens',
  inference.MAX_DECODE_TOKENS,
  'Translation: source token slots per batch (sentences are decoded sorted by length).',
)
_INPUT_FILE = flags.DEFINE_string('input_file', None, "Translate this file ('-': stdin).")
_OUTPUT_FILE = flags.DEFINE_string('output_file', '-', "Where --input_file's translation goes.")
_WATCH = flags.DEFINE_bool('watch', False, 'Evaluate every new checkpoint until the final one.')
_POLL_SECONDS = flags.DEFINE_float('poll_seconds', 30.0, 'With --watch: seconds between looks.')
_ATTENTION_PLOT = flags.DEFINE_string('attention_plot', None, 'Directory for attention PNGs.')
_INPUT_TEXT = flags.DEFINE_string('input_text', None, 'Sentence for --attention_plot.')
_PROMPT = flags.DEFINE_multi_string(
  'prompt',
  None,
  'Language model: continue this text (repeatable; an empty prompt writes a '
  'document from scratch).',
)
_DRY_RUN = flags.DEFINE_bool(
  'dry_run',
  False,
  'Check the flags (against the run in --workdir where it has a config.json) and exit, '
  'reading no checkpoint or data (sweep.py checks --eval_flags this way).',
)
_DRY_RUN_CONFIGS = flags.DEFINE_string(
  'dry_run_configs',
  None,
  'With --dry_run: a JSON file {name: resolved config} of runs still to be trained, to check '
  "the flags against each (instead of --workdir's config.json); sweep.py --eval passes its "
  "trials'.",
)
_LENGTHS = flags.DEFINE_list(
  'lengths',
  None,
  'Language model: perplexity of the split in windows of each of these lengths '
  '(e.g. 64,128,256: length extrapolation).',
)


def _stop_watching(signum, frame):
  """SIGTERM to `--watch`: the deadline starts, then the watch ends as Ctrl-C ends it."""
  shutdown.arm(signal.Signals(signum).name)
  signal.default_int_handler(signum, frame)


def main(argv):
  signal.signal(signal.SIGINT, signal.default_int_handler)
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if _WORKDIR.value is None:
    raise app.UsageError('--workdir is required.')
  if _ATTENTION_PLOT.value and not _INPUT_TEXT.value:
    raise app.UsageError('--attention_plot needs --input_text.')
  if problems := storage.path_errors(_WORKDIR.value, '--workdir') or storage.checkpoint_errors(
    _WORKDIR.value, '--workdir'
  ):
    raise app.UsageError(problems[0])
  if _DRY_RUN_CONFIGS.value is not None:  # Runs still to be trained (sweep.py --eval).
    if not _DRY_RUN.value:
      raise app.UsageError('--dry_run_configs is for --dry_run.')
    _dry_run_against(evaluation.read_dry_run_configs(_DRY_RUN_CONFIGS.value))
    return
  config = None
  if not _DRY_RUN.value or storage.exists(storage.join(_WORKDIR.value, 'config.json')):
    config = evaluation.load_run_config(_WORKDIR.value)
  _check_flags(config)
  if config is None:  # A dry run for a run still to be trained.
    print('eval.py --dry_run: the flags are valid (no run config yet to check them against).')
    return
  task, options, errors = _against_the_run(config)
  if errors:
    raise app.UsageError('Invalid flags:\n  ' + '\n  '.join(errors))
  if _DRY_RUN.value:
    print(f'eval.py --dry_run: the flags are valid for the {task.name} model in {_WORKDIR.value}.')
    return
  run = evaluation.setup(config)  # Model config, task, mesh, rules: built once, passed down.
  request = tasks.EvalRequest(
    config=config,
    model_config=run.model_config,
    mesh=run.mesh,
    rules=run.rules,
    split=_SPLIT.value or config.data.test_split,
    options=options,
    batch_size=_BATCH_SIZE.value,
    max_tokens=_MAX_TOKENS.value,
    seed=_SEED.value,
    n_bootstrap=_N_BOOTSTRAP.value,
    lengths=[int(length) for length in _LENGTHS.value or []],  # Checked by _check_flags.
  )

  if _WATCH.value:
    # SIGTERM stops the watch as Ctrl-C does: its lock (WORKDIR/eval/watch.lock) is released,
    # within the time `transformer.shutdown` allows from the signal on.
    signal.signal(signal.SIGTERM, _stop_watching)
    try:
      evaluation.watch(run, _WORKDIR.value, request, poll_seconds=_POLL_SECONDS.value)
    except KeyboardInterrupt:
      logging.warning(
        'Stopped watching %s: interrupted. The steps evaluated so far are in %s/eval/.',
        _WORKDIR.value,
        _WORKDIR.value,
      )
      sys.exit(130)
    return

  lines = None
  if _INPUT_FILE.value is not None:
    lines = evaluation.read_input_lines(_INPUT_FILE.value)  # Fails before any restore.
  if _PROMPT.value:
    lines = (lines or []) + list(_PROMPT.value)
  checkpoint = _CHECKPOINT.value or config.decode.checkpoint
  try:
    params, label = evaluation.restore_params(run, _WORKDIR.value, checkpoint)
  except checkpoint_spec.NoSuchCheckpoint as e:
    if _CHECKPOINT.value is not None:
      raise
    raise checkpoint_spec.NoSuchCheckpoint(
      f"{e} --checkpoint was not given, so {checkpoint!r} is the run's "
      f'config.decode.checkpoint (in {storage.join(_WORKDIR.value, "config.json")}); pass '
      '--checkpoint=latest, a step or avg:N with fewer checkpoints.'
    ) from None

  if _ATTENTION_PLOT.value:
    paths = attention_maps.translate_and_plot(
      config, run.model_config, params, _INPUT_TEXT.value, options, _ATTENTION_PLOT.value
    )
    logging.info('Wrote %d attention maps to %s.', len(paths), _ATTENTION_PLOT.value)
    return

  if lines is not None:
    _write_output(task.decode_lines(request, params, lines))
    return

  result = task.evaluator(request)(params, label)
  print(result.summary)  # First: a write that fails keeps the files, and says where.
  path = evaluation.write(_WORKDIR.value, label, request.split, result)
  logging.info('Wrote %s', path)


def _check_flags(config) -> None:
  """Every flag in its domain and every output location writable, before anything is read.

  An output may not overwrite a file of a run, an input of this command (`--input_file`,
  the run's data and vocabulary) or the code (`path_checks.protected_path_errors`).
  """
  errors = path_checks.setting_errors() + config_lib.eval_flag_errors(
    {
      name: flags.FLAGS[name].value
      for name in config_lib.EVAL_FLAG_RULES
      if flags.FLAGS[name].value is not None  # None: the run's config's value.
    }
  )
  if _CHECKPOINT.value is not None and (error := checkpoint_spec.error(_CHECKPOINT.value)):
    errors.append(f'--{error}')
  inputs = {'--input_file': _INPUT_FILE.value}
  if config is not None:
    inputs.update(
      {
        'the raw data (config.data.manual_dir)': config.data.manual_dir,
        'the prepared data (config.data.data_dir)': config.data.data_dir,
        'the vocabulary (config.data.vocab_path)': config.data.vocab_path,
      }
    )
  if _INPUT_FILE.value is not None or _PROMPT.value:  # Outputs go to --output_file.
    if _OUTPUT_FILE.value != '-':
      errors += path_checks.output_errors(_OUTPUT_FILE.value, '--output_file', inputs)
  elif _ATTENTION_PLOT.value:
    errors += path_checks.protected_path_errors(
      _ATTENTION_PLOT.value, '--attention_plot', inputs
    ) or path_checks.writable_dir_errors(_ATTENTION_PLOT.value, '--attention_plot')
  else:  # Results go to WORKDIR/eval/.
    errors += path_checks.writable_dir_errors(storage.join(_WORKDIR.value, 'eval'), '--workdir')
  if errors:
    raise app.UsageError('Invalid flags:\n  ' + '\n  '.join(errors))


def _against_the_run(
  config, to_be_trained: bool = False
) -> tuple[tasks.Task, inference.DecodeOptions, list[str]]:
  """The run's task, the decoding options of the flags, and the flags' errors for the run.

  Flags its task does not take, decoding options its model cannot decode with, a split its
  dataset lacks and, for a run `to_be_trained`, checkpoints it will not keep
  (`--checkpoint=best` where config.keep_best_checkpoints=0, 'avg:N' beyond
  config.keep_checkpoints; a trained run's error lists the checkpoints it kept).
  """
  task = tasks.get_task(config.model.architecture)
  errors = []
  unsupported = [f'--{name}' for name in task.unsupported_eval_flags if flags.FLAGS[name].value]
  if unsupported:
    verb = 'is' if len(unsupported) == 1 else 'are'
    errors.append(f'{" and ".join(unsupported)} {verb} not for a {task.name} model.')
  decoder = _DECODER.value or task.default_decoder
  options = inference.DecodeOptions.from_config(
    config,
    decoder,
    **{f.name: f.value for f in (_BEAM_SIZE, _ALPHA, _MAX_EXTRA_LEN) if f.value is not None},
    temperature=_TEMPERATURE.value,
    top_k=_TOP_K.value,
    top_p=_TOP_P.value,
  )
  errors += task.decode_option_errors(config, options)
  # The default, config.decode.checkpoint, is checked with the config.
  if to_be_trained and _CHECKPOINT.value is not None:
    errors += config_rules.checkpoint_kept_errors(
      config, _CHECKPOINT.value, '--checkpoint', advice=True
    )
  if _INPUT_FILE.value is None and not _PROMPT.value and not _ATTENTION_PLOT.value:
    errors += (
      datasets.split_errors(config.data, _SPLIT.value, '--split')
      if _SPLIT.value
      else datasets.split_errors(
        config.data, config.data.test_split, 'config.data.test_split', ' (the default --split)'
      )
    )
  return task, options, errors


def _dry_run_against(configs) -> None:
  """`--dry_run` of the flags for each of `configs` ({name: config}), the runs to be trained.

  Each error is said once, with the runs it concerns. Flag values in their domains and
  output locations are checked first, once (`_check_flags`).
  """
  _check_flags(None)
  runs_of = {}
  for name, config in configs.items():
    for error in _against_the_run(config, to_be_trained=True)[2]:
      runs_of.setdefault(error, []).append(name)
  if runs_of:
    raise app.UsageError(
      'Invalid flags:\n  '
      + '\n  '.join(
        ('every trial' if len(names) == len(configs) else f'trials {"; ".join(names)}')
        + f': {error}'
        for error, names in runs_of.items()
      )
    )
  print(f'eval.py --dry_run: the flags are valid for each of the {len(configs)} runs.')


def _write_output(lines) -> None:
  """One line per input line, to --output_file ('-': stdout)."""
  outputs.write(_OUTPUT_FILE.value, ''.join(line + '\n' for line in lines), '--output_file')


if __name__ == '__main__':
  errors.run(main)
