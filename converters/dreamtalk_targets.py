"""Video generator targets (video_content, video_style) from DreamTalk's own encoders, per utterance.

Why this exporter exists: the Content Synchronizer and the Style Disentangler regress DreamTalk's own
intermediate features, so that at inference their outputs can stand in for DreamTalk's audio-content and
style encoders (DESIGN §2, §6). The targets are therefore computed exactly as DreamTalk's inference
(``inference_for_demo_video.py`` of ali-vilab/dreamtalk) computes the inputs of its denoising network:

- **audio features**: the 16 kHz utterance wav (``RAW/media/{uid}.wav``, float in [-1, 1)) goes through the
  wav2vec2 feature extractor of the ``--w2v`` folder (zero-mean/unit-variance when its
  ``do_normalize`` is set, as in ``jonatasgrosman/wav2vec2-large-xlsr-53-english``, the model DreamTalk
  names) and ``Wav2Vec2Model(input_values)[0]``, the last hidden state: N vectors of 1024 at 50 Hz. No
  attention mask is passed, as DreamTalk passes none.
- **frames and windows**: T = N // 2 video frames at 25 fps (DreamTalk's ``gen_num_frames``). Frame t
  reads the 2*WIN_SIZE+1 = 11 wav2vec2 vectors at indices 2t-5 .. 2t+5; indices outside [0, N) are zero
  vectors (``core.utils.get_wav2vec_audio_window``). WIN_SIZE comes from the checkout's
  ``configs/default.py``.
- **content**: ``ContentW2VEncoder([1, T, 11, 1024]) -> [1, T, 11, 256]``. It attends only within each
  frame's window, so frames are encoded in chunks without changing the result. The target keeps one
  256-d row per frame, the **centre** window position (index WIN_SIZE, the position aligned with the frame
  and the one DreamTalk's decoder reads its output at), so ``video_content`` is [T, 256] as the
  model's default ``video_content_dim`` expects. ``content_window="mean"`` averages the 11 positions
  instead; ``"full"`` keeps the whole window, flattened window-major to [T, 11*256] (set the model's
  ``video_content_dim`` to 2816), which is the only layout the renderer can be given without
  approximation (``converters/dreamtalk.py``). meta.json records which (``window``, ``layout``).
- **style**: the 64 expression coefficients (columns 80:144 of the 257 Deep3DFaceRecon coefficients) of
  the utterance's own video, from ``--coeffs DIR/{uid}.mat`` (key ``coeff``, what DreamTalk's style clips
  are), ``.npy`` ([L, 257], or [L, 64] already cut) or ``.txt`` ([L, 64], DreamTalk's other style-clip
  format). As ``get_video_style_clip(..., style_max_len=256, start_idx=0)`` does: the first 256 frames,
  or all L < 256 frames zero-padded to 256 with a padding mask (True at padding); then
  ``StyleEncoder(clip [1, 256, 64], pad_mask [1, 256]) -> [1, 256]``.

Loading: the checkout's ``configs/default.py`` (needs ``yacs``) gives the hyper-parameters and
``core/networks/generator.py`` the two encoder classes; they are filled from the checkpoint's
``model_state_dict`` entries ``diff_net.net.content_encoder.*`` / ``diff_net.net.style_encoder.*``
(``checkpoints/denoising_network.pth``). Only ``torch.load(weights_only=True)`` or ``.safetensors`` is
read; a checkpoint holding pickled objects is refused with a one-line conversion. DreamTalk's packages
are called ``configs``, ``core`` and ``generators``, and this project has a ``configs`` package too, so
they are imported from ``--repo`` under those names only while the encoders are built, then taken out of
``sys.modules`` again. ``core/utils.py`` imports ``dlib`` and ``cv2`` for its face-cropping helper only;
where they are not installed, an inert placeholder stands in during that import.

CLI::

    python -m converters.dreamtalk_targets --repo CHECKOUT --ckpt FILE --w2v DIR --coeffs DIR --raw RAW
        --out TARGETS [--splits a,b] [--device D] [--content-window center|mean|full] [--shard-size N]
        [--quiet]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from converters.target_export import TargetExportError, UsageError, raw_dialogues, safe_torch_load

KINDS = ("video_content", "video_style")
SAMPLE_RATE = 16000  # DreamTalk resamples every wav to 16 kHz mono before wav2vec2
W2V_DIM = 1024  # ContentW2VEncoder's increase_embed_dim = nn.Linear(1024, d_model)
EXP_COLUMNS = (80, 144)  # expression block of the 257 Deep3DFaceRecon coefficients
N_COEFFS = 257
CONTENT_WINDOWS = ("center", "mean", "full")
COEFF_SUFFIXES = (".mat", ".npy", ".txt")
DREAMTALK_PACKAGES = ("configs", "core", "generators")
CHUNK_FRAMES = 1024  # frames per ContentW2VEncoder call (windows are independent, so chunking is exact)
SAFETENSORS_HINT = (
    "convert it once, where you trust the file, with: python -c \"import sys, torch; "
    "from safetensors.torch import save_file; c = torch.load(sys.argv[1], map_location='cpu', "
    "weights_only=False); sd = c.get('model_state_dict', c); save_file({k: v.clone().contiguous() for k, v "
    "in sd.items() if hasattr(v, 'contiguous')}, sys.argv[2])\" CKPT CKPT.safetensors, then pass "
    "--ckpt CKPT.safetensors"
)


class VideoJob(NamedTuple):
    uid: str
    wav: str
    coeffs: str


@dataclass
class DreamTalkParts:
    """What the targets need from DreamTalk: its two encoders (torch, eval mode), a wav2vec2 model and its
    feature extractor, the window and style-clip sizes, the device, and provenance for meta.json. Tests
    pass stand-ins with the same interfaces."""

    content_encoder: Any  # [B, N, W, 1024] -> [B, N, W, d_model]
    style_encoder: Any  # (clip [B, L, 64], pad_mask [B, L] bool, True at padding) -> [B, d_model]
    w2v: Any  # Wav2Vec2Model-like: (input_values [1, S], return_dict=False) -> ([1, N, 1024], ...)
    feature_extractor: Any  # Wav2Vec2FeatureExtractor-like: (audio, sampling_rate=, return_tensors="pt")
    win_size: int = 5  # cfg.WIN_SIZE: 2 * win_size + 1 vectors per frame
    style_max_len: int = 256  # cfg.DATASET.STYLE_MAX_LEN
    device: str = "cpu"
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------
# frames, windows and the style clip (pure numpy)


def w2v_length(n_samples: int, conv_kernel: Iterable[int] = (10, 3, 3, 3, 3, 2, 2),
               conv_stride: Iterable[int] = (5, 2, 2, 2, 2, 2, 2)) -> int:
    """Number of wav2vec2 vectors for `n_samples` of audio (its convolutional feature encoder, no padding);
    the defaults are wav2vec2-xlsr-53's kernels and strides (one vector per 20 ms)."""
    n = int(n_samples)
    for k, s in zip(conv_kernel, conv_stride, strict=True):
        if n < k:
            return 0
        n = (n - k) // s + 1
    return n


