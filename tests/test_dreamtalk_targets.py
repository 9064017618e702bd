"""converters/dreamtalk_targets.py: video targets from DreamTalk's encoders, with stand-in torch modules.

The stand-ins (``ContentW2VEncoder``, ``StyleEncoder``) have DreamTalk's names, constructor arguments,
call signatures and shapes; the wav2vec2 is a real 1-layer ``Wav2Vec2Model`` with hidden size 1024 saved
to a temporary folder. The frame windows, the frame count and the style clip are recomputed here
independently (plain loops over DreamTalk's rules) and compared with what the exporter wrote. A fake
checkout (the same stand-in source as ``core/networks/generator.py``) exercises the loader, the checkpoint
formats and the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch

from converters import dreamtalk_targets as dt
from empatheia_jax.data.schema import dialogue_utterances, load_dialogues
from empatheia_jax.data.targets import TargetReader
from empatheia_jax.generators.speech_synth import read_wav, write_wav

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
            {"context": "afraid", "response": "Was anyone there?",
             "dialogue_history": [{"index": 0, "role": "speaker", "utterance": "I heard noises downstairs."}],
             "chain_of_empathy": {"speaker_emotion": "afraid"}},
        ],
    },
]

# wav lengths (samples at 16 kHz): wav2vec2 vector counts of both parities, one short enough for one frame
_LENGTHS = (5000, 8001, 11040, 720, 9600, 7520)
# coefficient files: (suffix, frames, columns); longer, shorter and exactly STYLE_MAX_LEN frames
_COEFFS = ((".mat", 300, 257), (".npy", 40, 257), (".npy", 256, 64), (".txt", 30, 64), (".mat", 12, 257),
           (".npy", 999, 257))

# The stand-in modules, also written as the fake checkout's core/networks/generator.py.
STANDIN_SRC = '''
import torch
from torch import nn

from core.utils import checkout_marker  # DreamTalk's generator.py imports core.utils too


class ContentW2VEncoder(nn.Module):
    """[B, N, W, 1024] -> [B, N, W, d_model], mixing positions within each frame's window only."""

    def __init__(self, d_model=512, nhead=8, num_encoder_layers=6, dim_feedforward=2048, dropout=0.1,
                 activation="relu", normalize_before=False, pos_embed_len=80, ph_embed_dim=128):
        super().__init__()
        self.increase_embed_dim = nn.Linear(1024, d_model)
        self.mix = nn.Linear(d_model, d_model)
        pos = torch.arange(pos_embed_len, dtype=torch.float32)[:, None]
        self.register_buffer("pos_table", torch.sin(pos * (1.0 + torch.arange(d_model)[None]) / d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = self.increase_embed_dim(x) + self.pos_table[: x.shape[2]]
        return self.drop(h + torch.tanh(self.mix(h.mean(2, keepdim=True))))


class StyleEncoder(nn.Module):
    """(clip [B, L, input_dim], pad_mask [B, L] True at padding) -> [B, d_model]; records its inputs."""

    def __init__(self, d_model=512, nhead=8, num_encoder_layers=6, dim_feedforward=2048, dropout=0.1,
                 activation="relu", normalize_before=False, pos_embed_len=80, input_dim=128,
                 aggregate_method="average"):
        super().__init__()
        self.pos_embed_len = pos_embed_len
        self.increase_embed_dim = nn.Linear(input_dim, d_model)
        self.drop = nn.Dropout(dropout)
        self.calls = []

    def forward(self, x, pad_mask=None):
        assert x.shape[1] <= self.pos_embed_len
        self.calls.append((x.detach().clone(), pad_mask.detach().clone()))
        keep = (~pad_mask).float()[..., None]
        return self.drop((self.increase_embed_dim(x) * keep).sum(1) / keep.sum(1))
'''

FAKE_CFG_SRC = '''
class Node(dict):
    def __getattr__(self, name):
        return self[name]


def get_cfg_defaults():
    enc = dict(d_model=256, nhead=8, num_encoder_layers=3, dim_feedforward=1024, dropout=0.1,
               activation="relu", normalize_before=False)
    return Node(WIN_SIZE=5, D_MODEL=256, DATASET=Node(FACE3D_DIM=64, STYLE_MAX_LEN=256),
                CONTENT_ENCODER=Node(enc, pos_embed_len=11),
                STYLE_ENCODER=Node(enc, pos_embed_len=256, aggregate_method="self_attention_pooling"),
                DIFFUSION=Node(SCHEDULE=Node(NUM_STEPS=1000, BETA_1=1e-4, BETA_T=0.02, MODE="linear")))
'''

FAKE_UTILS_SRC = '''
import dlib  # noqa: F401  (DreamTalk imports it for face cropping only)

from configs.default import get_cfg_defaults  # noqa: F401  (must be the checkout's configs, not ours)

checkout_marker = "fake-dreamtalk"
'''


def _standins() -> dict:
    ns: dict = {}
    exec(compile(STANDIN_SRC.replace("from core.utils import checkout_marker", ""), "standin", "exec"), ns)
    return ns


def _cfg() -> dict:
    ns: dict = {}
    exec(FAKE_CFG_SRC, ns)
    return ns["get_cfg_defaults"]()


def _build_encoders(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    ns, cfg = _standins(), _cfg()
    torch.manual_seed(seed)
    content = ns["ContentW2VEncoder"](**cfg.CONTENT_ENCODER)
    style = ns["StyleEncoder"](**cfg.STYLE_ENCODER, input_dim=cfg.DATASET.FACE3D_DIM)
    return content, style


@pytest.fixture(scope="module")
def w2v_dir(tmp_path_factory) -> Path:
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

    d = tmp_path_factory.mktemp("w2v")
    torch.manual_seed(0)
    cfg = Wav2Vec2Config(hidden_size=1024, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                         conv_dim=(16,) * 7, feat_extract_norm="layer", do_stable_layer_norm=True,
                         num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=16)
    Wav2Vec2Model(cfg).eval().save_pretrained(d)
    Wav2Vec2FeatureExtractor(do_normalize=True, return_attention_mask=True).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("raw")
    (root / "media").mkdir()
    (root / "train.json").write_text(json.dumps(_DIALOGUES[:1]), encoding="utf-8")
    (root / "test.json").write_text(json.dumps(_DIALOGUES[1:]), encoding="utf-8")
    rng = np.random.default_rng(0)
    uids = _uids(root)
    assert len(uids) == len(_LENGTHS) == 6
    for uid, n in zip(uids, _LENGTHS, strict=True):
        t = np.arange(n) / 16000
        x = 0.3 * np.sin(2 * np.pi * (150 + 10 * len(uid)) * t) + 0.05 * rng.standard_normal(n)
        write_wav(root / "media" / f"{uid}.wav", (x * 32000).astype(np.int16))
    return root


@pytest.fixture(scope="module")
def coeffs(raw, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("coeffs")
    rng = np.random.default_rng(1)
    for uid, (suffix, frames, cols) in zip(_uids(raw), _COEFFS, strict=True):
        a = rng.standard_normal((frames, cols)).astype(np.float32)
        if suffix == ".mat":
            scipy.io.savemat(d / f"{uid}.mat", {"coeff": a, "transform_params": np.zeros((frames, 5))})
        elif suffix == ".npy":
            np.save(d / f"{uid}.npy", a)
        else:
            np.savetxt(d / f"{uid}.txt", a)
    return d


def _uids(root: Path) -> list[str]:
    return [uid for split in ("train", "test") for d in load_dialogues(root / f"{split}.json")
            for uid, _, _ in dialogue_utterances(d)]


def _exp_of(coeffs: Path, uid: str) -> np.ndarray:
    """The 64 expression columns of an utterance's coefficients, read independently."""
    if (coeffs / f"{uid}.mat").exists():
        return scipy.io.loadmat(coeffs / f"{uid}.mat")["coeff"][:, 80:144]
    if (coeffs / f"{uid}.npy").exists():
        a = np.load(coeffs / f"{uid}.npy")
    else:
        a = np.loadtxt(coeffs / f"{uid}.txt", ndmin=2)
    return a[:, 80:144] if a.shape[1] == 257 else a


@pytest.fixture(scope="module")
def parts(w2v_dir) -> dt.DreamTalkParts:
    model, fe, meta = dt.load_w2v(w2v_dir)
    content, style = _build_encoders(seed=2)
    return dt.DreamTalkParts(content_encoder=content.eval(), style_encoder=style.eval(), w2v=model,
                             feature_extractor=fe, win_size=5, style_max_len=256, meta=meta)


@pytest.fixture(scope="module")
def exported(raw, coeffs, parts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("targets")
    counts = dt.export_video_targets(raw, out, coeffs=coeffs, parts=parts, progress=False)
    assert counts == {"video_content": 6, "video_style": 6}
    return out


def _independent_windows(raw: Path, uid: str, w2v: torch.nn.Module) -> np.ndarray:
    """[T, 11, 1024] by DreamTalk's rules, written as plain loops: normalise, wav2vec2, then frame t reads
    vectors 2t-5 .. 2t+5 (zeros outside), T = N // 2."""
    sr, pcm = read_wav(raw / "media" / f"{uid}.wav")
    assert sr == 16000
    x = pcm.astype(np.float64) / 32768.0
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    with torch.no_grad():
        feats = w2v(torch.tensor(x, dtype=torch.float32)[None]).last_hidden_state[0].numpy()
    n = feats.shape[0]
    windows = np.zeros((n // 2, 11, feats.shape[1]), np.float32)
    for t in range(n // 2):
        for j in range(11):
            i = 2 * t - 5 + j
            if 0 <= i < n:
                windows[t, j] = feats[i]
    return windows


def _content_of(parts, windows: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return parts.content_encoder(torch.from_numpy(windows)[None])[0].numpy()


# ---------------------------------------------------------------------------------------------------------
# windows and frame counts


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 10, 11, 12, 13, 40, 41])
def test_audio_windows_follow_dreamtalks_rule(n):
    rng = np.random.default_rng(n)
    feats = rng.standard_normal((n, 3)).astype(np.float32)
    for win in (1, 5):
        got = dt.audio_windows(feats, win)
        assert got.shape == (n // 2, 2 * win + 1, 3)
        for t in range(n // 2):
            for j, i in enumerate(range(2 * t - win, 2 * t + win + 1)):
                np.testing.assert_array_equal(got[t, j], feats[i] if 0 <= i < n else np.zeros(3))
    assert dt.audio_windows(feats, 5, num_frames=n + 3).shape == (n + 3, 11, 3)  # all-zero windows past N


def test_frame_count_is_half_the_wav2vec2_vectors(parts):
    kernels, strides = parts.w2v.config.conv_kernel, parts.w2v.config.conv_stride
    for n in (400, 719, 720, 1039, 1040, 16000, 16333):
        with torch.no_grad():
            got = parts.w2v(torch.zeros(1, n)).last_hidden_state.shape[1]
        length = n
        for k, s in zip(kernels, strides, strict=True):
            length = (length - k) // s + 1
        assert dt.w2v_length(n) == length == got
        assert dt.num_video_frames(n) == got // 2
    assert dt.num_video_frames(16000) == 24  # 49 vectors per second -> 24 frames
    assert dt.w2v_length(399) == 0


# ---------------------------------------------------------------------------------------------------------
# exported targets


def test_content_targets_are_the_window_centres(raw, exported, parts):
    r = TargetReader(exported)
    assert r.source("video_content") == "dreamtalk" and r.dim("video_content") == 256
    meta = r.meta["video_content"]
    assert (meta["window"], meta["win_size"], meta["window_len"]) == ("center", 5, 11)
    assert sorted(r.keys("video_content")) == sorted(_uids(raw))
    for uid, n in zip(_uids(raw), _LENGTHS, strict=True):
        windows = _independent_windows(raw, uid, parts.w2v)
        got = r.get("video_content", uid)
        assert got.shape == (len(windows), 256) == (dt.num_video_frames(n), 256)
        np.testing.assert_allclose(got, _content_of(parts, windows)[:, 5], rtol=1e-4, atol=1e-4)
    assert r.get("video_content", _uids(raw)[3]).shape == (1, 256)  # 720 samples: 2 vectors, one frame


def test_style_targets_and_the_clip_given_to_the_style_encoder(raw, coeffs, exported, parts):
    r = TargetReader(exported)
    assert r.source("video_style") == "dreamtalk" and r.meta["video_style"]["style_max_len"] == 256
    for uid, (_, frames, _) in zip(_uids(raw), _COEFFS, strict=True):
        exp = _exp_of(coeffs, uid)
        parts.style_encoder.calls.clear()
        code = dt.dreamtalk_style(parts, dt.load_expression(dt.find_coeffs(coeffs, uid)))
        (clip, mask), = parts.style_encoder.calls
        assert clip.shape == (1, 256, 64) and mask.shape == (1, 256) and mask.dtype == torch.bool
        keep = min(frames, 256)
        np.testing.assert_array_equal(clip[0, :keep].numpy(), exp[:keep].astype(np.float32))
        assert not clip[0, keep:].any()
        np.testing.assert_array_equal(mask[0].numpy(), np.arange(256) >= keep)
        got = r.get("video_style", uid)
        assert got.shape == (256,)
        np.testing.assert_allclose(got, code, rtol=1e-6, atol=1e-6)
        lin = parts.style_encoder.increase_embed_dim
        w, b = lin.weight.detach().numpy(), lin.bias.detach().numpy()
        want = (exp[:keep].astype(np.float32) @ w.T).mean(0) + b
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["mean", "full"])
def test_other_content_windows(raw, coeffs, parts, tmp_path, mode):
    dt.export_video_targets(raw, tmp_path, coeffs=coeffs, parts=parts, progress=False, content_window=mode,
                            splits=["test"])
    r = TargetReader(tmp_path)
    assert r.meta["video_content"]["window"] == mode
    uids = _uids(raw)[4:]  # the test split's dialogue
    assert sorted(r.keys("video_content")) == sorted(uids)
    for uid in uids:
        full = _content_of(parts, _independent_windows(raw, uid, parts.w2v))
        want = full.mean(1) if mode == "mean" else full.reshape(len(full), 11 * 256)
        got = r.get("video_content", uid)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# errors


def test_missing_coefficient_file_is_named(raw, coeffs, parts, tmp_path):
    partial = tmp_path / "coeffs"
    partial.mkdir()
    uids = _uids(raw)
    for p in coeffs.iterdir():
        if not p.name.startswith(uids[2] + "."):
            (partial / p.name).write_bytes(p.read_bytes())
    out = tmp_path / "out"
    with pytest.raises(dt.UsageError, match=f"{partial / uids[2]}.mat"):
        dt.export_video_targets(raw, out, coeffs=partial, parts=parts, progress=False)
    assert not (out / "meta.json").exists()


def test_utterance_errors_are_collected_and_nothing_is_written(raw, coeffs, parts, tmp_path):
    bad = tmp_path / "coeffs"
    bad.mkdir()
    for p in coeffs.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    uids = _uids(raw)
    (bad / f"{uids[1]}.npy").unlink()
    np.save(bad / f"{uids[1]}.npy", np.zeros((10, 100), np.float32))  # neither 257 nor 64 columns
    (bad / f"{uids[0]}.mat").unlink()
    scipy.io.savemat(bad / f"{uids[0]}.mat", {"coefficients": np.zeros((5, 257))})  # no 'coeff' key
    out = tmp_path / "out"
    with pytest.raises(dt.TargetExportError) as e:
        dt.export_video_targets(raw, out, coeffs=bad, parts=parts, progress=False)
    msg = str(e.value)
    assert "2 of 6 utterance(s) failed" in msg and "no 'coeff' entry" in msg and "100 coefficients" in msg
    assert uids[0] in msg and uids[1] in msg
    assert not (out / "meta.json").exists() and not list(out.glob("*.safetensors"))


def test_wrong_wav2vec2_size_names_config_json(w2v_dir, tmp_path):
    small = tmp_path / "w2v-base"
    small.mkdir()
    cfg = json.loads((w2v_dir / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "hidden_size": 768}))
    (small / "preprocessor_config.json").write_text((w2v_dir / "preprocessor_config.json").read_text())
    with pytest.raises(dt.UsageError, match=rf"{small / 'config.json'}: hidden_size is 768"):
        dt.load_w2v(small)


def _fake_checkout(root: Path) -> Path:
    repo = root / "dreamtalk"
    (repo / "configs").mkdir(parents=True)
    (repo / "core" / "networks").mkdir(parents=True)
    (repo / "configs" / "default.py").write_text(FAKE_CFG_SRC)
    (repo / "core" / "utils.py").write_text(FAKE_UTILS_SRC)
    init = "from core.networks.generator import StyleEncoder\n\n__all__ = ['StyleEncoder']\n"
    (repo / "core" / "networks" / "__init__.py").write_text(init)
    (repo / "core" / "networks" / "generator.py").write_text(STANDIN_SRC)
    return repo


def _checkpoint_state(seed: int) -> dict[str, torch.Tensor]:
    content, style = _build_encoders(seed)
    state = {f"diff_net.net.content_encoder.{k}": v for k, v in content.state_dict().items()}
    state |= {f"diff_net.net.style_encoder.{k}": v for k, v in style.state_dict().items()}
    state["diff_net.net.decoder.tail_fc.0.weight"] = torch.zeros(2, 2)  # other parts of the network
    return state


def _cli(raw: Path, coeffs: Path, repo: Path, ckpt: Path, w2v: Path, out: Path) -> list[str]:
    return ["--repo", str(repo), "--ckpt", str(ckpt), "--w2v", str(w2v), "--coeffs", str(coeffs),
            "--raw", str(raw), "--out", str(out), "--device", "cpu", "--quiet"]


def test_cli_user_errors_exit_2_with_one_error_line(raw, coeffs, w2v_dir, tmp_path, capsys):
    repo = _fake_checkout(tmp_path)
    ckpt = tmp_path / "ckpt.pth"
    torch.save({"model_state_dict": _checkpoint_state(3)}, ckpt)
    empty = tmp_path / "empty"
    empty.mkdir()
    small = tmp_path / "w2v-base"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"hidden_size": 768}))
    cases = [
        (_cli(raw, empty, repo, ckpt, w2v_dir, tmp_path / "o1"), f"{empty / _uids(raw)[0]}.mat"),
        (_cli(raw, coeffs, repo, ckpt, small, tmp_path / "o2"), f"{small / 'config.json'}: hidden_size is 7"),
        (_cli(raw, coeffs, tmp_path, ckpt, w2v_dir, tmp_path / "o3"), "is not a DreamTalk checkout"),
        (_cli(raw, coeffs, repo, tmp_path / "none.pth", w2v_dir, tmp_path / "o4"), "none.pth does not exist"),
    ]
    for argv, needle in cases:
        assert dt.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3", "o4"))


def test_loader_with_fake_checkout_and_cli(raw, coeffs, w2v_dir, parts, tmp_path, capsys):
    import configs  # this project's own package of the same name as DreamTalk's

    ours = configs.__file__
    repo = _fake_checkout(tmp_path)
    state = _checkpoint_state(seed=5)
    ckpt = tmp_path / "denoising_network.pth"
    torch.save({"model_state_dict": state, "epoch": 7}, ckpt)
    loaded = dt.load_dreamtalk(repo, ckpt, w2v_dir, device="cpu")
    assert sys.modules["configs"].__file__ == ours  # DreamTalk's packages were imported and put away
    assert "core" not in sys.modules and "core.networks.generator" not in sys.modules
    assert "dlib" not in sys.modules  # the placeholder is gone too
    assert type(loaded.content_encoder).__name__ == "ContentW2VEncoder"
    assert not loaded.content_encoder.training
    assert not loaded.style_encoder.training and not loaded.w2v.training
    assert (loaded.win_size, loaded.style_max_len) == (5, 256)
    for k, v in loaded.style_encoder.state_dict().items():
        torch.testing.assert_close(v, state[f"diff_net.net.style_encoder.{k}"])
    assert loaded.meta["checkpoint"] == str(ckpt) and loaded.meta["do_normalize"] is True

    # the CLI with the same weights writes what the in-process export with stand-ins writes
    out = tmp_path / "cli"
    assert dt.main(_cli(raw, coeffs, repo, ckpt, w2v_dir, out)) == 0
    content, style = _build_encoders(seed=5)
    same = dt.DreamTalkParts(content.eval(), style.eval(), parts.w2v, parts.feature_extractor)
    ref = tmp_path / "ref"
    dt.export_video_targets(raw, ref, coeffs=coeffs, parts=same, progress=False)
    a, b = TargetReader(out), TargetReader(ref)
    for kind in dt.KINDS:
        for uid in _uids(raw):
            np.testing.assert_allclose(a.get(kind, uid), b.get(kind, uid), rtol=1e-5, atol=1e-5)
    assert a.meta["video_content"]["checkpoint_sha256"]


def test_checkpoint_formats(tmp_path):
    from safetensors.torch import save_file

    state = _checkpoint_state(seed=6)
    unsafe = tmp_path / "unsafe.pth"
    torch.save({"model_state_dict": state, "args": argparse.Namespace(lr=1e-4)}, unsafe)
    with pytest.raises(dt.UsageError, match=r"weights_only=True.*CKPT\.safetensors"):
        dt.read_dreamtalk_checkpoint(unsafe)
    st = tmp_path / "ckpt.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(st))
    sub = dt.module_state(dt.read_dreamtalk_checkpoint(st), "content_encoder", st)
    assert set(sub) == {k.removeprefix("diff_net.net.content_encoder.") for k in state if "content_" in k}
    with pytest.raises(dt.UsageError, match="no weights for DreamTalk's style_encoder"):
        dt.module_state({"diff_net.net.decoder.w": torch.zeros(1)}, "style_encoder", st)


# ---------------------------------------------------------------------------------------------------------
# the renderer bridge (converters/dreamtalk.py) with stand-in DiffusionNet / FaceGenerator


class _NoisePredictor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.content_encoder = torch.nn.Linear(1024, 256)  # must not be called by the bridge


class _DiffusionNet(torch.nn.Module):
    """DreamTalk's sample() interface: runs net.content_encoder on `audio`, uses ready_style_code."""

    def __init__(self):
        super().__init__()
        self.net = _NoisePredictor()
        self.calls = []

    def sample(self, audio, style_clip, style_pad_mask, output_dim, use_cf_guidance=False, cfg_scale=2.0,
               sample_method="ddpm", ddim_num_step=50, ready_style_code=None):
        content = self.net.content_encoder(audio)
        self.calls.append(dict(content=content.clone(), code=ready_style_code.clone(), cf=use_cf_guidance,
                               method=sample_method, steps=ddim_num_step, clip=tuple(style_clip.shape)))
        return content[:, :, 5, :output_dim] + ready_style_code[:, None, :output_dim]


class _FaceGenerator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, image, driving):
        self.seen.append((image.clone(), driving.clone()))
        return {"fake_image": image * 0 + driving[:, :3, 13, None, None] / 100}


def test_bridge_feeds_our_content_and_style_to_the_denoiser():
    from converters import dreamtalk as bridge

    r = bridge.DreamTalkRenderer(diff_net=_DiffusionNet(), face_generator=_FaceGenerator())
    original = r.diff_net.net.content_encoder
    rng = np.random.default_rng(7)
    full = rng.standard_normal((9, 11, 256)).astype(np.float32)
    style = rng.standard_normal(256).astype(np.float32)
    motion = bridge.face_motion(r, full.reshape(9, 11 * 256), style, ddim_steps=4)
    call = r.diff_net.calls[-1]
    assert r.diff_net.net.content_encoder is original  # put back after sampling
    np.testing.assert_array_equal(call["content"][0].numpy(), full)  # exact windows, window-major
    np.testing.assert_array_equal(call["code"][0].numpy(), style)
    assert (call["cf"], call["method"], call["steps"], call["clip"]) == (False, "ddim", 4, (1, 256, 64))
    assert motion.shape == (9, 73)
    np.testing.assert_allclose(motion[:, :64], full[:, 5, :64] + style[:64], rtol=1e-6)
    np.testing.assert_allclose(motion[:, 64:], np.tile(bridge.STILL_POSE, (9, 1)), rtol=1e-6)
    bridge.face_motion(r, full[:, 5], style)  # one row per frame: repeated over the window
    np.testing.assert_array_equal(r.diff_net.calls[-1]["content"][0].numpy(),
                                  np.repeat(full[:, 5][:, None], 11, axis=1))
    pose = rng.standard_normal((4, 9)).astype(np.float32)
    got = bridge.pose_rows(pose, 6)
    np.testing.assert_array_equal(got, np.concatenate([pose, pose[-1:], pose[-1:]]))
    with pytest.raises(ValueError, match="300 values"):
        bridge.content_windows(np.zeros((3, 300)))


def test_bridge_renders_27_frame_coefficient_windows():
    from converters import dreamtalk as bridge

    r = bridge.DreamTalkRenderer(diff_net=None, face_generator=_FaceGenerator())
    rng = np.random.default_rng(8)
    motion = rng.standard_normal((20, 73)).astype(np.float32)
    face = rng.integers(0, 256, (256, 256, 3)).astype(np.uint8)
    frames = bridge.render_frames(r, face, motion)
    assert frames.shape == (20, 256, 256, 3) and frames.dtype == np.uint8
    assert [len(d) for _, d in r.face_generator.seen] == [16, 4]
    drive = torch.cat([d for _, d in r.face_generator.seen]).numpy()
    for t in range(20):
        rows = [min(max(i, 0), 19) for i in range(t - 13, t + 14)]
        np.testing.assert_array_equal(drive[t], motion[rows].T)
    image = r.face_generator.seen[0][0][0].numpy()
    np.testing.assert_allclose(image, face.transpose(2, 0, 1) / 127.5 - 1.0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# `python -m converters.synthesize --dreamtalk-repo`: the whole renderer path on a fake checkout

FAKE_DIFFUSION_SRC = '''
import torch
from torch import nn


class DiffusionNet(nn.Module):
    """sample(): the content encoder's window centre plus the ready style code (deterministic)."""

    def __init__(self, cfg, net, var_sched):
        super().__init__()
        self.cfg, self.net, self.var_sched = cfg, net, var_sched

    def sample(self, audio, style_clip, style_pad_mask, output_dim, use_cf_guidance=False, cfg_scale=2.0,
               sample_method="ddpm", ddim_num_step=50, ready_style_code=None):
        assert not use_cf_guidance and sample_method == "ddim" and ready_style_code is not None
        content = self.net.content_encoder(audio)
        return content[:, :, self.cfg.WIN_SIZE, :output_dim] + ready_style_code[:, None, :output_dim]
'''

FAKE_DIFFUSION_UTIL_SRC = '''
from torch import nn

from core.networks.generator import ContentW2VEncoder, StyleEncoder


class NoisePredictor(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.content_encoder = ContentW2VEncoder(**cfg.CONTENT_ENCODER)
        self.style_encoder = StyleEncoder(**cfg.STYLE_ENCODER, input_dim=cfg.DATASET.FACE3D_DIM)
        self.decoder = nn.Module()
        self.decoder.tail_fc = nn.Sequential(nn.Linear(2, 2, bias=False))


class VarianceSchedule:
    def __init__(self, num_steps, beta_1, beta_T, mode):
        self.num_steps = num_steps
'''

FAKE_FACE_MODEL_SRC = '''
import torch
from torch import nn


class FaceGenerator(nn.Module):
    """Draws each frame in one colour: the first three coefficients of the window's centre row."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.gain = nn.Parameter(torch.zeros(3))

    def forward(self, image, driving):
        colour = self.gain[None] * driving[:, :3, 13] * self.scale
        return {"fake_image": image * 0 + colour[:, :, None, None]}
'''


def _fake_renderer_checkout(root: Path) -> Path:
    repo = _fake_checkout(root)
    (repo / "generators").mkdir()
    (repo / "core" / "networks" / "diffusion_net.py").write_text(FAKE_DIFFUSION_SRC)
    (repo / "core" / "networks" / "diffusion_util.py").write_text(FAKE_DIFFUSION_UTIL_SRC)
    (repo / "generators" / "face_model.py").write_text(FAKE_FACE_MODEL_SRC)
    (repo / "generators" / "renderer_conf.yaml").write_text("scale: 0.25\n")
    return repo


def _reply_features(tmp_path: Path, video_targets: str, rows: int = 30
                    ) -> tuple[Path, np.ndarray, np.ndarray]:
    from empatheia_jax.serve.chat import ChatResult
    from empatheia_jax.serve.outputs import write_outputs

    rng = np.random.default_rng(11)
    content = rng.uniform(-1, 1, (rows, 256)).astype(np.float32)
    style = rng.uniform(-1, 1, 256).astype(np.float32)
    result = ChatResult(text="Oh no.", coe={}, reply="Oh no.", emotion="",
                        emotion_probs=np.zeros(0, np.float32), profile={},
                        features={"video_content": content, "video_style": style},
                        signal_tokens_forced=False, video_targets=video_targets)
    npz, _ = write_outputs(result, tmp_path / f"reply-{video_targets}")
    return npz, content, style


def test_synthesize_renders_our_features_through_a_dreamtalk_checkout(tmp_path, capsys):
    """The bridge's CLI loads the checkout's DiffusionNet and FaceGenerator with their checkpoints, feeds
    our C^v/S^v, and writes a 25-fps mp4 with the speech: each frame's colour is what the stand-in renderer
    draws from our rows, so the values went through, not only the shapes."""
    import av
    from PIL import Image

    from converters.synthesize import main

    repo = _fake_renderer_checkout(tmp_path)
    ckpt, renderer = tmp_path / "denoising_network.pth", tmp_path / "renderer.pt"
    torch.save({"model_state_dict": _checkpoint_state(seed=9)}, ckpt)
    torch.save({"net_G_ema": {"gain": torch.tensor([1.0, 2.0, 3.0])}}, renderer)
    Image.fromarray(np.full((256, 256, 3), 90, np.uint8)).save(tmp_path / "face.png")
    wav = tmp_path / "reply.wav"
    write_wav(wav, (0.3 * np.sin(np.arange(8000) / 5) * 32000).astype(np.int16))  # 0.5 s at 16 kHz
    npz, content, style = _reply_features(tmp_path, "dreamtalk")
    dreamtalk = ["--dreamtalk-repo", str(repo), "--ckpt", str(ckpt), "--renderer", str(renderer),
                 "--image", str(tmp_path / "face.png"), "--device", "cpu", "--ddim-steps", "2"]
    mp4 = tmp_path / "reply.mp4"
    assert main(["--features", str(npz), "--wav", str(wav), "--avatar", str(mp4), *dreamtalk]) == 0
    assert "DreamTalk" in capsys.readouterr().out
    with av.open(str(mp4)) as c:
        assert c.streams.video[0].average_rate == 25 and c.streams.audio[0].rate == 16000
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])
    n = dt.num_video_frames(8000)
    assert len(frames) == n == 12
    motion = content[:n, :3] + style[:3]  # the stand-in denoiser's output, first three coefficients
    colour = np.clip(motion * np.array([1.0, 2.0, 3.0]) * 0.25, -1, 1)
    want = ((colour + 1) / 2 * 255).astype(np.uint8)
    np.testing.assert_allclose(frames.reshape(n, -1, 3).mean(1), want, atol=4)  # h264 yuv420 at crf 18

    # features DreamTalk cannot draw, and DreamTalk's features without DreamTalk, are refused by name
    other, _, _ = _reply_features(tmp_path, "face_render")
    assert main(["--features", str(other), "--wav", str(wav), "--avatar", str(tmp_path / "x.mp4"),
                 *dreamtalk]) == 2
    assert "trained on face_render features" in capsys.readouterr().err
    assert main(["--features", str(npz), "--wav", str(wav), "--avatar", str(tmp_path / "y.mp4")]) == 2
    assert "--dreamtalk-repo" in capsys.readouterr().err
    assert not (tmp_path / "x.mp4").exists() and not (tmp_path / "y.mp4").exists()
    with pytest.raises(SystemExit):  # argparse: --dreamtalk-repo without its checkpoints
        main(["--features", str(npz), "--wav", str(wav), "--avatar", str(mp4), "--dreamtalk-repo", str(repo)])
    assert "needs --ckpt, --renderer, --image" in capsys.readouterr().err
