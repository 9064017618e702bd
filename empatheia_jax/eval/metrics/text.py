"""Text and feature metrics as pure functions of predictions and references.

One implementation of each metric serves the model and the baselines alike, so their numbers are
comparable by construction; every number is float32/float64 numpy on the host.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from empatheia_jax.data.parse import has_repeated_ngram, ngrams, words


def feature_distances(pred: Any, target: Any, mask: Any, eps: float = 1e-8) -> tuple[np.ndarray, np.ndarray]:
    """Per valid row: (Euclidean distance ||p - t||_2, cosine similarity) as float64 arrays [n_valid].

    pred/target [..., D] (a content row or a style vector), mask [...] (the leading axes). This is
    NExT-GPT's per-token L2 (a distance, not its square; the training loss L_ccl is the square). A zero
    vector has cosine 0.
    """
    p = np.asarray(pred, np.float64)
    t = np.asarray(target, np.float64)
    m = np.asarray(mask).astype(bool)
    if p.shape != t.shape or p.shape[:-1] != m.shape:
        raise ValueError(f"shapes differ: pred {p.shape}, target {t.shape}, mask {m.shape}")
    p, t = p[m], t[m]
    l2 = np.linalg.norm(p - t, axis=-1)
    pn, tn = np.linalg.norm(p, axis=-1), np.linalg.norm(t, axis=-1)
    cos = np.sum(p * t, axis=-1) / np.maximum(pn * tn, eps)
    return l2, cos


def accuracy(pred: Any, labels: Any) -> tuple[int, int]:
    """(correct, counted) over the examples with a label (label >= 0); `pred` are class ids."""
    pred, labels = np.asarray(pred), np.asarray(labels)
    valid = labels >= 0
    return int(np.sum(valid & (pred == labels))), int(np.sum(valid))


def distinct_n(texts: Iterable[str], n: int) -> float:
    """Dist-n, corpus level (Li et al., 2016; the ED literature and the Empatheia paper): distinct n-grams /
    all n-grams over all texts (n-grams never cross texts)."""
    grams: collections.Counter = collections.Counter()
    for text in texts:
        grams.update(ngrams(text, n))
    total = sum(grams.values())
    return len(grams) / total if total else 0.0


def distinct_n_per_reply(texts: Iterable[str], n: int) -> float:
    """Dist-n as E3RG reports it: each reply's distinct n-grams / its n-grams, averaged over the replies
    that have an n-gram (a reply shorter than n has no ratio). Higher than the corpus figure: a reply that
    repeats the words of other replies loses nothing here."""
    ratios = [len(set(g)) / len(g) for g in (ngrams(t, n) for t in texts) if g]
    return float(np.mean(ratios)) if ratios else 0.0


# The step-2 decisions besides the free one, by the suffix of their prediction fields (emotion_fine_<kind>):
# chosen by likelihood, by the emotion head, and by both with the free step (`eval.emotion_head.combine`).
DECISIONS = ("scored", "head", "combined")


def reply_length(text: str) -> int:
    """Words of a reply (letter/digit runs; punctuation does not count)."""
    return sum(1 for w in words(text) if w[0].isalnum())


def text_metrics(predictions: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Text metrics over parsed generations (dicts of `parse_generation` plus gold "labels").

    emotion_acc_text: CoE step-2 class (the shards' emotion map, 7 coarse classes for AvaMERG) == gold
    emotion, over predictions with a gold emotion (unparseable counts as wrong); emotion32_acc_text: the same
    on the 32 ED labels against gold `emotion_fine`. coe_parse_rate: share with a step-2 emotion found;
    emotion_parse_rate / emotion32_parse_rate: share whose step 2 maps to a class / an ED label;
    signal_rate: share holding all signal tokens (when "signal_complete" is given); dist{1,2}_corpus
    (`distinct_n`) and dist{1,2}_reply (`distinct_n_per_reply`) over the replies; repetition_rate: share
    of replies with a repeated word 4-gram (`has_repeated_ngram`); reply_words: mean reply length in words
    (`reply_length`); with the predictions' gold_reply and speaker_turn (`generate_predictions`), the
    `reply_overlap` and `reply_engagement` rows; *_acc_text for the Pipeline baseline's profile line.
    Predictions with the *_scored fields of `generate_predictions(score_emotions=True)` add
    emotion_acc_scored / emotion32_acc_scored (unscored = wrong) and emotion_scored_rate (share with a CoE to
    score after); with an emotion head's fields (`generate_predictions(emotion_head=)`), emotion_acc_head /
    emotion32_acc_head and, where combined, emotion_acc_combined / emotion32_acc_combined.
    """
    if not predictions:
        return {}
    m = Means()
    for p in predictions:
        gold = p.get("labels", {})
        m.add("coe_parse_rate", bool(p["emotion_word"]), 1)
        m.add("emotion_parse_rate", p["emotion"] >= 0, 1)
        m.add("emotion32_parse_rate", p.get("emotion_fine", -1) >= 0, 1)
        if gold.get("emotion", -1) >= 0:
            m.add("emotion_acc_text", p["emotion"] == gold["emotion"], 1)
        if gold.get("emotion_fine", -1) >= 0:
            m.add("emotion32_acc_text", p.get("emotion_fine", -1) == gold["emotion_fine"], 1)
        if "emotion_fine_scored" in p:  # generate_predictions(score_emotions=True)
            m.add("emotion_scored_rate", p["emotion_fine_scored"] >= 0, 1)
        for kind in DECISIONS:
            if f"emotion_fine_{kind}" not in p:
                continue
            if gold.get("emotion", -1) >= 0:
                m.add(f"emotion_acc_{kind}", p[f"emotion_{kind}"] == gold["emotion"], 1)
            if gold.get("emotion_fine", -1) >= 0:
                m.add(f"emotion32_acc_{kind}", p[f"emotion_fine_{kind}"] == gold["emotion_fine"], 1)
        if "signal_complete" in p:
            m.add("signal_rate", bool(p["signal_complete"]), 1)
        for name in ("age", "gender", "timbre"):
            if name in p and gold.get(name, -1) >= 0:
                m.add(f"{name}_acc_text", p[name] == gold[name], 1)
    out = m.result()
    with_gold = all("gold_reply" in p for p in predictions)
    out.update(reply_metrics([p["reply"] for p in predictions],
                             [p["gold_reply"] for p in predictions] if with_gold else None,
                             [p["speaker_turn"] for p in predictions] if with_gold else None))
    out["num_generated"] = float(len(predictions))
    return out