def num_video_frames(n_samples: int, **conv: Any) -> int:
    """T, the number of 25-fps frames DreamTalk generates for `n_samples` of 16 kHz audio: N_w2v // 2.

    The inference bridge uses it to know how many video_content rows to read for a spoken reply."""
    return w2v_length(n_samples, **conv) // 2


def audio_windows(feats: np.ndarray, win_size: int = 5, num_frames: int | None = None) -> np.ndarray:
    """[T, 2*win_size+1, C] windows of wav2vec2 features `feats` [N, C]: frame t holds rows 2t-win_size ..
    2t+win_size, zero where the index falls outside [0, N); T defaults to N // 2."""
    feats = np.asarray(feats, np.float32)
    if feats.ndim != 2:
        raise ValueError(f"wav2vec2 features must be [N, C], got {list(feats.shape)}")
    n = feats.shape[0]
    t = n // 2 if num_frames is None else int(num_frames)
    idx = 2 * np.arange(t)[:, None] + np.arange(-win_size, win_size + 1)[None, :]
    valid = (idx >= 0) & (idx < n)
    out = feats[np.clip(idx, 0, max(n - 1, 0))] if n else np.zeros((t, idx.shape[1], feats.shape[1]),
                                                                      np.float32)
    out[~valid] = 0.0
    return out


