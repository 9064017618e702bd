"""How the reply of a Chain of Empathy is decoded: drawn again after the greedy reasoning (`redraw_replies`,
as `decoding.ReplySampling` asks), and chosen among several draws by their consensus (`consensus_index`).
Eval and chat (`Decoding(reply_sampling=)` given to `generate_predictions` / `chat.respond`) share it.

The consensus (minimum-Bayes-risk) choice. Why: greedy decoding returns the mode token by token, and the
mode of an empathetic reply is the same few sentences for every dialogue ("I'm sorry to hear that."); one
sampled reply is specific but often strays (it says less of what a person would have said: lower BLEU-2
and ROUGE-L against the gold reply). Sampling n replies and keeping the one that agrees most with the
other n - 1 (Kumar & Byrne 2004; Freitag et al. 2023 for sampled candidates) keeps a reply of THIS
dialogue's distribution, near its centre rather than its mode. The agreement of a candidate with another
is the mean of the two figures the reply is judged by against its gold (`eval.metrics.text.reply_overlap`),
here with the other candidate as the reference: ROUGE-L F1 (`rouge-score`, Porter-stemmed) and sentence
BLEU-2 (`sacrebleu`, 13a tokens, lowercased, effective order, its default exponential smoothing). On the
first half of the ED dev part (448 turns, 8 draws) this mean put both BLEU-2 and ROUGE-L above the greedy
reply, where ROUGE-L alone left BLEU-2 level and BLEU-2 alone gained the most BLEU-2 with a smaller
ROUGE-L gain (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from empatheia_jax.data import templates as tpl
from empatheia_jax.data.parse import has_repeated_ngram
from empatheia_jax.serve.decoding import Decoding
from empatheia_jax.serve.generation import generate_tokens


def reply_header_tokens(tokenizer: Any, new: Sequence[int]) -> int | None:
    """How many of the generated tokens `new` run through the CoE's step-5 header (the fewest whose text
    covers `templates.response_header_end`), None when the text has no such header."""
    end = tpl.response_header_end(tokenizer.decode(list(new), skip_special_tokens=False))
    if end is None:
        return None
    return next(k for k in range(1, len(new) + 1)
                if len(tokenizer.decode(list(new[:k]), skip_special_tokens=False)) >= end)


def redraw_replies(llm: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], news: Sequence[list[int]],
                   decoding: Decoding, *, seed: int, eos: Sequence[int], pad_token_id: int,
                   embed: Callable[[list[list[int]]], Any]) -> tuple[list[list[int]], list[list[str] | None]]:
    """(`news` (each prompt's greedy new tokens) with every reply after a step-5 header drawn again as
    `decoding.reply_sampling` asks (the consensus of its candidates) in one sampled decode of the whole
    batch, seeded with `seed`, under `decoding`'s repetition controls; each row's drawn candidate replies as
    text, in draw order, None where the text has no header and is kept). `embed(prefixes)` gives the
    prefixes' input embeddings with the prompts' media spliced (None when nothing is spliced); the total stays
    within `decoding.max_new_tokens`. The candidates let a reader re-choose offline (`bench/reply_decoding.py
    score` on an eval's predictions)."""
    sampling = decoding.reply_sampling
    if sampling is None:
        raise ValueError("redraw_replies: decoding.reply_sampling is None (the greedy reply): no draw asked")
    max_new_tokens = decoding.max_new_tokens
    heads = [reply_header_tokens(tokenizer, n) for n in news]
    if all(k is None for k in heads):
        return [list(n) for n in news], [None] * len(news)
    prefixes = [list(p) + n[: k if k is not None else len(n)] for p, n, k in zip(prompts, news, heads,
                                                                                strict=True)]
    budget = max(1, max_new_tokens - min(k for k in heads if k is not None))
    m = sampling.candidates
    drawn = generate_tokens(llm, prefixes, budget, sampling.temperature, sampling.top_p, seed=seed,
                            eos_ids=eos, pad_token_id=pad_token_id, inputs_embeds=embed(prefixes),
                            repetition_penalty=decoding.repetition_penalty,
                            no_repeat_ngram_size=decoding.no_repeat_ngram_size, num_samples=m)
    out, texts = [], []
    for r, (n, k) in enumerate(zip(news, heads, strict=True)):
        if k is None:
            out.append(list(n))
            texts.append(None)
            continue
        replies = [drawn.new_tokens[r * m + j, : drawn.num_new[r * m + j]].tolist() for j in range(m)]
        texts.append([tokenizer.decode(x, skip_special_tokens=True).strip() for x in replies])
        pick = 0 if m == 1 else consensus_index(texts[-1])
        out.append(n[:k] + replies[pick][: max_new_tokens - k])
    return out, texts


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
    earliest (so the choice is a function of the draws alone). A candidate that repeats a word 4-gram of its
    own (`parse.has_repeated_ngram`, the eval's repetition row) still votes but is chosen only when every
    candidate does: the decode's token-level ban misses a repeat in another case."""
    if not candidates:
        raise ValueError("consensus_index: no candidates to choose among")
    scores = agreement(candidates).sum(axis=1)
    clean = np.array([not has_repeated_ngram(c) for c in candidates])
    return int(np.argmax(np.where(clean, scores, -np.inf) if clean.any() else scores))