def reply_metrics(replies: Sequence[str], golds: Sequence[str] | None = None,
                  speaker_turns: Sequence[str] | None = None) -> dict[str, float]:
    """The reply rows of `text_metrics` for bare replies: repetition_rate, reply_words, Dist-n and, with
    the gold replies and the speaker's last turns, `reply_overlap` and `reply_engagement`."""
    if not replies:
        return {}
    m = Means()
    for r in replies:
        m.add("repetition_rate", has_repeated_ngram(r), 1)
        m.add("reply_words", reply_length(r), 1)
    out = {**m.result(), **reply_text_metrics(replies)}
    if golds is not None:
        out.update(reply_overlap(replies, golds))
    if speaker_turns is not None:
        out.update(reply_engagement(replies, speaker_turns))
    return out


def reply_text_metrics(replies: Sequence[str]) -> dict[str, float]:
    """Dist-1/2 in both conventions over `replies` (the model's, or the gold ones as a reference)."""
    return {"dist1_corpus": distinct_n(replies, 1), "dist2_corpus": distinct_n(replies, 2),
            "dist1_reply": distinct_n_per_reply(replies, 1), "dist2_reply": distinct_n_per_reply(replies, 2)}


def reply_overlap(replies: Sequence[str], golds: Sequence[str]) -> dict[str, float]:
    """How much of the gold reply a reply says: reply_bleu1 / reply_bleu2 (sacrebleu's corpus BLEU with
    n-grams up to 1 / 2, its default 13a tokenisation, lowercased; 0-1, not 0-100) and reply_rouge_l (the
    mean ROUGE-L F1 of rouge-score, Porter-stemmed). Generic replies ("I'm sorry to hear that.") fit many
    dialogues and score low against each gold; Dist-n cannot see that, since it never reads the gold."""
    if len(replies) != len(golds):
        raise ValueError(f"{len(replies)} replies for {len(golds)} gold replies")
    if not replies:
        return {}
    from rouge_score import rouge_scorer
    from sacrebleu.metrics import BLEU

    out = {f"reply_bleu{n}": BLEU(max_ngram_order=n, lowercase=True).corpus_score(list(replies),
                                                                                  [list(golds)]).score / 100
           for n in (1, 2)}
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    out["reply_rouge_l"] = float(np.mean([scorer.score(g, r)["rougeL"].fmeasure
                                          for r, g in zip(replies, golds, strict=True)]))
    return out


def content_words(text: str) -> set[str]:
    """The words of `text` that carry its content: `parse.words`, lowercased, without scikit-learn's English
    stop words (a fixed, well-known list), contractions (I'm, don't, it's: function words the list spells
    without the apostrophe) and one-letter tokens."""
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    return {w for w in (x.lower() for x in words(text))
            if len(w) > 1 and "'" not in w and w not in ENGLISH_STOP_WORDS}


