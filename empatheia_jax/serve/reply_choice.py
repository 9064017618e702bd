"""Choosing one reply among several drawn for the same turn: the consensus (minimum-Bayes-risk) choice.

Why: greedy decoding returns the mode token by token, and the mode of an empathetic reply is the same few
sentences for every dialogue ("I'm sorry to hear that."); one sampled reply is specific but often strays
(it says less of what a person would have said: lower BLEU-2 and ROUGE-L against the gold reply). Sampling
n replies and keeping the one that agrees most with the other n - 1 (Kumar & Byrne 2004; Freitag et al.
2023 for sampled candidates) keeps a reply of THIS dialogue's distribution, near its centre rather than its
mode. The agreement is ROUGE-L F1 (`rouge-score`, Porter-stemmed: the metric the reply is judged by),
summed over the other candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def agreement(candidates: Sequence[str]) -> np.ndarray:
    """[n, n] ROUGE-L F1 of candidate i (as the prediction) against candidate j, 0 on the diagonal (a
    candidate does not vote for itself). F1 is symmetric, so each pair is scored once."""
    n = len(candidates)
    out = np.zeros((n, n))
    scorer = _scorer()
    for i in range(n):
        for j in range(i + 1, n):
            out[i, j] = out[j, i] = scorer.score(candidates[j], candidates[i])["rougeL"].fmeasure
    return out


def consensus_index(candidates: Sequence[str]) -> int:
    """The index of the candidate with the highest summed agreement with the others; ties go to the
    earliest (so the choice is a function of the draws alone)."""
    if not candidates:
        raise ValueError("consensus_index: no candidates to choose among")
    return int(np.argmax(agreement(candidates).sum(axis=1)))
