"""`serve.decoding.Decoding`, the one decoding value of chat, serve, eval and the CLI: a bad value is refused
by name; the command line's flags give the value a caller would write (its defaults are the library's); the
eval journal's settings read from it are the bytes they were before `Decoding` existed (a killed eval still
resumes); and `chat.respond` with the old defaults decodes exactly as it did (the decode receives the same
arguments, and the reply is the one those arguments give).

The respond check uses the tiny random Empatheia of tests/test_chat.py (2 layers, d=32, lite-encoder
shards).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from helpers import FAST, load_smollm2_tokenizer, make_tiny_shards, tiny_empatheia

from empatheia_jax.eval import generation_pass as gp
from empatheia_jax.eval.journal import fingerprint
from empatheia_jax.serve import chat
from empatheia_jax.serve.decoding import Decoding, ReplySampling


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"max_new_tokens": 2.5}, "max_new_tokens=2.5"),
    ({"max_new_tokens": True}, "max_new_tokens=True"),
    ({"temperature": -0.1}, "temperature=-0.1"),
    ({"temperature": math.nan}, "temperature=nan"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"seed": 1.5}, "seed=1.5"),
    ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size=-1"),
    ({"reply_sampling": {"temperature": 0.7}}, "reply_sampling="),
])
def test_a_bad_value_is_refused_naming_its_field(kwargs, field):
    with pytest.raises(ValueError, match="decoding: " + field.replace(".", r"\.")):
        Decoding(**kwargs)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": 0.0}, "temperature=0.0"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"seed": "3"}, "seed='3'"),
    ({"candidates": 0}, "candidates=0"),
])
def test_a_bad_reply_sampling_is_refused_naming_its_field(kwargs, field):
    with pytest.raises(ValueError, match="reply sampling: " + field):
        ReplySampling(**kwargs)


def test_decoding_is_a_frozen_value():
    d = Decoding(max_new_tokens=12, reply_sampling=ReplySampling(temperature=0.7))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.max_new_tokens = 5  # type: ignore[misc]
    assert d == Decoding(max_new_tokens=12, reply_sampling=ReplySampling(temperature=0.7))
    assert hash(d) == hash(Decoding(max_new_tokens=12, reply_sampling=ReplySampling(temperature=0.7)))
    assert Decoding().greedy and not Decoding(temperature=0.5).greedy


def _from_flags(*argv: str) -> Decoding:
    """`cli._decoding_from_flags` after parsing `argv`; the flags are left as they were."""
    from absl.testing import flagsaver

    from empatheia_jax import cli

    was_parsed = cli.FLAGS.is_parsed()
    try:
        with flagsaver.flagsaver():
            cli.FLAGS(["empatheia", *argv])
            return cli._decoding_from_flags()
    finally:
        if not was_parsed:
            cli.FLAGS.unparse_flags()


def test_the_flags_give_the_decoding_a_caller_would_write():
    """No flag: the library's defaults (one set of defaults: the flags' equal `Decoding()`'s). Every flag:
    the value spelt out by hand; --reply_temperature 0 keeps the greedy reply whatever the other --reply_*."""
    assert _from_flags() == Decoding()
    assert _from_flags("--reply_top_p=0.5", "--reply_candidates=4", "--seed=9") == Decoding()
    got = _from_flags("--max_new_tokens=12", "--repetition_penalty=1.2", "--no_repeat_ngram_size=4",
                      "--reply_temperature=0.7", "--reply_top_p=0.9", "--reply_candidates=3", "--seed=5")
    assert got == Decoding(max_new_tokens=12, repetition_penalty=1.2, no_repeat_ngram_size=4,
                           reply_sampling=ReplySampling(temperature=0.7, top_p=0.9, seed=5, candidates=3))
    # what `eval --json` records of it, as before
    assert dataclasses.asdict(got.reply_sampling) == {"temperature": 0.7, "top_p": 0.9, "seed": 5,
                                                      "candidates": 3}


# The decoding part of the journal's settings as `generate_predictions` wrote it before `Decoding`:
#   max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty,
#   no_repeat_ngram_size=no_repeat_ngram_size, reply_sampling=reply_sampling and asdict(reply_sampling)
# serialised as `journal.fingerprint` serialises settings (sorted keys).
_JOURNAL_BYTES = [
    (Decoding(),
     '{"max_new_tokens": 160, "no_repeat_ngram_size": 0, "repetition_penalty": 1.0, "reply_sampling": null}'),
    (Decoding(max_new_tokens=12, no_repeat_ngram_size=4,
              reply_sampling=ReplySampling(temperature=1.5, top_p=1.0, seed=3, candidates=2)),
     '{"max_new_tokens": 12, "no_repeat_ngram_size": 4, "repetition_penalty": 1.0, "reply_sampling": '
     '{"candidates": 2, "seed": 3, "temperature": 1.5, "top_p": 1.0}}'),
]


@pytest.mark.parametrize(("decoding", "want"), _JOURNAL_BYTES)
def test_the_journal_settings_of_a_decoding_are_the_bytes_they_were(decoding, want):
    got = gp.journal_decoding(decoding)
    assert json.dumps(got, sort_keys=True, default=str) == want
    old = dict(max_new_tokens=decoding.max_new_tokens, repetition_penalty=decoding.repetition_penalty,
               no_repeat_ngram_size=decoding.no_repeat_ngram_size,
               reply_sampling=decoding.reply_sampling and dataclasses.asdict(decoding.reply_sampling))
    assert fingerprint([], {"split": "test", **got}) == fingerprint([], {"split": "test", **old})


def test_the_eval_decodes_greedily_or_refuses():
    with pytest.raises(ValueError, match="temperature=0.7 must be 0"):
        gp.generate_predictions(None, None, "nowhere", decoding=Decoding(temperature=0.7))


# --- on the tiny model --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_tiny_shards(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_smollm2_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def model(tok, shards):
    return tiny_empatheia(tok, shards)


def test_generate_predictions_keys_its_journal_as_before(model, tok, shards, tmp_path, monkeypatch):
    """The whole settings dict `generate_predictions` fingerprints its journal with has the keys and values
    of the one it built from its keyword arguments before `Decoding` (the batches themselves stubbed)."""
    from pathlib import Path

    seen = []
    real = gp._journal_of
    monkeypatch.setattr(gp, "_journal_of", lambda *a: seen.append(a[3]) or real(*a))
    def no_batch(model, tok, chunk, *a, **k):
        return {e["record_index"]: {"record_index": e["record_index"]} for e in chunk}

    monkeypatch.setattr(gp, "_predict_batch", no_batch)
    sampling = ReplySampling(temperature=1.5, top_p=1.0, seed=3, candidates=2)
    decoding = Decoding(max_new_tokens=12, no_repeat_ngram_size=4, reply_sampling=sampling)
    gp.generate_predictions(model, tok, shards, "test", batch_size=2, max_len=200, progress=False,
                            decoding=decoding, journal=tmp_path / "j.jsonl")
    (settings,) = seen
    manifest = json.loads((Path(shards) / "manifest.json").read_text())
    old = dict(shards=str(Path(shards).resolve()), split="test", manifest=manifest, template="overall",
               batch_size=2, max_len=200, max_new_tokens=12, repetition_penalty=1.0, no_repeat_ngram_size=4,
               pipeline_overrides=None, max_examples=None, score_emotions=False,
               reply_sampling=dataclasses.asdict(sampling))
    assert json.dumps(settings, sort_keys=True, default=str) == json.dumps(old, sort_keys=True, default=str)


@pytest.mark.usefixtures("exact_matmuls")
def test_respond_with_the_old_defaults_decodes_as_before(model, tok, shards, monkeypatch):
    """`respond()` (the default `Decoding`) and `respond(decoding=Decoding(<the old keyword defaults>))` give
    one reply, decoded by one call with exactly the arguments the old keywords passed (160 new tokens,
    greedy, top_p 1, seed 0, no repetition control), and the reply is that call's tokens."""
    media = shards.parent / "raw" / "media"
    calls = []
    real = chat.generate_tokens

    def recorded(llm, prompts, max_new_tokens, temperature, top_p, **kw):
        gen = real(llm, prompts, max_new_tokens, temperature, top_p, **kw)
        calls.append(((max_new_tokens, temperature, top_p),
                      {k: kw[k] for k in ("seed", "repetition_penalty", "no_repeat_ngram_size")},
                      gen.new_tokens[0, : gen.num_new[0]].tolist()))
        return gen

    monkeypatch.setattr(chat, "generate_tokens", recorded)
    ask = dict(text="test1 line 2: I feel disgusted", audio=media / "diatest1utt2_7.wav",
               video=media / "diatest1utt2_7.mp4", encoder="lite", compiler_options=FAST)
    default = chat.respond(model, tok, **ask)
    spelt = chat.respond(model, tok, **ask, decoding=Decoding(
        max_new_tokens=160, temperature=0.0, top_p=1.0, seed=0, repetition_penalty=1.0,
        no_repeat_ngram_size=0, reply_sampling=None))
    assert default.text == spelt.text and np.array_equal(default.input_ids, spelt.input_ids)
    for k in default.features:
        np.testing.assert_array_equal(default.features[k], spelt.features[k])
    old = ((160, 0.0, 1.0), {"seed": 0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0})
    assert [c[:2] for c in calls] == [old, old]
    new = calls[0][2]
    assert default.text == tok.decode(new, skip_special_tokens=False, clean_up_tokenization_spaces=False)