def style_clip(exp: np.ndarray, max_len: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(clip [max_len, 64], pad_mask [max_len] bool): the first `max_len` frames of the expression
    coefficients `exp` [L, 64], or all of them zero-padded, with True at the padding."""
    exp = np.asarray(exp, np.float32)
    n = min(len(exp), max_len)
    clip = np.zeros((max_len, exp.shape[1]), np.float32)
    clip[:n] = exp[:n]
    mask = np.arange(max_len) >= n
    return clip, mask


def load_expression(path: str | os.PathLike) -> np.ndarray:
    """The [L, 64] expression coefficients of a coefficient file (see the module docstring for formats)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".mat":
        from scipy.io import loadmat

        try:
            mat = loadmat(str(path))
        except Exception as e:  # noqa: BLE001 - scipy raises several types for a foreign file
            raise ValueError(f"{path}: not a readable .mat file ({e})") from e
        if "coeff" not in mat:
            keys = sorted(k for k in mat if not k.startswith("__"))
            raise ValueError(f"{path}: no 'coeff' entry (Deep3DFaceRecon's key); it has {keys}")
        a = np.asarray(mat["coeff"])
    elif suffix == ".npy":
        try:
            a = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"{path}: not a plain numeric .npy array ({e})") from e
    elif suffix == ".txt":
        a = np.loadtxt(path, ndmin=2)
    else:
        raise ValueError(f"{path}: unknown coefficient format; expected one of {COEFF_SUFFIXES}")
    if a.ndim != 2 or a.shape[0] < 1 or not np.issubdtype(a.dtype, np.number):
        raise ValueError(f"{path}: coefficients must be a numeric [frames, {N_COEFFS}] array, got "
                         f"{list(a.shape)} {a.dtype}")
    if a.shape[1] == N_COEFFS or (suffix == ".mat" and a.shape[1] >= EXP_COLUMNS[1]):
        a = a[:, EXP_COLUMNS[0]:EXP_COLUMNS[1]]
    elif a.shape[1] != EXP_COLUMNS[1] - EXP_COLUMNS[0] or suffix == ".mat":
        raise ValueError(f"{path}: {a.shape[1]} coefficients per frame; expected {N_COEFFS} "
                         f"(Deep3DFaceRecon) or {EXP_COLUMNS[1] - EXP_COLUMNS[0]} (expression only)")
    a = np.ascontiguousarray(a, np.float32)
    if not np.isfinite(a).all():
        raise ValueError(f"{path}: non-finite coefficients")
    return a


def find_coeffs(coeffs: Path, uid: str) -> Path | None:
    """The one coefficient file of `uid` in `coeffs`; None when there is none, UsageError for several."""
    found = [coeffs / f"{uid}{s}" for s in COEFF_SUFFIXES if (coeffs / f"{uid}{s}").is_file()]
    if len(found) > 1:
        raise UsageError(f"utterance {uid!r} has several coefficient files ({', '.join(map(str, found))}); "
                         "keep one")
    return found[0] if found else None


# ---------------------------------------------------------------------------------------------------------
# running the encoders


