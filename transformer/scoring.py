"""Translation quality: sacreBLEU (cased and lowercased) and chrF, and the paper's tokenized
compound-split BLEU.

Each score can carry sacreBLEU's bootstrap 95% confidence interval (`n_bootstrap`
resamples of the test sentences, seeded by the environment variable SACREBLEU_SEED,
12345 unless set, exactly as the `sacrebleu` command line does): `bleu_ci` is half
the interval's width, so a score reads `bleu ± bleu_ci`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import sacrebleu
from sacrebleu.metrics.base import Metric, Score

from transformer.errors import InvalidInput

if TYPE_CHECKING:
  from sacremoses import MosesTokenizer

# tensor2tensor's get_ende_bleu.sh: split hyphenated compounds into three tokens.
_COMPOUND = re.compile(r'(\S)-(\S)')


DEFAULT_BOOTSTRAP = 1000  # sacreBLEU's default number of bootstrap resamples.


def check_n_bootstrap(n_bootstrap: int) -> None:
  """Raises a ValueError unless `n_bootstrap` is an int >= 1 (1: no interval)."""
  if isinstance(n_bootstrap, bool) or not isinstance(n_bootstrap, int) or n_bootstrap < 1:
    raise InvalidInput(
      f'n_bootstrap={n_bootstrap!r} must be an integer >= 1 (1: no confidence '
      f'interval; sacreBLEU uses {DEFAULT_BOOTSTRAP}).'
    )


def _score(
  metric: Metric, name: str, hypotheses: Sequence[str], references: Sequence[str], n_bootstrap: int
) -> tuple[dict, Score]:
  """{name: score[, name_ci: half-width, name_bootstrap_mean: mean]} and sacreBLEU's Score."""
  score = metric.corpus_score(list(hypotheses), [list(references)], n_bootstrap=n_bootstrap)
  values = {name: score.score}
  if n_bootstrap > 1:  # Score.estimate_ci's results: sacreBLEU has no public getter for them.
    values.update({f'{name}_ci': float(score._ci), f'{name}_bootstrap_mean': float(score._mean)})
  return values, score


def corpus_scores(
  hypotheses: Sequence[str], references: Sequence[str], n_bootstrap: int = 1
) -> dict:
  """sacreBLEU's default BLEU (cased, 13a, on detokenized text), the same lowercased, and chrF.

  The lowercased BLEU (`bleu_lc`, sacreBLEU's `lowercase=True`: `sacrebleu -lc`) is
  the score the Multi30k literature reports (BLEU on lowercased, tokenized text).

  Args:
    hypotheses: One system output per sentence.
    references: One reference per sentence.
    n_bootstrap: With more than 1, also each score's 95% confidence interval from
      that many bootstrap resamples (sacreBLEU's `corpus_score(n_bootstrap=...)`):
      `bleu_ci`, `bleu_lc_ci`, `chrf_ci` (half-widths) and the resamples' means; the
      signatures then name the resamples and seed (`bs:1000|seed:12345`).

  Returns:
    bleu, bleu_signature, bleu_lc, bleu_lc_signature, chrf, chrf_signature,
    length_ratio, num_sentences (and the interval keys above).
  """
  if len(hypotheses) != len(references):
    raise InvalidInput(f'{len(hypotheses)} hypotheses for {len(references)} references.')
  check_n_bootstrap(n_bootstrap)
  bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
  bleu_lc = sacrebleu.metrics.BLEU(lowercase=True)
  results, score = _score(bleu, 'bleu', hypotheses, references, n_bootstrap)
  results.update(_score(bleu_lc, 'bleu_lc', hypotheses, references, n_bootstrap)[0])
  results.update(_score(chrf, 'chrf', hypotheses, references, n_bootstrap)[0])
  results.update(
    bleu_signature=str(bleu.get_signature()),
    bleu_lc_signature=str(bleu_lc.get_signature()),
    chrf_signature=str(chrf.get_signature()),
    length_ratio=score.sys_len / max(score.ref_len, 1),
    num_sentences=len(hypotheses),
  )
  return results


def references_digest(references: Sequence[str]) -> str:
  """SHA-256 of the reference lines (newline-terminated UTF-8): equal digests, equal references."""
  return hashlib.sha256(''.join(r + '\n' for r in references).encode('utf-8')).hexdigest()


def format_score(results: dict, name: str) -> str:
  """'37.70 ± 1.10' (with an interval) or '37.70' for `results[name]`."""
  text = f'{results[name]:.2f}'
  if f'{name}_ci' in results:
    text += f' ± {results[name + "_ci"]:.2f}'
  return text


def _moses_compound_split(text: str, tokenizer: MosesTokenizer) -> str:
  tokenized = tokenizer.tokenize(text, return_str=True, escape=False)
  return _COMPOUND.sub(r'\1 ##AT##-##AT## \2', tokenized)


def tokenized_compound_split_scores(
  hypotheses: Sequence[str], references: Sequence[str], lang: str, n_bootstrap: int = 1
) -> dict:
  """{'bleu_tokenized_compound_split': BLEU as the paper measured it (27.3/28.4 on WMT14 En-De)}.

  Moses tokenization, then hyphenated compounds split ("a-b" -> "a ##AT##-##AT## b"),
  then BLEU on the tokens with no further tokenization (multi-bleu.perl's
  arithmetic). Higher than sacreBLEU on the same output, and not comparable with it.
  With `n_bootstrap` > 1 also its interval (`..._ci`, `..._bootstrap_mean`), from
  the same sacreBLEU resampling as `corpus_scores` (BLEU over the tokens costs as
  little to resample as sacreBLEU's).
  """
  check_n_bootstrap(n_bootstrap)
  # Imported here: sacremoses takes half a second to import, and only this score needs it.
  from sacremoses import MosesTokenizer  # pylint: disable=g-import-not-at-top

  tokenizer = MosesTokenizer(lang=lang)
  hyps = [_moses_compound_split(h, tokenizer) for h in hypotheses]
  refs = [_moses_compound_split(r, tokenizer) for r in references]
  return _score(
    sacrebleu.metrics.BLEU(tokenize='none', force=True),
    'bleu_tokenized_compound_split',
    hyps,
    refs,
    n_bootstrap,
  )[0]
