"""Choosing one reply among several drawn for the same turn: the consensus (minimum-Bayes-risk) choice.

Why: greedy decoding returns the mode token by token, and the mode of an empathetic reply is the same few
sentences for every dialogue ("I'm sorry to hear that."); one sampled reply is specific but often strays
(it says less of what a person would have said: lower BLEU-2 and ROUGE-L against the gold reply). Sampling
n replies and keeping the one that agrees most with the other n - 1 (Kumar & Byrne 2004; Freitag et al.
2023 for sampled candidates) keeps a reply of THIS dialogue's distribution, near its centre rather than its
mode. The agreement of a candidate with another is the mean of the two figures the reply is judged by
against its gold (`eval.metrics.text.reply_overlap`), here with the other candidate as the reference:
ROUGE-L F1 (`rouge-score`, Porter-stemmed) and sentence BLEU-2 (`sacrebleu`, 13a tokens, lowercased,
effective order, its default exponential smoothing). On the first half of the ED dev part (448 turns, 8
draws) this mean put both BLEU-2 and ROUGE-L above the greedy reply, where ROUGE-L alone left BLEU-2 level
and BLEU-2 alone gained the most BLEU-2 with a smaller ROUGE-L gain (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=1)
def _scorers():
    from rouge_score import rouge_scorer
    from sacrebleu.metrics import BLEU

    return (rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True),
            BLEU(max_ngram_order=2, lowercase=True, effective_order=True))


def agreement(candidates: Sequence[str]) -> np.ndarray:
    """[n, n]: how much candidate i says of candidate j (i as the hypothesis, j as the reference), the mean
    of ROUGE-L F1 and sentence BLEU-2 in [0, 1]; 0 on the diagonal (a candidate does not vote for itself)."""
    n = len(candidates)
    out = np.zeros((n, n))
    rouge, bleu = _scorers()
    for i in range(n):
        for j in range(n):
            if i != j:
                out[i, j] = 0.5 * (rouge.score(candidates[j], candidates[i])["rougeL"].fmeasure
                                   + bleu.sentence_score(candidates[i], [candidates[j]]).score / 100)
    return out


def consensus_index(candidates: Sequence[str]) -> int:
    """The index of the candidate with the highest summed agreement with the others; ties go to the
    earliest (so the choice is a function of the draws alone)."""
    if not candidates:
        raise ValueError("consensus_index: no candidates to choose among")
    return int(np.argmax(agreement(candidates).sum(axis=1)))
