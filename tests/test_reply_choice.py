"""The consensus choice among drawn replies (`serve.reply_choice`): ROUGE-L counted by hand, BLEU-2 as
sacrebleu's own sentence score."""

from __future__ import annotations

import numpy as np
import pytest
from sacrebleu.metrics import BLEU

from empatheia_jax.serve.reply_choice import agreement, consensus_index

CANDS = ["Oh no.", "So sorry, what did the vet say?", "Oh no, I am so sorry, what did the vet say then?"]


def _f1(lcs: int, a: int, b: int) -> float:
    return 2 * lcs / (a + b)


def test_agreement_is_the_mean_of_rouge_l_and_sentence_bleu2():
    # ROUGE-L by hand: lowercased, punctuation dropped, stemmed; the longest common subsequences are
    # "oh no" (2 of 2 and 12 words) and "so sorry what did the vet say" (7 of 7 and 12).
    rouge = np.array([[0, 0, _f1(2, 2, 12)],
                      [0, 0, _f1(7, 7, 12)],
                      [_f1(2, 2, 12), _f1(7, 7, 12), 0]])
    bleu = BLEU(max_ngram_order=2, lowercase=True, effective_order=True)
    sent = np.array([[0 if i == j else bleu.sentence_score(CANDS[i], [CANDS[j]]).score / 100
                      for j in range(3)] for i in range(3)])
    assert sent[1, 2] != sent[2, 1]  # BLEU is not symmetric: i is the hypothesis, j the reference
    np.testing.assert_allclose(agreement(CANDS), 0.5 * (rouge + sent), atol=1e-12)
    assert consensus_index(CANDS) == 2  # it shares "oh no" with the first and the question with the second


def test_consensus_ties_go_to_the_earliest_and_needs_a_candidate():
    assert consensus_index(["a b", "c d", "e f"]) == 0  # no agreement at all: the first draw
    assert consensus_index(["x", "I am sorry", "I am sorry"]) == 1  # two equal candidates: the earlier
    assert consensus_index(["only one"]) == 0
    with pytest.raises(ValueError, match="no candidates"):
        consensus_index([])


def test_a_candidate_that_repeats_itself_votes_but_is_not_kept():
    """The reply the ED dev consensus kept once: its words repeat a 4-gram in another case, which the
    decode's token-level ban did not see. It agrees most with the others, yet a clean candidate is kept; it
    still votes (the others' scores are unchanged), and when every candidate repeats, the consensus stands."""
    looped = "When you are lonely, you should know how to feel when you are lonely."
    cands = ["You should know how to feel when you are lonely.", looped,
             "When you are lonely, you should talk to a friend.", "That is hard."]
    scores = agreement(cands).sum(axis=1)
    assert int(np.argmax(scores)) == 1  # without the rule the repeat would be kept
    clean = [0, 2, 3]
    assert consensus_index(cands) == clean[int(np.argmax(scores[clean]))]
    both = [looped, "I know you are lonely and you are lonely and sad."]
    assert consensus_index(both) == int(np.argmax(agreement(both).sum(axis=1)))  # every one repeats
