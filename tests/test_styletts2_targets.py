"""converters/styletts2_targets.py: speech targets from Kokoro (real, embedded) and from StyleTTS2 (the
model-running code with stand-in torch modules, the loader with a fake checkout), and the CLI's errors.

The RAW folder is written here (two dialogues, 16 kHz wavs with silent edges), so the tests do not depend
on the sample builder; the StyleTTS2 reference mel is computed independently with a plain numpy STFT.
"""

from __future__ import annotations

import json
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from converters import styletts2_targets as st
from empatheia_jax.data.schema import EmotionMap, dialogue_utterances, load_dialogues, response_utterance_id
from empatheia_jax.data.targets import TargetReader
from empatheia_jax.generators import kokoro, kokoro_voices

_DIALOGUES = [
    {
        "conversation_id": "a1",
        "speaker_profile": {"age": "young", "gender": "female", "timbre": "mid", "ID": 3},
        "listener_profile": {"age": "middle-aged", "gender": "male", "timbre": "low", "ID": 8},
        "topic": "work",
        "turns": [
            {"context": "joyful", "response": "That is great news, congratulations!",
             "dialogue_history": [{"index": 0, "role": "speaker", "utterance": "I got the job I wanted!"}],
             "chain_of_empathy": {"speaker_emotion": "joyful"}},
            {"context": "joyful", "response": "You earned it.",
             "dialogue_history": [
                 {"index": 0, "role": "speaker", "utterance": "I got the job I wanted!"},
                 {"index": 1, "role": "listener", "utterance": "That is great news, congratulations!"},
                 {"index": 2, "role": "speaker", "utterance": "Thanks; I start on Monday."}],
             "chain_of_empathy": {"speaker_emotion": "joyful"}},
        ],
    },
    {
        "conversation_id": "b2",
        "speaker_profile": {"age": "elderly", "gender": "male", "timbre": "high", "ID": 5},
        "listener_profile": {"age": "child", "gender": "female", "timbre": "mid", "ID": 6},
        "topic": "home",
        "turns": [
            {"context": "?", "response": "Was anyone there?",
             "dialogue_history": [{"index": 0, "role": "speaker", "utterance": "I heard noises downstairs."}],
             "chain_of_empathy": {"speaker_emotion": "zzz-not-an-emotion"}},
        ],
    },
]