def pool_content(content: np.ndarray, mode: str) -> np.ndarray:
    """[T, W, C] window content -> the target rows: centre position, mean over W, or [T, W*C] (full)."""
    if mode == "center":
        return content[:, content.shape[1] // 2]
    if mode == "mean":
        return content.mean(axis=1)
    if mode == "full":
        return content.reshape(content.shape[0], -1)
    raise ValueError(f"unknown content window {mode!r}; expected one of {CONTENT_WINDOWS}")


def w2v_features(parts: Any, audio: np.ndarray) -> np.ndarray:
    """[N, 1024] last hidden state of wav2vec2 on 16 kHz float `audio`, as DreamTalk computes it."""
    import torch

    inputs = parts.feature_extractor(np.asarray(audio, np.float32), sampling_rate=SAMPLE_RATE,
                                     return_tensors="pt")
    x = inputs["input_values"]
    with torch.inference_mode():
        hidden = parts.w2v(x.to(getattr(parts, "device", "cpu")), return_dict=False)[0]
    if hidden.ndim != 3 or hidden.shape[0] != 1 or hidden.shape[2] != W2V_DIM:
        raise ValueError(f"wav2vec2 gave {list(hidden.shape)}, expected [1, N, {W2V_DIM}]")
    return hidden[0].float().cpu().numpy()


def dreamtalk_content(parts: Any, audio: np.ndarray) -> np.ndarray:
    """[T, 2*win_size+1, d_model]: ContentW2VEncoder's output for every frame window of `audio`."""
    import torch

    feats = w2v_features(parts, audio)
    windows = audio_windows(feats, parts.win_size)
    if len(windows) < 1:
        raise ValueError(f"{len(audio)} samples give {len(feats)} wav2vec2 vectors, not one video frame "
                         "(DreamTalk needs at least 2)")
    device = getattr(parts, "device", "cpu")
    out = []
    with torch.inference_mode():
        for i in range(0, len(windows), CHUNK_FRAMES):
            x = torch.from_numpy(windows[i:i + CHUNK_FRAMES])[None].to(device)
            c = parts.content_encoder(x)
            if c.ndim != 4 or tuple(c.shape[:3]) != tuple(x.shape[:3]):
                raise ValueError(f"ContentW2VEncoder gave {list(c.shape)} for windows {list(x.shape)}, "
                                 f"expected [1, {x.shape[1]}, {x.shape[2]}, d_model]")
            out.append(c[0].float().cpu().numpy())
    return np.concatenate(out, axis=0)


def dreamtalk_style(parts: Any, exp: np.ndarray) -> np.ndarray:
    """[d_model]: StyleEncoder's style code of the expression coefficients `exp` [L, 64]."""
    import torch

    clip, mask = style_clip(exp, parts.style_max_len)
    device = getattr(parts, "device", "cpu")
    with torch.inference_mode():
        code = parts.style_encoder(torch.from_numpy(clip)[None].to(device),
                                   torch.from_numpy(mask)[None].to(device))
    if code.ndim != 2 or code.shape[0] != 1:
        raise ValueError(f"StyleEncoder gave {list(code.shape)}, expected [1, d_model]")
    return code[0].float().cpu().numpy()


# ---------------------------------------------------------------------------------------------------------
# loading the user's DreamTalk and wav2vec2


def _git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _placeholder(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)

    def missing(attr: str) -> Any:
        raise AttributeError(f"{name} is not installed (a placeholder stood in while DreamTalk's encoders "
                             f"were imported; DreamTalk needs it only for face cropping): {name}.{attr}")

    mod.__getattr__ = missing  # type: ignore[attr-defined]
    return mod


@contextlib.contextmanager
def dreamtalk_modules(repo: str | os.PathLike) -> Iterator[None]:
    """Import DreamTalk's ``configs``/``core``/``generators`` from `repo` inside the block; afterwards
    ``sys.modules`` (and ``sys.path``) are as before, so our own ``configs`` package keeps its name."""
    repo = Path(repo)
    owned = lambda name: name.split(".")[0] in DREAMTALK_PACKAGES  # noqa: E731
    saved = {n: m for n, m in sys.modules.items() if owned(n)}
    for n in saved:
        del sys.modules[n]
    placeholders = []
    for name in ("dlib", "cv2"):
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except ImportError:
                sys.modules[name] = _placeholder(name)
                placeholders.append(name)
    for name in DREAMTALK_PACKAGES:  # namespace-style packages rooted in the checkout, ahead of ours
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(repo / name)]
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[name] = pkg
    sys.path.insert(0, str(repo))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(repo))
        for n in [n for n in sys.modules if owned(n)]:
            del sys.modules[n]
        sys.modules.update(saved)
        for name in placeholders:
            sys.modules.pop(name, None)


