"""Translation quality: sacreBLEU and chrF, and the paper's tokenized compound-split BLEU."""

from __future__ import annotations

import re
from collections.abc import Sequence

import sacrebleu
from sacremoses import MosesTokenizer

# tensor2tensor's get_ende_bleu.sh: split hyphenated compounds into three tokens.
_COMPOUND = re.compile(r'(\S)-(\S)')


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
  """sacreBLEU's default BLEU (cased, 13a, on detokenized text) and chrF."""
  if len(hypotheses) != len(references):
    raise ValueError(f'{len(hypotheses)} hypotheses for {len(references)} references.')
  bleu = sacrebleu.metrics.BLEU()
  score = bleu.corpus_score(list(hypotheses), [list(references)])
  chrf = sacrebleu.metrics.CHRF().corpus_score(list(hypotheses), [list(references)])
  return {
    'bleu': score.score,
    'bleu_signature': str(bleu.get_signature()),
    'chrf': chrf.score,
    'length_ratio': score.sys_len / max(score.ref_len, 1),
    'num_sentences': len(hypotheses),
  }


def _moses_compound_split(text: str, tokenizer: MosesTokenizer) -> str:
  tokenized = tokenizer.tokenize(text, return_str=True, escape=False)
  return _COMPOUND.sub(r'\1 ##AT##-##AT## \2', tokenized)


def tokenized_compound_split_bleu(
  hypotheses: Sequence[str], references: Sequence[str], lang: str
) -> float:
  """BLEU as the paper measured it (27.3/28.4 on WMT14 En-De).

  Moses tokenization, then hyphenated compounds split ("a-b" -> "a ##AT##-##AT## b"),
  then BLEU on the tokens with no further tokenization (multi-bleu.perl's
  arithmetic). Higher than sacreBLEU on the same output, and not comparable with it.
  """
  tokenizer = MosesTokenizer(lang=lang)
  hyps = [_moses_compound_split(h, tokenizer) for h in hypotheses]
  refs = [_moses_compound_split(r, tokenizer) for r in references]
  return sacrebleu.metrics.BLEU(tokenize='none', force=True).corpus_score(hyps, [refs]).score
