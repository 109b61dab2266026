"""One checkpoint translated by eval.py's decoder, transformers' generate() and CTranslate2.

  python bench/translation_engines.py --workdir=workdirs/m30k_best --workdir=workdirs/m30k_paper

For each run, the parameters of its `config.decode.checkpoint` (or `--checkpoint`) are
exported (`convert.py`'s code) to a Hugging Face Marian directory, where the run has an exact
Marian form (post-LN), and to CTranslate2 in float32 and int8; then the test split is
translated, text to text, by each engine from those same weights with beam search
(`--beam_size`, default the run's):
  * with the length penalty off (alpha 0 here, `length_penalty=0` there: every engine ranks
    finished hypotheses by their summed log-probability), where the float32 engines must give
    the same translations up to ties; the identical share against eval.py's is reported;
  * with each engine's own penalty at its best on the validation split: this project's GNMT
    `((5 + L) / 6) ** alpha` (alpha from `--alphas`), transformers' and CTranslate2's
    `L ** p` (p from `--penalties`).
Speed: sentences per second of the whole text-to-text call, penalty off, measured on the
second of two identical passes (the first compiles this project's shapes and warms the others'
caches), every engine given all the machine's cores, one engine at a time, in one run, each in
its fastest thread setting found on a CPU: eval.py as it decodes there (small batches, two per
core at once: `inference.batch_size`, `inference.concurrent_batches`), CTranslate2 one thread
per batch with a batch on each core (`inter_threads`), transformers with torch's threads over
all cores (one thread per process was slower).
BLEU: sacreBLEU's default (cased, 13a) and lowercased, as eval.py scores them.

Writes the figures as JSON to `--output` and prints them as a Markdown table.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags, logging  # noqa: E402

from transformer import errors, inference, paper, path_checks, scoring  # noqa: E402
from transformer.interop import ctranslate2_model, marian, workdirs  # noqa: E402
from transformer.tasks.translation import data, decode  # noqa: E402

_WORKDIRS = flags.DEFINE_multi_string('workdir', [], 'A trained translation run (repeatable).')
_CHECKPOINT = flags.DEFINE_string(
  'checkpoint', None, "Which parameters (default: each run's config.decode.checkpoint)."
)
_BEAM_SIZE = flags.DEFINE_integer('beam_size', 0, "Beams (0: each run's config.decode.beam_size).")
_ALPHAS = flags.DEFINE_list(
  'alphas', ['0', '0.5', '1', '1.5', '2'], "This project's GNMT alphas tried on validation."
)
_PENALTIES = flags.DEFINE_list(
  'penalties', ['0', '0.5', '1', '1.5', '2'], "transformers' and CTranslate2's L^p exponents tried."
)
_TUNE_SPLIT = flags.DEFINE_string('tune_split', 'validation', 'Where each penalty is chosen.')
_MAX_SENTENCES = flags.DEFINE_integer('max_sentences', 0, 'Translate at most this many (0: all).')
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 64, "transformers' and CTranslate2's batch rows.")
_OUTPUT = flags.DEFINE_string('output', None, 'Where the figures are written as JSON.')

MAX_EXTRA_LEN = paper.MAX_EXTRA_LEN  # Every engine's output limit: source length + this.


class Ours:
  """eval.py's decoder (decode.translate_lines: length-sorted batches, two-pass beam search)."""

  name = 'eval.py'

  def __init__(self, run: workdirs.RunParams, beam_size: int):
    self.run, self.beam_size = run, beam_size
    self.model_config = run.model_config.replace(deterministic=True)

  def translate(self, lines: list[str], penalty: float) -> list[str]:
    # One beam: eval.py --decoder=greedy (the same outputs as a beam of one, at less cost).
    decoder = 'greedy' if self.beam_size == 1 else 'beam'
    options = inference.DecodeOptions(
      decoder=decoder, beam_size=self.beam_size, alpha=penalty, max_extra_len=MAX_EXTRA_LEN
    )
    return decode.translate_lines(
      self.run.config,
      self.model_config,
      self.run.params,
      lines,
      options=options,  # eval.py's default batches (`inference.batch_size`).
    )


def _length_sorted(lines: list[str], lengths: list[int], batch_size: int):
  """Batches of positions, sorted by length (as eval.py batches), for the other engines."""
  order = sorted(range(len(lines)), key=lambda i: lengths[i])
  return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


