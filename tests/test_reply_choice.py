"""The consensus choice among drawn replies (`serve.reply_choice`), against hand-counted ROUGE-L."""

from __future__ import annotations

import numpy as np
import pytest

from empatheia_jax.serve.reply_choice import agreement, consensus_index


def _f1(lcs: int, a: int, b: int) -> float:
    return 2 * lcs / (a + b)


def test_agreement_is_rouge_l_f1_counted_by_hand():
    # Lowercased, punctuation dropped, Porter-stemmed ("sorry" -> "sorri" on both sides).
    cands = ["Oh no.", "So sorry, what did the vet say?", "Oh no, I am so sorry, what did the vet say then?"]
    got = agreement(cands)
    want = np.array([[0, 0, _f1(2, 2, 12)],
                     [0, 0, _f1(7, 7, 12)],
                     [_f1(2, 2, 12), _f1(7, 7, 12), 0]])
    np.testing.assert_allclose(got, want, atol=1e-12)
    assert consensus_index(cands) == 2  # 0.29 + 0.74 against 0.74 and 0.29


def test_consensus_ties_go_to_the_earliest_and_needs_a_candidate():
    assert consensus_index(["a b", "c d", "e f"]) == 0  # no agreement at all: the first draw
    assert consensus_index(["x", "I am sorry", "I am sorry"]) == 1  # two equal candidates: the earlier
    assert consensus_index(["only one"]) == 0
    with pytest.raises(ValueError, match="no candidates"):
        consensus_index([])