def speaker_turn(record: Mapping[str, Any]) -> str:
    """The speaker's last utterance in a shard record's history (what a reply answers), "" if none."""
    said = [h.get("utterance") for h in record.get("history") or () if h.get("role") == "speaker"]
    return str(said[-1]) if said and said[-1] else ""


def reply_engagement(replies: Sequence[str], speaker_turns: Sequence[str]) -> dict[str, float]:
    """Does a reply engage with THIS dialogue: question_rate (share of replies that ask something, a "?"),
    reuse_rate (share that reuse a content word of the speaker's last turn, `content_words`) and
    duplicate_rate (1 - distinct replies / replies, compared as their lowercased words without punctuation:
    the share of replies that repeat another one word for word)."""
    if len(replies) != len(speaker_turns):
        raise ValueError(f"{len(replies)} replies for {len(speaker_turns)} speaker turns")
    if not replies:
        return {}
    distinct = {" ".join(w.lower() for w in words(r) if w[0].isalnum()) for r in replies}
    return {"question_rate": float(np.mean(["?" in r for r in replies])),
            "reuse_rate": float(np.mean([bool(content_words(r) & content_words(s))
                                         for r, s in zip(replies, speaker_turns, strict=True)])),
            "duplicate_rate": 1.0 - len(distinct) / len(replies)}


def vote_emotions(votes: Sequence[Sequence[Mapping[str, Any]]], key: str = "emotion") -> dict[int, int]:
    """Emotion voting as E3RG does it: several voters (prompts or checkpoints) each predict the emotion of
    every record (`generate_predictions` lists), and the majority decides, per record_index. Unparsed votes
    (-1) abstain; a tie goes to the class voted by the earliest voter among the tied (list the strongest
    voter first); a record no voter parsed gets -1."""
    ballots: dict[int, list[int]] = collections.defaultdict(list)
    for voter in votes:
        for p in voter:
            ballots[int(p["record_index"])].append(int(p.get(key, -1)))
    out = {}
    for idx, cast in ballots.items():
        valid = [c for c in cast if c >= 0]
        if not valid:
            out[idx] = -1
            continue
        counts = collections.Counter(valid)
        top = max(counts.values())
        out[idx] = next(c for c in valid if counts[c] == top)
    return out


def vote_metrics(votes: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, float]:
    """emotion_acc_vote / emotion32_acc_vote: accuracy of `vote_emotions` against the gold labels of the
    first voter's records (the 7 coarse classes and the 32 ED labels), unparsed = wrong."""
    if not votes or not votes[0]:
        return {}
    gold = {int(p["record_index"]): p.get("labels", {}) for p in votes[0]}
    m = Means()
    for key, row, gold_key in (("emotion", "emotion_acc_vote", "emotion"),
                               ("emotion_fine", "emotion32_acc_vote", "emotion_fine")):
        decided = vote_emotions(votes, key)
        for idx, lab in gold.items():
            if lab.get(gold_key, -1) >= 0:
                m.add(row, decided.get(idx, -1) == lab[gold_key], 1)
    return m.result()


def per_class_accuracy(predictions: Sequence[Mapping[str, Any]], key: str, classes: Sequence[str],
                       gold_key: str | None = None) -> dict[str, dict[str, float]]:
    """{class: {"accuracy", "n"}} of the prediction `key` against gold `labels[gold_key or key]`, per gold
    class (the paper's Figure 6); classes with no gold example are left out."""
    gold_key = gold_key or key
    hits: dict[int, list[bool]] = collections.defaultdict(list)
    for p in predictions:
        g = p.get("labels", {}).get(gold_key, -1)
        if g is not None and g >= 0:
            hits[int(g)].append(p.get(key, -1) == g)
    return {classes[c]: {"accuracy": float(np.mean(h)), "n": float(len(h))} for c, h in sorted(hits.items())}


class Means:
    """Running (sum, count) per metric name; `result()` gives sum / count for names with count > 0."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = collections.defaultdict(float)
        self.counts: dict[str, float] = collections.defaultdict(float)

    def add(self, name: str, total: float, count: float) -> None:
        self.sums[name] += float(total)
        self.counts[name] += float(count)

    def add_values(self, name: str, values: np.ndarray) -> None:
        self.add(name, float(np.sum(values)), values.size)

    def result(self) -> dict[str, float]:
        return {k: self.sums[k] / c for k, c in self.counts.items() if c > 0}