class Transformers:
  """transformers' MarianMTModel.generate() on the exported directory, float32 on the CPU."""

  name = 'transformers'

  def __init__(self, directory: str, beam_size: int, batch_size: int):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top

    torch.set_num_threads(os.cpu_count() or 1)
    transformers.logging.set_verbosity_error()  # Not a line per batch on max_new_tokens.
    self.torch = torch
    self.model = transformers.MarianMTModel.from_pretrained(directory).eval()
    self.tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    self.beam_size, self.batch_size = beam_size, batch_size

  def translate(self, lines: list[str], penalty: float) -> list[str]:
    lengths = [len(ids) for ids in self.tokenizer(lines)['input_ids']]
    out = [''] * len(lines)
    for batch in _length_sorted(lines, lengths, self.batch_size):
      inputs = self.tokenizer([lines[i] for i in batch], return_tensors='pt', padding=True)
      with self.torch.inference_mode():
        generated = self.model.generate(
          **inputs,
          num_beams=self.beam_size,
          length_penalty=penalty,
          early_stopping=False,
          do_sample=False,
          max_new_tokens=max(lengths[i] for i in batch) + MAX_EXTRA_LEN,
        )
      texts = self.tokenizer.batch_decode(generated, skip_special_tokens=True)
      for i, text in zip(batch, texts, strict=True):
        out[i] = text
    return out


class CTranslate2:
  """ctranslate2.Translator on the exported directory (convert.py --to_ctranslate2)."""

  def __init__(self, directory: str, quantization: str, beam_size: int, batch_size: int):
    import ctranslate2  # pylint: disable=g-import-not-at-top
    import sentencepiece  # pylint: disable=g-import-not-at-top

    self.name = f'CTranslate2 {quantization}'
    # Its fastest setting on a CPU for models of this size: one thread per batch, as many
    # batches at once as cores (beam 5: 2.9x the sentences/s of one batch on every core,
    # docs/benchmarks.md); `translate` hands it every batch at once.
    self.translator = ctranslate2.Translator(
      directory, device='cpu', intra_threads=1, inter_threads=os.cpu_count() or 1
    )
    self.processor = sentencepiece.SentencePieceProcessor(
      model_file=f'{directory}/sentencepiece.model'
    )
    self.beam_size, self.batch_size = beam_size, batch_size

  def translate(self, lines: list[str], penalty: float) -> list[str]:
    pieces = [self.processor.encode(line, out_type=str) for line in lines]
    out = [''] * len(lines)
    submitted = [
      (
        batch,
        self.translator.translate_batch(
          [pieces[i] for i in batch],
          beam_size=self.beam_size,
          length_penalty=penalty,
          # +1: the source's EOS, counted in eval.py's source length.
          max_decoding_length=max(len(pieces[i]) for i in batch) + 1 + MAX_EXTRA_LEN,
          suppress_sequences=[['<pad>'], ['<s>']],  # As eval.py and the HF export do.
          asynchronous=True,  # Decoded by its inter_threads workers, several at once.
        ),
      )
      for batch in _length_sorted(lines, [len(p) for p in pieces], self.batch_size)
    ]
    for batch, results in submitted:
      for i, result in zip(batch, results, strict=True):
        out[i] = self.processor.decode(result.result().hypotheses[0])
    return out


def _timed(engine, lines: list[str], penalty: float) -> tuple[list[str], float]:
  start = time.perf_counter()
  out = engine.translate(lines, penalty)
  return out, time.perf_counter() - start


def _bleu(hypotheses: list[str], references: list[str]) -> dict[str, float]:
  scores = scoring.corpus_scores(hypotheses, references)
  return {'bleu': round(scores['bleu'], 2), 'bleu_lc': round(scores['bleu_lc'], 2)}


def _texts(run: workdirs.RunParams, split: str) -> tuple[list[str], list[str]]:
  pairs = data.translation_texts(run.config.data, split)
  if _MAX_SENTENCES.value:
    pairs = pairs[: _MAX_SENTENCES.value]
  return [s for s, _ in pairs], [t for _, t in pairs]