def read_dreamtalk_checkpoint(path: str | os.PathLike, entry: str = "model_state_dict") -> dict[str, Any]:
    """The flat state dict of a DreamTalk checkpoint: the `entry` of a torch file that loads with
    ``weights_only=True`` (``model_state_dict`` in denoising_network.pth, ``net_G_ema`` in renderer.pt), or
    a ``.safetensors`` file of the same keys."""

    import torch

    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise UsageError(f"{path}: not a readable safetensors file ({e})") from e
    obj = safe_torch_load(path, SAFETENSORS_HINT.replace("model_state_dict", entry))
    state = obj.get(entry, obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict):
        raise UsageError(f"{path}: expected a dict with a {entry!r} entry")
    return {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}


def module_state(state: dict[str, Any], module: str, path: Path) -> dict[str, Any]:
    """The entries of `module` (``content_encoder`` / ``style_encoder``) in a checkpoint's state dict,
    under ``[module.]diff_net.net.`` or ``net.`` (the wrappers DreamTalk's trainer and sampler add)."""
    prefixes = (f"module.diff_net.net.{module}.", f"diff_net.net.{module}.", f"net.{module}.", f"{module}.")
    for prefix in prefixes:
        sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if sub:
            return sub
    heads = sorted({".".join(k.split(".")[:3]) for k in state})[:8]
    raise UsageError(f"{path}: no weights for DreamTalk's {module} (expected keys diff_net.net.{module}.*; "
                     f"it has {heads})")


def check_w2v_folder(folder: str | os.PathLike) -> dict[str, Any]:
    """The config of a local HF wav2vec2 folder, checked for what DreamTalk reads (hidden size 1024, a
    feature extractor config); a `UsageError` names the offending file."""
    folder = Path(folder).expanduser().resolve()
    config = folder / "config.json"
    if not config.is_file():
        raise UsageError(f"--w2v {folder}: no config.json (expected a HuggingFace wav2vec2 folder such as "
                         "jonatasgrosman/wav2vec2-large-xlsr-53-english)")
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{config}: not valid JSON ({e})") from e
    hidden = cfg.get("hidden_size") if isinstance(cfg, dict) else None
    if hidden != W2V_DIM:
        raise UsageError(f"{config}: hidden_size is {hidden}, but DreamTalk's ContentW2VEncoder reads "
                         f"{W2V_DIM}-d wav2vec2 features (a wav2vec2-large / xlsr-53 model)")
    if not (folder / "preprocessor_config.json").is_file():
        raise UsageError(f"--w2v {folder}: no preprocessor_config.json (the feature extractor's settings)")
    return cfg


def load_w2v(folder: str | os.PathLike, device: str = "cpu") -> tuple[Any, Any, dict[str, Any]]:
    """(Wav2Vec2Model in eval mode, its feature extractor, provenance) from a local HF folder, offline."""
    from transformers import Wav2Vec2FeatureExtractor, Wav2Vec2Model

    cfg = check_w2v_folder(folder)
    folder = Path(folder).expanduser().resolve()
    try:
        fe = Wav2Vec2FeatureExtractor.from_pretrained(str(folder), local_files_only=True)
        model = Wav2Vec2Model.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--w2v {folder}: cannot load the wav2vec2 model ({first})") from e
    if int(getattr(fe, "sampling_rate", SAMPLE_RATE)) != SAMPLE_RATE:
        raise UsageError(f"{folder / 'preprocessor_config.json'}: sampling_rate is {fe.sampling_rate}, "
                         "DreamTalk feeds wav2vec2 16 kHz audio")
    meta = {"wav2vec2": str(folder), "wav2vec2_model_type": cfg.get("model_type"),
            "wav2vec2_layers": cfg.get("num_hidden_layers"),
            "do_normalize": bool(getattr(fe, "do_normalize", False)),
            "wav2vec2_output": "last_hidden_state (Wav2Vec2Model(input_values)[0]), no attention mask"}
    return model.to(device).eval(), fe, meta