def _write_wav(path: Path, seed: int, sr: int = 16000) -> None:
    """Two voiced-like tones with noise between 0.25 s silences: trimming and resampling both matter."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(1.3 * sr)) / sr
    f0 = 120 + 40 * seed % 200
    body = 0.3 * np.sin(2 * np.pi * f0 * t) + 0.1 * np.sin(2 * np.pi * 3.1 * f0 * t)
    body = body * np.hanning(len(t)) + 0.02 * rng.standard_normal(len(t))
    x = np.concatenate([np.zeros(sr // 4), body, np.zeros(sr // 4)])
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes((np.clip(x, -1, 1) * 32000).astype("<i2").tobytes())


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("raw")
    (root / "media").mkdir()
    (root / "train.json").write_text(json.dumps(_DIALOGUES[:1]), encoding="utf-8")
    (root / "test.json").write_text(json.dumps(_DIALOGUES[1:]), encoding="utf-8")
    for i, uid in enumerate(uid for _, _, uid, _, _ in _utterances(root)):
        _write_wav(root / "media" / f"{uid}.wav", i)
    return root


def _utterances(root: Path) -> list[tuple[str, dict, str, str, str | None]]:
    """(role, profile, uid, text, emotion class) of every distinct utterance, from the schema directly."""
    emap = EmotionMap.load("avamerg7")
    out = []
    for split in ("train", "test"):
        for d in load_dialogues(root / f"{split}.json"):
            emotion = emap.class_name(d.turns[0].chain_of_empathy.speaker_emotion)
            for uid, role, text in dialogue_utterances(d):
                out.append((role, d.profile_of(role).to_json(), uid, text, emotion))
    return out


def _read_all(out: Path) -> dict[str, dict[str, np.ndarray]]:
    r = TargetReader(out)
    return {k: {uid: r.get(k, uid) for uid in r.keys(k)} for k in st.KINDS}


# ---------------------------------------------------------------------------------------------------------
# Kokoro


@pytest.fixture(scope="module")
def kokoro_out(raw, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("targets_kokoro")
    counts = st.export_speech_targets(raw, out, progress=False)
    assert counts == {"speech_content": 6, "speech_style": 6}
    return out


def test_kokoro_targets_are_kokoro_features(raw, kokoro_out):
    utts = _utterances(raw)
    assert len(utts) == 6
    assert {e for *_, e in utts} == {"happy", None}  # "joyful" -> happy; an unknown word -> None
    got = _read_all(kokoro_out)
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(u[2] for u in utts) for k in st.KINDS}
    model = kokoro.shared(1)
    for role, profile, uid, text, emotion in utts:
        ph = kokoro.phonemize(text)
        content = got["speech_content"][uid]
        assert content.shape == (kokoro.content_length(ph), 1024)
        np.testing.assert_array_equal(content, model.content_features(ph))
        style = kokoro_voices.voice(profile, kokoro_voices.utterance_style(role, emotion)).style
        np.testing.assert_array_equal(got["speech_style"][uid], style)
    # speakers in their dialogue's emotion (neutral when unknown); the listener mirrors joy and answers an
    # unknown emotion in the calm style
    styles = {(role, e): kokoro_voices.utterance_style(role, e) for role, _, _, _, e in utts}
    assert styles == {("speaker", "happy"): "happy", ("speaker", None): "neutral",
                      ("listener", "happy"): "happy", ("listener", None): "empathetic"}
    meta = json.loads((kokoro_out / "meta.json").read_text())
    for kind in st.KINDS:
        assert meta[kind]["source"] == "kokoro" and meta[kind]["count"] == 6
        assert meta[kind]["model_sha256"] == kokoro.MODEL_SHA256
        assert meta[kind]["voice_map_version"] == kokoro_voices.MAP_VERSION
        assert meta[kind]["cut_version"] == kokoro.CUT_VERSION
    assert "boundary pad rows" in meta["speech_content"]["layout"]
    assert "espeak-ng en-us" in meta["speech_content"]["phonemizer"]
    assert TargetReader(kokoro_out).verify() == []


def test_kokoro_workers_give_identical_targets(raw, kokoro_out, tmp_path):
    counts = st.export_speech_targets(raw, tmp_path, workers=2, shard_size=3, progress=False)
    assert counts == {"speech_content": 6, "speech_style": 6}
    a, b = _read_all(kokoro_out), _read_all(tmp_path)
    for kind in st.KINDS:
        assert sorted(a[kind]) == sorted(b[kind])
        for uid in a[kind]:
            np.testing.assert_array_equal(a[kind][uid], b[kind][uid])
    assert len(json.loads((tmp_path / "meta.json").read_text())["speech_content"]["files"]) == 2


def test_kokoro_splits_and_dialogues_select_utterances(raw, tmp_path):
    counts = st.export_speech_targets(raw, tmp_path / "a", splits=["test"], progress=False)
    assert counts == {"speech_content": 2, "speech_style": 2}
    one = load_dialogues(raw / "train.json")
    counts = st.export_speech_targets(raw, tmp_path / "b", dialogues=one, progress=False)
    assert counts == {"speech_content": 4, "speech_style": 4}
    # only the turns' responses, read from the text alone: no media folder at all
    text_only = tmp_path / "text_only"
    text_only.mkdir()
    (text_only / "train.json").write_text((raw / "train.json").read_text())
    responses = sorted({response_utterance_id(d, j) for d in one for j in range(len(d.turns))})
    counts = st.export_speech_targets(text_only, tmp_path / "c", progress=False, responses_only=True)
    assert counts == {"speech_content": len(responses), "speech_style": len(responses)} and responses
    assert sorted(TargetReader(tmp_path / "c").keys("speech_content")) == responses


def test_utterance_errors_are_collected_and_nothing_is_written(raw, tmp_path):
    bad = json.loads((raw / "test.json").read_text())
    bad[0]["turns"][0]["response"] = "  "  # no phonemes
    bad[0]["listener_profile"]["ID"] = 77  # so the empty response is a new utterance id
    (tmp_path / "media").mkdir()
    (tmp_path / "test.json").write_text(json.dumps(bad))
    with pytest.raises(st.TargetExportError, match=r"1 of 2 utterance\(s\) failed.*\n.*b2utt1_77"):
        st.export_speech_targets(tmp_path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "meta.json").exists()
    assert not list((tmp_path / "out").glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------------------
# StyleTTS2 with stand-in modules


def _reference_mel(path: Path) -> np.ndarray:
    """StyleTTS2's normalised log-mel, independently: numpy STFT (periodic Hann 1200 centred in 2048,
    reflect-padded, hop 300, power 2) and torchaudio's default 16 kHz htk filterbank without norm."""
    import librosa

    y, _ = librosa.load(str(path), sr=24000)
    y, _ = librosa.effects.trim(y, top_db=30)
    y = y.astype(np.float64)
    n_fft, hop, win = 2048, 300, 1200
    window = np.zeros(n_fft)
    window[(n_fft - win) // 2:(n_fft - win) // 2 + win] = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win) / win)
    padded = np.pad(y, n_fft // 2, mode="reflect")
    frames = 1 + len(y) // hop
    stack = np.stack([padded[i * hop:i * hop + n_fft] for i in range(frames)])
    power = np.abs(np.fft.rfft(stack * window, axis=1)) ** 2  # [frames, 1025]
    fb = librosa.filters.mel(sr=16000, n_fft=n_fft, n_mels=80, fmin=0.0, fmax=8000.0, htk=True, norm=None)
    return ((np.log(1e-5 + fb @ power.T) + 4.0) / 4.0).astype(np.float32)


class _TextEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(200, 512)
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, x, input_lengths, m):
        self.calls.append((x.clone(), input_lengths.clone(), m.clone()))
        h = self.embedding(x).transpose(1, 2)  # [B, 512, T]
        return h.masked_fill(m.unsqueeze(1), 0.0)


class _Bert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(200, 768)
        self.masks: list[torch.Tensor] = []

    def forward(self, tokens, attention_mask=None):
        self.masks.append(attention_mask.clone())
        return torch.tanh(self.embedding(tokens).cumsum(1))  # [B, T, 768], position-dependent


class _StyleEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(160, 128)
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []

    def forward(self, x):
        assert x.ndim == 4 and x.shape[:3] == (1, 1, 80)
        self.inputs.append(x.clone())
        out = self.proj(torch.cat([x.mean(-1), x.std(-1)], -1).flatten(1))  # [B, 128]
        self.outputs.append(out.clone())
        return out


def _cleaner(text: str) -> list[int]:
    return [1 + ord(c) % 199 for c in text]


def _standin_parts() -> st.StyleTTS2Parts:
    torch.manual_seed(0)
    return st.StyleTTS2Parts(
        text_encoder=_TextEncoder().eval(), bert=_Bert().eval(),
        bert_encoder=torch.nn.Linear(768, 512).eval(), style_encoder=_StyleEncoder().eval(),
        predictor_encoder=_StyleEncoder().eval(), text_cleaner=_cleaner,
        word_tokenize=lambda s: s.replace(",", " , ").split(), meta={"checkpoint": "stand-in"},
    )


def test_styletts2_targets_with_standin_modules(raw, tmp_path):
    parts = _standin_parts()
    counts = st.export_speech_targets(raw, tmp_path, backend="styletts2", styletts2_parts=parts,
                                      workers=2, progress=False)
    assert counts == {"speech_content": 6, "speech_style": 6}
    got = _read_all(tmp_path)
    utts = _utterances(raw)
    assert len(parts.text_encoder.calls) == len(parts.style_encoder.inputs) == 6  # one call each, job order
    for i, (_, _, uid, text, _) in enumerate(utts):
        phonemes = st.styletts2_phonemes(text, parts.word_tokenize)
        assert phonemes == " ".join(phonemes.split()) and phonemes  # espeak output re-joined by single spaces
        ids = _cleaner(phonemes)
        tokens, lengths, mask = parts.text_encoder.calls[i]
        assert tokens.tolist() == [[0, *ids]]  # one leading pad token, no trailing one
        assert lengths.tolist() == [len(ids) + 1] and not mask.any() and mask.shape == (1, len(ids) + 1)
        attention = parts.bert.masks[i]
        assert attention.dtype == torch.int32 and attention.tolist() == [[1] * (len(ids) + 1)]
        with torch.no_grad():
            t_en = parts.text_encoder.embedding(tokens)[0]  # [T, 512]
            d_en = parts.bert_encoder(parts.bert(tokens, attention_mask=(~mask).int()))[0]  # [T, 512]
        content = got["speech_content"][uid]
        assert content.shape == (len(ids) + 1, 1024)
        np.testing.assert_allclose(content[:, :512], t_en.numpy(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(content[:, 512:], d_en.numpy(), rtol=0, atol=1e-6)
        # the mel both style encoders saw is StyleTTS2's, from the trimmed 24 kHz speech
        mel = parts.style_encoder.inputs[i]
        assert torch.equal(mel, parts.predictor_encoder.inputs[i])
        ref = _reference_mel(raw / "media" / f"{uid}.wav")
        assert mel.shape == (1, 1, 80, ref.shape[1])
        np.testing.assert_allclose(mel[0, 0].numpy(), ref, rtol=0, atol=2e-4)
        style = got["speech_style"][uid]
        assert style.shape == (256,)
        np.testing.assert_array_equal(style[:128], parts.style_encoder.outputs[i][0].numpy())
        np.testing.assert_array_equal(style[128:], parts.predictor_encoder.outputs[i][0].numpy())
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert {meta[k]["source"] for k in st.KINDS} == {"styletts2"}
    assert meta["speech_style"]["mel"]["filterbank_sample_rate"] == 16000
    assert meta["speech_content"]["checkpoint"] == "stand-in"


def test_mel_trims_silence_and_matches_reference(raw):
    path = next((raw / "media").glob("*.wav"))
    audio = st.load_reference_audio(path)
    assert abs(len(audio) / 24000 - 1.3) < 0.15  # the 0.25 s silent edges are gone, 16 kHz -> 24 kHz
    np.testing.assert_allclose(st.styletts2_mel(audio), _reference_mel(path), rtol=0, atol=2e-4)
    with pytest.raises(ValueError, match="samples after trimming"):
        st.styletts2_mel(np.zeros(800, np.float32))


def test_styletts2_needs_repo_and_ckpt(raw, tmp_path):
    with pytest.raises(st.UsageError, match="needs --repo"):
        st.export_speech_targets(raw, tmp_path, backend="styletts2", ckpt="x.pth", progress=False)
    with pytest.raises(st.UsageError, match="needs --ckpt"):
        st.export_speech_targets(raw, tmp_path, backend="styletts2", repo=tmp_path, progress=False)
    with pytest.raises(st.UsageError, match="not a StyleTTS2 checkout"):
        st.load_styletts2(tmp_path, tmp_path / "x.pth", word_tokenize=str.split)


# ---------------------------------------------------------------------------------------------------------
# StyleTTS2 loader with a fake checkout (same entry points: models.build_model, text_utils.TextCleaner)

_FAKE_MODELS = '''
import torch
from torch import nn
from torch.nn.utils import spectral_norm


class TextEncoder(nn.Module):
    def __init__(self, channels, n_symbols):
        super().__init__()
        self.embedding = nn.Embedding(n_symbols, channels)

    def forward(self, x, input_lengths, m):
        return self.embedding(x).transpose(1, 2).masked_fill(m.unsqueeze(1), 0.0)


class StyleEncoder(nn.Module):
    def __init__(self, style_dim):
        super().__init__()
        self.conv = spectral_norm(nn.Conv2d(1, 4, 3, 1, 1))
        self.unshared = nn.Linear(4, style_dim)

    def forward(self, x):
        return self.unshared(self.conv(x).mean((2, 3)))


def build_model(args, text_aligner, pitch_extractor, bert):
    assert text_aligner is None and pitch_extractor is None
    return dict(bert=bert, bert_encoder=nn.Linear(bert.config.hidden_size, args.hidden_dim),
                text_encoder=TextEncoder(args.hidden_dim, args.n_token),
                style_encoder=StyleEncoder(args.style_dim), predictor_encoder=StyleEncoder(args.style_dim),
                decoder=nn.Linear(2, 2))
'''
_FAKE_TEXT_UTILS = '''
class TextCleaner:
    def __init__(self, dummy=None):
        print("table size")

    def __call__(self, text):
        return [1 + ord(c) % 40 for c in text]
'''
_PLBERT = {"model_params": {"vocab_size": 50, "hidden_size": 16, "num_attention_heads": 2,
                            "intermediate_size": 32, "max_position_embeddings": 64, "num_hidden_layers": 1,
                            "embedding_size": 8}}
_CONFIG = {"PLBERT_dir": "Utils/PLBERT/", "model_params": {"hidden_dim": 12, "n_token": 50, "style_dim": 5}}


@pytest.fixture
def fake_checkout(tmp_path, monkeypatch):
    import yaml

    repo = tmp_path / "StyleTTS2"
    (repo / "Utils" / "PLBERT").mkdir(parents=True)
    (repo / "models.py").write_text(_FAKE_MODELS)
    (repo / "text_utils.py").write_text(_FAKE_TEXT_UTILS)
    (repo / "Utils" / "PLBERT" / "config.yml").write_text(yaml.safe_dump(_PLBERT))
    models_dir = tmp_path / "Models"
    models_dir.mkdir()
    (models_dir / "config.yml").write_text(yaml.safe_dump(_CONFIG))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("models", "text_utils"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield repo, models_dir
    for name in ("models", "text_utils"):
        sys.modules.pop(name, None)


def _trained_net(repo: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A 'trained' state for the fake model: its own modules, re-initialised, DataParallel-prefixed."""
    torch.manual_seed(1)
    sys.path.insert(0, str(repo))  # sys.path is restored by the fixture
    import models  # the fake checkout's

    bert = st._build_plbert(repo, _CONFIG)
    model = models.build_model(st._munchify(_CONFIG["model_params"]), None, None, bert)
    net = {}
    for name in st.STYLETTS2_MODULES:
        for p in model[name].parameters():
            torch.nn.init.normal_(p, std=0.5)
        net[name] = {f"module.{k}": v.clone() for k, v in model[name].state_dict().items()}
    return net


def test_loader_builds_and_fills_the_checkout_model(fake_checkout, tmp_path, capsys):
    from safetensors.torch import save_file

    repo, models_dir = fake_checkout
    net = _trained_net(repo)
    pth = models_dir / "epoch_2nd.pth"
    torch.save({"net": net, "epoch": 3, "iters": 10}, pth)
    parts = st.load_styletts2(repo, pth, word_tokenize=str.split, device="cpu")
    assert "table size" not in capsys.readouterr().out
    for name in st.STYLETTS2_MODULES:
        state = getattr(parts, name).state_dict()
        for k, v in net[name].items():
            assert torch.equal(state[k.removeprefix("module.")], v), (name, k)
    assert parts.meta["checkpoint_sha256"] and parts.meta["config"] == str(models_dir / "config.yml")
    content = st.styletts2_content(parts, "həlˈoʊ wˈɜːld")
    assert content.shape == (1 + len("həlˈoʊ wˈɜːld"), 24)  # 2 * hidden_dim
    mel = np.random.default_rng(0).standard_normal((80, 90)).astype(np.float32)
    style = st.styletts2_style(parts, mel)
    assert style.shape == (10,)  # 2 * style_dim
    with torch.no_grad():
        x = torch.from_numpy(mel)[None, None]
        np.testing.assert_allclose(style[:5], parts.style_encoder(x)[0].numpy(), atol=1e-6)
        np.testing.assert_allclose(style[5:], parts.predictor_encoder(x)[0].numpy(), atol=1e-6)
    # the same weights as safetensors ({module}.{parameter}) give the same model
    st_file = models_dir / "epoch_2nd.safetensors"
    save_file({f"{m}.{k}": v.contiguous() for m in net for k, v in net[m].items()}, st_file)
    parts2 = st.load_styletts2(repo, st_file, models_dir / "config.yml", word_tokenize=str.split,
                               device="cpu")
    np.testing.assert_array_equal(st.styletts2_content(parts2, "həlˈoʊ wˈɜːld"), content)
    assert st.styletts2_phonemes("Hello, world.", str.split).startswith("həlˈoʊ")


def test_loader_refuses_unsafe_or_mismatched_checkpoints(fake_checkout, tmp_path, monkeypatch):
    import argparse

    repo, models_dir = fake_checkout
    net = _trained_net(repo)
    pickled = models_dir / "pickled.pth"
    torch.save({"net": net, "args": argparse.Namespace(a=1)}, pickled)  # needs weights_only=False
    with pytest.raises(st.UsageError, match=r"weights_only=True.*safetensors") as e:
        st.load_styletts2(repo, pickled, word_tokenize=str.split)
    assert "\n" not in str(e.value)
    partial = models_dir / "partial.pth"
    torch.save({"net": {k: v for k, v in net.items() if k != "predictor_encoder"}}, partial)
    with pytest.raises(st.UsageError, match="no weights for \\['predictor_encoder'\\]"):
        st.load_styletts2(repo, partial, word_tokenize=str.split)
    wrong = models_dir / "wrong.pth"
    torch.save({"net": {**net, "bert_encoder": {"weight": torch.zeros(3, 3), "bias": torch.zeros(3)}}}, wrong)
    with pytest.raises(st.UsageError, match="does --config match --ckpt"):
        st.load_styletts2(repo, wrong, word_tokenize=str.split)
    lone = tmp_path / "elsewhere" / "ckpt.pth"
    lone.parent.mkdir()
    lone.write_bytes(partial.read_bytes())
    with pytest.raises(st.UsageError, match="no --config given"):
        st.load_styletts2(repo, lone, word_tokenize=str.split)
    monkeypatch.setitem(sys.modules, "nltk", None)  # nltk not installed
    with pytest.raises(st.UsageError, match="pip install nltk"):
        st.load_styletts2(repo, partial)


# ---------------------------------------------------------------------------------------------------------
# CLI


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


def test_cli_user_errors_exit_2_with_one_line(raw, tmp_path, capsys):
    assert st.main(["--raw", str(raw), "--out", str(tmp_path), "--backend", "espnet"]) == 2
    assert "unknown --backend 'espnet'" in _one_error_line(capsys)
    assert st.main(["--raw", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "does not exist" in _one_error_line(capsys)
    args = ["--raw", str(raw), "--out", str(tmp_path)]
    assert st.main([*args, "--backend", "styletts2", "--ckpt", "c.pth"]) == 2
    assert "needs --repo" in _one_error_line(capsys)
    assert st.main(["--raw", str(raw), "--out", str(tmp_path), "--splits", "nope"]) == 2
    assert "split 'nope'" in _one_error_line(capsys)
    assert not (tmp_path / "meta.json").exists()


def test_cli_writes_kokoro_targets(raw, tmp_path, capsys):
    assert st.main(["--raw", str(raw), "--out", str(tmp_path), "--splits", "test", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert TargetReader(tmp_path).summary()["speech_style"]["count"] == 2