def bench_run(workdir: str, scratch: str) -> dict:
  """Every engine's figures for one run."""
  run = workdirs.read_run(workdir, _CHECKPOINT.value)
  beam_size = _BEAM_SIZE.value or run.config.decode.beam_size
  test_split = run.config.data.test_split
  engines = [Ours(run, beam_size)]
  hf_refusals = marian.export_refusals(run.model_config)
  if not hf_refusals:
    hf_dir = os.path.join(scratch, 'hf')
    workdirs.export_hf(workdir, hf_dir, _CHECKPOINT.value)
    engines.append(Transformers(hf_dir, beam_size, _BATCH_SIZE.value))
  for quantization in ('float32', 'int8'):
    ct2_dir = os.path.join(scratch, f'ct2_{quantization}')
    workdirs.export_ctranslate2(workdir, ct2_dir, _CHECKPOINT.value, quantization=quantization)
    engines.append(CTranslate2(ct2_dir, quantization, beam_size, _BATCH_SIZE.value))

  tune_sources, tune_references = _texts(run, _TUNE_SPLIT.value)
  test_sources, test_references = _texts(run, test_split)
  figures = {
    'workdir': workdir,
    'checkpoint': run.label,
    'norm': run.model_config.norm,
    'beam_size': beam_size,
    'test_split': test_split,
    'test_sentences': len(test_sources),
    'transformers_refused': hf_refusals,
    'engines': {},
  }
  penalty_off = {}
  for engine in engines:
    logging.info('%s: %s, penalty off, two passes.', workdir, engine.name)
    _timed(engine, test_sources, 0.0)  # Compiles (eval.py) and warms caches.
    translations, seconds = _timed(engine, test_sources, 0.0)
    penalty_off[engine.name] = translations
    grid = _ALPHAS.value if isinstance(engine, Ours) else _PENALTIES.value
    tuned = {}
    for value in map(float, grid):
      logging.info('%s: %s, penalty %g on %s.', workdir, engine.name, value, _TUNE_SPLIT.value)
      tuned[value] = _bleu(engine.translate(tune_sources, value), tune_references)['bleu']
    best = max(tuned, key=lambda v: (tuned[v], -abs(v)))  # Ties: the smaller penalty.
    figures['engines'][engine.name] = {
      'sentences_per_s': round(len(test_sources) / seconds, 1),
      'seconds': round(seconds, 2),
      'penalty_off': _bleu(translations, test_references),
      'identical_to_eval_py': sum(
        a == b for a, b in zip(translations, penalty_off['eval.py'], strict=True)
      ),
      'validation_bleu_by_penalty': {f'{v:g}': b for v, b in tuned.items()},
      'best_penalty': best,
      'best_penalty_test': _bleu(engine.translate(test_sources, best), test_references),
    }
  return figures


def table(figures: list[dict]) -> str:
  """The Markdown table of `figures`."""
  lines = [
    '| run | engine | sentences/s | identical to eval.py | BLEU (lc), penalty off '
    '| best penalty (validation) | BLEU (lc), best penalty |',
    '| --- | --- | --- | --- | --- | --- | --- |',
  ]
  for run in figures:
    for name, engine in run['engines'].items():
      off, best = engine['penalty_off'], engine['best_penalty_test']
      lines.append(
        f'| {Path(run["workdir"]).name} ({run["norm"]}) | {name} | {engine["sentences_per_s"]} '
        f'| {engine["identical_to_eval_py"]} / {run["test_sentences"]} '
        f'| {off["bleu"]} ({off["bleu_lc"]}) | {engine["best_penalty"]:g} '
        f'| {best["bleu"]} ({best["bleu_lc"]}) |'
      )
  return '\n'.join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not _WORKDIRS.value:
    raise errors.InvalidInput('Name at least one --workdir.')
  for name, grid in (('--alphas', _ALPHAS.value), ('--penalties', _PENALTIES.value)):
    try:
      values = [float(v) for v in grid]
    except ValueError:
      problem = f'{name}={",".join(grid)} holds a value that is not a number.'
      raise errors.InvalidInput(problem) from None
    if not values or min(values) < 0:
      raise errors.InvalidInput(f'{name} must list numbers >= 0.')
  # Checked before any work, as every output is (a run's files among them).
  if _OUTPUT.value and (problems := path_checks.output_errors(_OUTPUT.value, '--output')):
    raise errors.InvalidInput(problems[0])
  for workdir in _WORKDIRS.value:  # Before anything is exported or decoded.
    refusals = ctranslate2_model.refusals(workdirs.run_model_config(workdir)[1])
    if refusals:
      raise errors.InvalidInput(f'{workdir} has no CTranslate2 form: ' + '; '.join(refusals))
  figures = []
  for workdir in _WORKDIRS.value:
    with tempfile.TemporaryDirectory() as scratch:
      figures.append(bench_run(workdir, scratch))
  if _OUTPUT.value:
    Path(_OUTPUT.value).write_text(json.dumps(figures, indent=2) + '\n')
  print(f'{os.cpu_count()} CPU cores; beam search, batches sorted by length.')
  print(table(figures))


if __name__ == '__main__':
  errors.run(main)