def _load_module(name: str, module: Any, state: dict[str, Any], ckpt: Path) -> None:
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        why = " ".join(line.strip() for line in str(e).strip().splitlines()[:3])
        raise UsageError(f"{ckpt}: DreamTalk's {name} does not fit the model built from the checkout's "
                         f"configs/default.py ({why})") from e


def load_dreamtalk(
    repo: str | os.PathLike,
    ckpt: str | os.PathLike,
    w2v: str | os.PathLike,
    *,
    device: str | None = None,
) -> DreamTalkParts:
    """DreamTalk's ContentW2VEncoder and StyleEncoder from a checkout and a denoising-network checkpoint,
    plus the wav2vec2 model of `w2v`. Every problem is a one-line `UsageError`."""
    import torch

    from empatheia_jax.assets import sha256_file

    repo = Path(repo).expanduser().resolve()
    for rel in ("configs/default.py", "core/networks/generator.py"):
        if not (repo / rel).is_file():
            raise UsageError(f"--repo {repo} is not a DreamTalk checkout (it has no {rel})")
    ckpt = Path(ckpt).expanduser().resolve()
    if not ckpt.is_file():
        raise UsageError(f"--ckpt {ckpt} does not exist")
    check_w2v_folder(w2v)  # cheap; before the checkpoint and the checkout are read
    state = read_dreamtalk_checkpoint(ckpt)
    content_state = module_state(state, "content_encoder", ckpt)
    style_state = module_state(state, "style_encoder", ckpt)
    try:
        with dreamtalk_modules(repo):
            cfg = importlib.import_module("configs.default").get_cfg_defaults()
            generator = importlib.import_module("core.networks.generator")
            content_kw = dict(cfg.CONTENT_ENCODER)
            style_kw = {**dict(cfg.STYLE_ENCODER), "input_dim": int(cfg.DATASET.FACE3D_DIM)}
            content_encoder = generator.ContentW2VEncoder(**content_kw)
            style_encoder = generator.StyleEncoder(**style_kw)
            win_size, style_max_len = int(cfg.WIN_SIZE), int(cfg.DATASET.STYLE_MAX_LEN)
    except ImportError as e:
        hint = " (pip install yacs)" if "yacs" in str(e) else f"; pip install -r {repo / 'requirements.txt'}"
        raise UsageError(f"importing DreamTalk's code from {repo} failed ({e}){hint}") from e
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{repo}: building DreamTalk's encoders failed ({type(e).__name__}: {e})") from e
    _load_module("content_encoder", content_encoder, content_state, ckpt)
    _load_module("style_encoder", style_encoder, style_state, ckpt)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, fe, w2v_meta = load_w2v(w2v, device)
    meta = {"generator": "DreamTalk", "checkpoint": str(ckpt), "checkpoint_sha256": sha256_file(ckpt),
            "repo": str(repo), "repo_commit": _git_commit(repo), "device": device, **w2v_meta}
    return DreamTalkParts(content_encoder=content_encoder.to(device).eval(),
                          style_encoder=style_encoder.to(device).eval(), w2v=model, feature_extractor=fe,
                          win_size=win_size, style_max_len=style_max_len, device=device, meta=meta)


# ---------------------------------------------------------------------------------------------------------
# Export


