"""Speech metrics on real Kokoro speech: each metric must separate a different voice from the same one."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from empatheia_jax.eval.metrics import speech as sm

SR = 24000
FEMALE = {"age": "young", "gender": "female", "timbre": "mid"}
MALE = {"age": "middle-aged", "gender": "male", "timbre": "mid"}


@pytest.fixture(scope="module")
def wavs():
    """gold: female voice; same_voice: the female voice saying another sentence; other: a male voice saying
    the gold sentence."""
    from empatheia_jax.generators import kokoro
    from empatheia_jax.generators.kokoro_voices import voice

    tts = kokoro.shared(1)
    female = voice(FEMALE, "empathetic").style
    male = voice(MALE, "empathetic").style
    return {
        "gold": tts.speak("Thank you for telling me.", female),
        "same_voice": tts.speak("That sounds really hard.", female),
        "other": tts.speak("Thank you for telling me.", male),
    }


def test_mcd(wavs):
    gold, other = wavs["gold"], wavs["other"]
    assert sm.mcd(gold, gold, SR) == 0.0
    noisy = gold + 1e-3 * np.random.default_rng(0).standard_normal(gold.shape).astype(np.float32)
    near = sm.mcd(gold, noisy, SR)
    far = sm.mcd(gold, other, SR)
    assert 0.0 < near < 2.0
    assert far > 1.0 and far > 3 * near, (near, far)
    assert isinstance(far, float)
    with pytest.raises(ValueError, match="silent"):
        sm.mcd(gold, np.zeros_like(gold), SR)


def test_speaker_similarity(wavs):
    same_voice = sm.speaker_similarity(wavs["gold"], wavs["same_voice"], SR)
    other_voice = sm.speaker_similarity(wavs["gold"], wavs["other"], SR)
    assert sm.speaker_similarity(wavs["gold"], wavs["gold"], SR) == pytest.approx(1.0, abs=1e-5)
    assert same_voice > other_voice + 0.15, (same_voice, other_voice)
    e = sm.embed(wavs["gold"], SR)
    assert e.shape == (256,) and e.dtype == np.float32
    assert np.linalg.norm(e) == pytest.approx(1.0, abs=1e-5)
    assert sm.shared_speaker_encoder() is sm.shared_speaker_encoder()


def test_speaker_encoder_is_quiet():
    """Loading and running the encoder prints nothing and leaks no warning (webrtcvad's pkg_resources one)."""
    code = ("import numpy as np; from empatheia_jax.eval.metrics import speech as sm; "
            "t = np.arange(24000) / 24000; sm.embed(0.3 * np.sin(2 * np.pi * 180 * t), 24000)")
    res = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and res.stderr == "", (res.stdout, res.stderr)


def test_f0_stats(wavs):
    female = sm.f0_stats(wavs["gold"], SR)
    male = sm.f0_stats(wavs["other"], SR)
    assert 150 < female["f0_median_hz"] < 400 and 60 < male["f0_median_hz"] < 160, (female, male)
    assert sm.semitones(female["f0_median_hz"], male["f0_median_hz"]) > 7  # more than a fifth apart
    assert 0.05 < female["log_f0_std"] < 0.4 and 0.3 < female["voiced_fraction"] < 1


def test_f0_stats_tone_with_silence():
    """A 220 Hz tone between silences: exact pitch, no spread, and the RMS gate drops the silent half."""
    t = np.arange(SR) / SR
    x = np.concatenate([np.zeros(SR // 2), 0.5 * np.sin(2 * np.pi * 220 * t), np.zeros(SR // 2)])
    stats = sm.f0_stats(x, SR)
    assert stats["f0_median_hz"] == pytest.approx(220, rel=0.01)
    assert stats["log_f0_std"] < 0.01
    assert 0.45 < stats["voiced_fraction"] < 0.6


def _clusters(rng, n_per_class):
    """Gender separable on dimension 0 (scale 1); dimensions 1-3 are nuisance with a scale 100x larger, which
    swamp an unstandardised distance; emotion is the same for every row."""
    genders = np.array(["female", "male"] * n_per_class)
    x = rng.standard_normal((2 * n_per_class, 4)) * np.array([0.1, 100.0, 100.0, 100.0])
    x[:, 0] += np.where(genders == "female", 1.0, -1.0)
    return x, {"gender": list(genders), "emotion": ["empathetic"] * len(genders)}


def test_style_classifier_separable_and_single_class():
    rng = np.random.default_rng(0)
    x_train, y_train = _clusters(rng, 200)
    x_test, y_test = _clusters(rng, 100)
    clf = sm.StyleClassifier().fit(x_train, y_train)
    assert clf.accuracy(x_test, y_test) == {"gender": 1.0, "emotion": 1.0}
    assert clf.predict(x_test[:2])["gender"] == y_test["gender"][:2]
    assert clf.single_class == frozenset({"emotion"})
    report = clf.report(x_test, y_test)
    assert report["emotion"]["single_class"] and not report["gender"]["single_class"]
    assert report["gender"] == {"accuracy": 1.0, "majority": 0.5, "n": 200, "n_classes": 2,
                                "single_class": False}
    json.dumps(report)
    # unlabelled rows are ignored, a label never seen in training is simply wrong
    y_partial = {"gender": [None, "male", "child"]}
    assert clf.accuracy(x_test[:3], y_partial)["gender"] == 0.5
    with pytest.raises(ValueError, match="entries"):
        clf.accuracy(x_test, {"gender": ["male"]})


def test_style_classifier_shuffled_labels_near_chance():
    rng = np.random.default_rng(1)
    x_train, y_train = _clusters(rng, 200)
    x_test, y_test = _clusters(rng, 200)
    for y in (y_train, y_test):
        y["gender"] = list(rng.permutation(y["gender"]))
    acc = sm.StyleClassifier().fit(x_train, y_train).accuracy(x_test, y_test)["gender"]
    assert 0.4 < acc < 0.6, acc


def test_speech_rows(wavs):
    gold = [wavs["gold"], wavs["other"]]
    rows = sm.speech_rows({"same": gold, "other": [wavs["other"], wavs["gold"]]}, gold, SR, progress=False)
    json.dumps(rows)
    same, other = rows["same"], rows["other"]
    assert same["mcd"] == 0.0 and same["f0_semitones"] == 0.0 and same["duration_ratio"] == 1.0
    assert same["speaker_similarity"] == pytest.approx(1.0, abs=1e-5)
    assert other["mcd"] > 1.0
    assert other["speaker_similarity"] < same["speaker_similarity"] - 0.15
    assert other["f0_semitones"] > 7
    assert same["n"] == other["n"] == 2.0 and other["f0_pairs"] == 2.0
    assert all(isinstance(v, float) for row in rows.values() for v in row.values())
    with pytest.raises(ValueError, match="1 wavs for 2 gold"):
        sm.speech_rows({"short": gold[:1]}, gold, SR, progress=False)
    assert not math.isnan(other["duration_ratio"])
