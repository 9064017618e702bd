"""What a generated text says: its CoE fields, its reply and its emotion class.

The inverse of the templates (`templates.parse_coe`, `parse_pipeline_output`) plus the emotion vocabulary
(`schema.EmotionMap`): evaluation scores these fields, chat shows them.
"""

from __future__ import annotations

import re
from typing import Any

from empatheia_jax.data import schema
from empatheia_jax.data import templates as tpl

_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*|[^\sa-z0-9]")


def words(text: str) -> list[str]:
    """Lower-cased word tokens of a reply: letter/digit runs (inner apostrophes kept), single punctuation."""
    return _WORD_RE.findall(text.lower())


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    """The word n-grams of a text (`words`), in order."""
    w = words(text)
    return [tuple(w[i : i + n]) for i in range(len(w) - n + 1)]


REPEAT_N = 4  # a reply that repeats a word 4-gram of its own is a repetition (the eval's repetition_rate)


def has_repeated_ngram(text: str, n: int = REPEAT_N) -> bool:
    """Whether a text says one word n-gram twice. On words, not tokens: a token-level ban
    (`no_repeat_ngram_size`) lets "When you are lonely ... when you are lonely" through (other case, other
    tokens); the eval's repetition row and the reply choice (`serve.reply_choice`) read it here."""
    grams = ngrams(text, n)
    return len(set(grams)) < len(grams)


def emotion_class(word: str, emotion_map: schema.EmotionMap) -> int | None:
    """Class index of a generated emotion phrase: the whole phrase, else its first word that resolves.

    Gold step-2 values are one word ("terrified"); a model may write "terrified and alone" or "feeling sad".
    """
    return _first_resolving(word, emotion_map.project)


def emotion_fine_class(word: str, emotion_map: schema.EmotionMap) -> int | None:
    """Index among the 32 ED labels (`schema.ED_EMOTIONS_32`) of a generated emotion phrase, resolved like
    `emotion_class`: ED labels are themselves, free words go through the organisers' alias table."""
    return _first_resolving(word, lambda w: None if (i := emotion_map.fine_index(w)) < 0 else i)


def _first_resolving(phrase: str, resolve) -> int | None:
    idx = resolve(phrase)
    if idx is not None:
        return idx
    for w in words(phrase or ""):
        idx = resolve(w)
        if idx is not None:
            return idx
    return None


def parse_generation(
    text: str, emotion_map: schema.EmotionMap | None = None, *, pipeline_baseline: bool = False
) -> dict[str, Any]:
    """What evaluation reads from one generated text.

    Returns {"coe": the five CoE fields (parse_coe; the Pipeline baseline's fields are mapped onto them),
    "reply", "emotion_word" (CoE step 2), "emotion" (class index or -1), "emotion_fine" (index among the 32
    ED labels or -1), and for the Pipeline baseline "age"/"gender"/"timbre" (index or -1)}.
    """
    emotion_map = emotion_map or schema.EmotionMap.load("avamerg7")
    out: dict[str, Any] = {}
    if pipeline_baseline:
        p = tpl.parse_pipeline_output(text)
        coe = dict.fromkeys(tpl.COE_FIELDS, "")
        coe["speaker_emotion"], coe["response"] = p["emotion"], p["response"]
        if not any(p.values()):  # none of the three lines: the whole text is the reply, as parse_coe does
            coe["response"] = tpl.parse_coe(text)["response"]
        for name, vocab in (("age", schema.AGES), ("gender", schema.GENDERS), ("timbre", schema.TIMBRES)):
            w = schema.normalize_word(p[name])
            out[name] = vocab.index(w) if w in vocab else -1
    else:
        coe = tpl.parse_coe(text)
    word = coe["speaker_emotion"]
    idx = emotion_class(word, emotion_map) if word else None
    fine = emotion_fine_class(word, emotion_map) if word else None
    out.update(coe=coe, reply=coe["response"], emotion_word=word, emotion=-1 if idx is None else int(idx),
               emotion_fine=-1 if fine is None else int(fine))
    return out