def video_jobs(
    raw: str | os.PathLike,
    coeffs: str | os.PathLike,
    splits: list[str] | None = None,
    dialogues: Iterable[Any] | None = None,
) -> list[VideoJob]:
    """One job per distinct utterance (histories and responses); every wav and coefficient file must
    exist (a `UsageError` names the missing ones, before any model is loaded)."""
    from empatheia_jax.data import raw_layout, schema

    raw, coeffs = Path(raw), Path(coeffs)
    if not coeffs.is_dir() and raw.is_dir():
        raise UsageError(f"--coeffs folder {coeffs} does not exist")
    dialogues = raw_dialogues(raw, splits, dialogues)
    media = Path(raw_layout.media_dir_of(raw))
    jobs, seen, missing = [], set(), []
    for d in dialogues:
        for uid, _role, _text in schema.dialogue_utterances(d):
            if uid in seen:
                continue
            seen.add(uid)
            wav = media / f"{uid}.wav"
            if not wav.is_file():
                missing.append(str(wav))
            found = find_coeffs(coeffs, uid)
            if found is None:
                missing.append(f"{coeffs / uid}.mat (or .npy/.txt)")
            jobs.append(VideoJob(uid, str(wav), str(found)))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise UsageError(f"{len(missing)} input file(s) missing: {'; '.join(missing[:5])}{more}")
    return jobs


Result = tuple[str, dict[str, np.ndarray] | None, str | None]


def _results(parts: Any, jobs: list[VideoJob], content_window: str) -> Iterator[Result]:
    from empatheia_jax.data.encoders.media import load_audio

    for job in jobs:
        try:
            audio = load_audio(job.wav, SAMPLE_RATE)
            content = pool_content(dreamtalk_content(parts, audio), content_window)
            style = dreamtalk_style(parts, load_expression(job.coeffs))
        except Exception as e:  # noqa: BLE001 - collected and reported with the utterance id
            yield job.uid, None, f"{job.uid}: {type(e).__name__}: {e}"
            continue
        yield job.uid, {"video_content": content, "video_style": style}, None


def _meta(parts: Any, content_window: str, coeffs: Path) -> dict[str, dict[str, Any]]:
    common = {"generator": "DreamTalk", **(getattr(parts, "meta", None) or {})}
    w = 2 * int(parts.win_size) + 1
    layout = {"center": f"[T, d_model]: window position {parts.win_size} (the frame's own) of each frame",
              "mean": f"[T, d_model]: mean over the {w} window positions of each frame",
              "full": f"[T, {w} * d_model]: the {w} window positions of each frame, window-major"}
    layout = layout[content_window]
    return {
        "video_content": {
            **common, "window": content_window, "win_size": int(parts.win_size), "window_len": w,
            "layout": layout, "fps": 25, "sample_rate": SAMPLE_RATE,
            "frames": "T = N_w2v // 2; frame t reads wav2vec2 vectors 2t-win_size..2t+win_size, zero outside",
            "method": "ContentW2VEncoder(windows of wav2vec2 last_hidden_state of RAW/media/{uid}.wav)",
        },
        "video_style": {
            **common, "coeffs": str(coeffs.resolve()), "style_max_len": int(parts.style_max_len),
            "method": f"StyleEncoder(first {parts.style_max_len} frames of coeff[:, 80:144], zero-padded "
                      "with pad_mask True at padding) of the utterance's own video coefficients",
        },
    }


