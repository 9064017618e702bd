"""Input encoders: registry, the lite extractor's determinism and signal, HuBERT/CLIP against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
from helpers import require

from empatheia_jax.data.encoders import available_encoders, get_encoder
from empatheia_jax.data.encoders.dsp import frame_signal, mel_filterbank, stft_power, yin
from empatheia_jax.data.encoders.lite import AUDIO_SCALAR_NAMES, VIDEO_SCALAR_NAMES, LiteEncoder

SR = 16000


def tone(f0: float, seconds: float = 1.0, sr: int = SR, amp: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    env = 0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)  # syllable-like loudness modulation
    x = amp * env * (np.sin(2 * np.pi * f0 * t) + 0.4 * np.sin(2 * np.pi * 2 * f0 * t + 0.3))
    return x.astype(np.float32)


def write_mp4(path, frames: np.ndarray, fps: int = 25) -> None:
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        s.options = {"crf": "10"}
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def face_frames(n: int, size: int = 32, talking: bool = True, skin=(200, 160, 130)) -> np.ndarray:
    """A face-like pattern: skin disc, dark eyes, a mouth whose opening oscillates when talking."""
    yy, xx = np.mgrid[:size, :size] / size
    frames = np.zeros((n, size, size, 3), np.uint8)
    for i in range(n):
        img = np.full((size, size, 3), 40, np.uint8)
        img[(yy - 0.5) ** 2 + (xx - 0.5) ** 2 < 0.16] = skin
        img[(np.abs(yy - 0.4) < 0.05) & (np.abs(np.abs(xx - 0.5) - 0.15) < 0.06)] = 20
        opening = 0.02 + (0.08 * (1 + np.sin(i * 1.3)) if talking else 0.0)
        img[(np.abs(yy - 0.68) < opening) & (np.abs(xx - 0.5) < 0.14)] = 10
        frames[i] = img
    return frames


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    sf.write(d / "low.wav", tone(110.0), SR)
    sf.write(d / "high.wav", tone(260.0), SR)
    sf.write(d / "high22k.wav", tone(260.0, sr=22050), 22050)
    write_mp4(d / "talk.mp4", face_frames(20, talking=True))
    write_mp4(d / "still.mp4", face_frames(20, talking=False))
    return d


def test_registry_and_names():
    names = available_encoders()
    assert {"lite (audio+video)", "hubert (audio)", "clip (video)"} <= set(names)
    with pytest.raises(KeyError, match="unknown encoder 'nope'"):
        get_encoder("nope")
    with pytest.raises(ValueError, match="only encodes audio"):
        get_encoder("hubert", hubert_path="/x")
    with pytest.raises(ValueError, match="has no audio encoder"):
        get_encoder("clip+lite")
    with pytest.raises(TypeError, match="unknown argument"):
        get_encoder("lite", n_melz=40)
    e = get_encoder("lite", k=2)
    assert (e.name, e.k, e.audio_dim, e.video_dim) == (
        "lite",
        2,
        2 * 40 + len(AUDIO_SCALAR_NAMES),
        2 * 259 + 8,
    )
    assert e.config()["k"] == 2 and e.config()["name"] == "lite"


def test_lite_deterministic_shapes_and_chunks(media):
    e1, e2 = LiteEncoder(), LiteEncoder()
    a1, a2 = e1.encode_audio(media / "low.wav"), e2.encode_audio(media / "low.wav")
    v1, v2 = e1.encode_video(media / "talk.mp4"), e2.encode_video(media / "talk.mp4")
    assert a1.dtype == np.float32 and a1.shape == (1, e1.audio_dim) and np.isfinite(a1).all()
    assert v1.dtype == np.float32 and v1.shape == (1, e1.video_dim) and np.isfinite(v1).all()
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(v1, v2)
    # (samples, sr) input is the same as reading the file
    x, _ = sf.read(media / "low.wav", dtype="float32")
    np.testing.assert_array_equal(e1.encode_audio((x, SR)), a1)
    k3 = LiteEncoder(k=3)
    a3, v3 = k3.encode_audio(media / "low.wav"), k3.encode_video(media / "talk.mp4")
    assert a3.shape == (3, e1.audio_dim) and v3.shape == (3, e1.video_dim)
    assert not np.allclose(a3[0], a3[1])  # chunks see different parts of the utterance


def test_lite_audio_carries_pitch(media):
    e = LiteEncoder()
    i = 2 * e.n_mels + AUDIO_SCALAR_NAMES.index("f0_p50")
    low, high = e.encode_audio(media / "low.wav")[0], e.encode_audio(media / "high.wav")[0]
    # median pitch in octaves relative to 150 Hz, exact to a few cents
    assert low[i] == pytest.approx(np.log2(110 / 150), abs=0.01)
    assert high[i] == pytest.approx(np.log2(260 / 150), abs=0.01)
    assert high[i] > low[i] + 1.0
    voiced = 2 * e.n_mels + AUDIO_SCALAR_NAMES.index("voiced_frac")
    assert low[voiced] > 0.9
    # another sample rate is resampled to the same features (up to resampling error)
    h22 = e.encode_audio(media / "high22k.wav")[0]
    assert h22[i] == pytest.approx(high[i], abs=0.01)


def test_lite_video_carries_mouth_motion_and_colour(media, tmp_path):
    e = LiteEncoder()
    base = 2 * (e.grid * e.grid + 3)
    mm = base + VIDEO_SCALAR_NAMES.index("mouth_motion_mean")
    talk, still = e.encode_video(media / "talk.mp4")[0], e.encode_video(media / "still.mp4")[0]
    assert talk[mm] > 5 * max(still[mm], 1e-3)
    # a redder face raises mean Cr (index 2 of the colour block)
    write_mp4(tmp_path / "red.mp4", face_frames(10, talking=False, skin=(240, 110, 100)))
    red = e.encode_video(tmp_path / "red.mp4")[0]
    cr = 2 * e.grid * e.grid + 2
    assert red[cr] > still[cr] + 0.02
    # frames given as an array match the decoded mp4 closely (h264 at crf 10 is near-lossless)
    arr = e.encode_video(face_frames(20, talking=False))[0]
    np.testing.assert_allclose(arr[: e.grid * e.grid], still[: e.grid * e.grid], atol=0.03)


# ----------------------------------------------------------------------------------------------
# the numpy DSP against librosa (the lite encoder and the stand-in targets use these, not librosa: see
# the docstring of `encoders.dsp`; these tests are what makes them librosa's definitions)


@pytest.fixture(scope="module")
def librosa():
    return require("librosa", "the reference for the lite encoder's DSP")


def dsp_signals() -> dict[str, np.ndarray]:
    """Pitched (steady, gliding, harmonic-rich, onset after silence) and unpitched signals, float64."""
    rng = np.random.default_rng(0)
    t = np.arange(SR) / SR
    return {
        "tone": tone(110.0).astype(np.float64),
        "high tone": tone(260.0, seconds=0.5).astype(np.float64),
        "glide": 0.3 * np.sin(2 * np.pi * (120 * t + 100 * t**2)),
        "vowel": sum(0.3 / k * np.sin(2 * np.pi * 150 * k * t[:8000] + k) for k in range(1, 8)),
        "silence then tone": np.concatenate([np.zeros(3000), 0.3 * np.sin(2 * np.pi * 110 * t[:5000])]),
        "noise": 0.1 * rng.standard_normal(8000),
    }


@pytest.mark.parametrize(
    "sr,n_fft,n_mels,fmin,fmax",
    [(16000, 512, 40, 50.0, 8000.0), (16000, 1280, 40, 50.0, 8000.0), (22050, 1024, 80, 0.0, 8000.0)],
    ids=["lite", "standin-targets", "other"],
)
def test_mel_filterbank_is_librosas(librosa, sr, n_fft, n_mels, fmin, fmax):
    ours = mel_filterbank(sr, n_fft, n_mels, fmin, fmax)
    ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)  # slaney, float32
    assert ours.dtype == ref.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7 * np.abs(ref).max())


@pytest.mark.parametrize("n_fft,hop", [(512, 160), (1280, 640)], ids=["lite", "standin-targets"])
def test_stft_power_is_librosas(librosa, n_fft, hop):
    for name, y in dsp_signals().items():
        ours = stft_power(frame_signal(y, n_fft, hop))
        # librosa >= 0.11 pads centred frames with zeros (pad_mode="constant"), as frame_signal does
        ref = np.abs(librosa.stft(y, n_fft=n_fft, hop_length=hop, window="hann", center=True)).T ** 2
        assert ours.shape == ref.shape, name
        # our Hann window is float32 (the lite audio is): 1e-7 relative rounding, amplified in spectral nulls
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7 * ref.max(), err_msg=name)


def test_yin_is_librosas(librosa):
    e = LiteEncoder()
    frame_length = 2 * int(np.ceil(SR / e.fmin)) + 2
    for name, y in dsp_signals().items():
        f0, aperiodicity = yin(y, SR, e.fmin, e.fmax, e.hop)
        ref = librosa.yin(y, fmin=e.fmin, fmax=e.fmax, sr=SR, frame_length=frame_length, hop_length=e.hop,
                          trough_threshold=0.1, center=True, pad_mode="constant")
        assert f0.shape == ref.shape, name
        np.testing.assert_allclose(f0, ref, rtol=1e-6, err_msg=name)
        assert ((aperiodicity >= 0) & (aperiodicity <= 2.5)).all(), name
    # ... the pitch is right where there is one, and the aperiodicity separates it from noise at the lite
    # encoder's voicing threshold (0.35)
    f0, aperiodicity = yin(dsp_signals()["tone"], SR, e.fmin, e.fmax, e.hop)
    voiced = aperiodicity < 0.35
    cents = 1200 * np.abs(np.log2(f0[voiced] / 110.0))
    assert voiced.mean() > 0.95 and np.median(cents) < 15 and cents.max() < 40  # 8.5 and 30 cents here
    assert (yin(dsp_signals()["noise"], SR, e.fmin, e.fmax, e.hop)[1] > 0.5).all()


def test_lite_log_mel_is_librosas(librosa, media):
    """End to end: the lite audio tracks equal the same definitions computed by librosa."""
    e = LiteEncoder()
    y, _ = sf.read(media / "low.wav", dtype="float32")
    tracks = e.audio_frames((y, SR))
    power = np.abs(librosa.stft(y, n_fft=e.n_fft, hop_length=e.hop, window="hann", center=True)) ** 2
    mel = librosa.filters.mel(sr=SR, n_fft=e.n_fft, n_mels=e.n_mels, fmin=50.0, fmax=SR / 2) @ power
    np.testing.assert_allclose(tracks["logmel"], ((np.log(1e-5 + mel) + 4.0) / 4.0).T, atol=2e-5)
    frame_length = 2 * int(np.ceil(SR / e.fmin)) + 2
    ref_f0 = librosa.yin(y.astype(np.float64), fmin=e.fmin, fmax=e.fmax, sr=SR, frame_length=frame_length,
                         hop_length=e.hop, center=True, pad_mode="constant")
    np.testing.assert_allclose(tracks["f0"], ref_f0, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# transformers encoders against a direct forward pass


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    torch = require("torch", "the transformers encoders' reference forward pass")
    from transformers import CLIPVisionConfig, CLIPVisionModel, HubertConfig, HubertModel

    d = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    hcfg = HubertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )
    HubertModel(hcfg).eval().save_pretrained(d / "hubert")
    ccfg = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    CLIPVisionModel(ccfg).eval().save_pretrained(d / "clip")
    return d


def test_hubert_matches_transformers(tiny_models, media):
    import torch
    from transformers import HubertModel

    enc = get_encoder("hubert+lite", hubert_path=tiny_models / "hubert", k=2)
    assert enc.audio_dim == 32 and enc.video_dim == LiteEncoder().video_dim and enc.k == 2
    got = enc.encode_audio(media / "high.wav")
    model = HubertModel.from_pretrained(tiny_models / "hubert").eval()
    x, _ = sf.read(media / "high.wav", dtype="float32")
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)  # Wav2Vec2FeatureExtractor do_normalize
    with torch.no_grad():
        h = model(torch.from_numpy(x[None])).last_hidden_state[0].numpy()
    half = len(h) // 2
    want = np.stack([h[:half].mean(0), h[half:].mean(0)])
    assert got.shape == (2, 32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert enc.config()["audio"]["name"] == "hubert" and enc.config()["video"]["name"] == "lite"


def test_clip_matches_transformers(tiny_models, media):
    import av
    import torch
    from transformers import CLIPVisionModel

    enc = get_encoder(
        "hubert+clip", hubert_path=tiny_models / "hubert", clip_path=tiny_models / "clip", clip_frames=4
    )
    got = enc.encode_video(media / "talk.mp4")
    with av.open(str(media / "talk.mp4")) as c:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    idx = [int((i + 0.5) * len(frames) / 4) for i in range(4)]
    mean = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
    std = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
    pix = ((frames[idx].astype(np.float32) / 255.0 - mean) / std).transpose(0, 3, 1, 2)
    model = CLIPVisionModel.from_pretrained(tiny_models / "clip").eval()
    with torch.no_grad():
        want = model(pixel_values=torch.from_numpy(pix)).pooler_output.numpy().mean(0, keepdims=True)
    assert got.shape == (1, 32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_transformers_encoders_refuse_missing_weights(tmp_path):
    with pytest.raises(ValueError, match="hubert_path"):
        get_encoder("hubert+lite")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        get_encoder("hubert+lite", hubert_path=tmp_path)