def export_video_targets(
    raw: str | os.PathLike,
    out: str | os.PathLike,
    *,
    repo: str | os.PathLike | None = None,
    ckpt: str | os.PathLike | None = None,
    w2v: str | os.PathLike | None = None,
    coeffs: str | os.PathLike | None = None,
    splits: list[str] | None = None,
    dialogues: Iterable[Any] | None = None,
    device: str | None = None,
    progress: bool = True,
    parts: Any = None,
    content_window: str = "center",
    shard_size: int = 512,
) -> dict[str, int]:
    """Write video_content and video_style (source "dreamtalk") for every distinct utterance of RAW.

    `dialogues` (schema.Dialogue objects) replaces reading RAW's split files; media still come from RAW.
    `parts` (a `DreamTalkParts`-like object) replaces loading `repo`/`ckpt`/`w2v`. Utterance failures are
    collected and raised together as `TargetExportError`, nothing committed; bad arguments or missing files
    raise `UsageError`. Returns {kind: count}.
    """
    from tqdm import tqdm

    from empatheia_jax.data.targets import TargetWriter

    if content_window not in CONTENT_WINDOWS:
        raise UsageError(f"unknown --content-window {content_window!r}; expected one of "
                         f"{', '.join(CONTENT_WINDOWS)}")
    if shard_size < 1:
        raise UsageError(f"--shard-size must be >= 1, got {shard_size}")
    if coeffs is None:
        raise UsageError("--coeffs DIR is required (Deep3DFaceRecon coefficients, one file per utterance)")
    if parts is None:
        for flag, value in (("--repo", repo), ("--ckpt", ckpt), ("--w2v", w2v)):
            if not value:
                raise UsageError(f"{flag} is required to load DreamTalk")
    jobs = video_jobs(raw, coeffs, splits, dialogues)
    if not jobs:
        raise UsageError(f"{raw}: no utterances to export")
    parts = parts or load_dreamtalk(repo, ckpt, w2v, device=device)
    meta = _meta(parts, content_window, Path(coeffs))
    if progress:
        print(f"[video targets] DreamTalk: {', '.join(KINDS)} ({content_window} window) for {len(jobs)} "
              f"utterances of {raw} -> {out}", file=sys.stderr)
    extra = {"raw": str(Path(raw).resolve())}
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        writers: dict[str, TargetWriter] = {}
        for uid, arrays, err in tqdm(_results(parts, jobs, content_window), total=len(jobs),
                                     desc="video targets (dreamtalk)", disable=not progress):
            if err:
                errors.append(err)
                continue
            for kind in KINDS:
                a = arrays[kind]
                if kind not in writers:  # dims come from the model (d_model, and the window for "full")
                    writers[kind] = stack.enter_context(TargetWriter(
                        out, kind, "dreamtalk", a.shape[-1], shard_size, {**extra, **meta[kind]}))
                writers[kind].add(uid, a)
        if errors:
            raise TargetExportError(f"{len(errors)} of {len(jobs)} utterance(s) failed; no targets written:\n"
                                    + "\n".join(errors))
    return {k: len(w) for k, w in writers.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m converters.dreamtalk_targets",
                                 description="Write the video_content and video_style targets of RAW with "
                                 "DreamTalk's own encoders.")
    ap.add_argument("--repo", required=True, help="a checkout of ali-vilab/dreamtalk")
    ap.add_argument("--ckpt", required=True,
                    help="denoising-network checkpoint (.pth that loads weights-only, or .safetensors)")
    ap.add_argument("--w2v", required=True,
                    help="local HF folder of wav2vec2-large-xlsr-53 (jonatasgrosman/wav2vec2-large-xlsr-53-"
                    "english, as DreamTalk uses)")
    ap.add_argument("--coeffs", required=True,
                    help="folder of Deep3DFaceRecon coefficients, {uid}.mat ('coeff') / .npy / .txt")
    ap.add_argument("--raw", required=True, help="RAW folder with {split}.json and media/")
    ap.add_argument("--out", required=True, help="TARGETS folder to write (other kinds there are kept)")
    ap.add_argument("--splits", default=None, help="comma-separated splits (default: every RAW split)")
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    ap.add_argument("--content-window", default="center", choices=CONTENT_WINDOWS,
                    help="video_content rows: the window's centre (default), its mean, or the full window")
    ap.add_argument("--shard-size", type=int, default=512)
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    args = ap.parse_args(argv)
    from empatheia_jax.data.schema import SchemaError

    t0 = time.perf_counter()
    try:
        counts = export_video_targets(
            args.raw, args.out, repo=args.repo, ckpt=args.ckpt, w2v=args.w2v, coeffs=args.coeffs,
            splits=[s for s in args.splits.split(",") if s] if args.splits else None, device=args.device,
            progress=not args.quiet, content_window=args.content_window, shard_size=args.shard_size,
        )
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SchemaError as e:
        print(f"error: {args.raw} does not follow the AvaMERG schema: {e}", file=sys.stderr)
        return 2
    except TargetExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"[video targets] wrote {counts} in {time.perf_counter() - t0:.1f}s to {args.out}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
