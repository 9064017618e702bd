"""The paper's encoders, `hubert` (audio) and `clip` (video): `transformers` models from local folders only.

Why together: both load a `transformers` model from a folder the user gives (no download), fingerprint its
config.json for the manifest, and run it in torch on the CPU with an optional thread count; those three
helpers are theirs alone. torch and transformers are imported in the constructors: importing this module
(which the package does, to register the names) stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.data.encoders.media import AudioInput, VideoInput, chunks, load_audio, read_video_rgb
from empatheia_jax.data.encoders.registry import Encoder, register_encoder


def _config_fingerprint(path: Path) -> str:
    cfg = path / "config.json"
    return hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.exists() else ""


def _local_folder(path: str | os.PathLike | None, what: str, arg: str) -> Path:
    if path is None:
        raise ValueError(f"the {what} encoder needs {arg}=<local folder with config.json + weights>")
    p = Path(path).expanduser().resolve()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{arg}={p}: no config.json there (downloads are disabled; give a local folder)"
        )
    return p


def _torch_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(int(n))


@register_encoder("hubert")
class HubertEncoder(Encoder):
    """HuBERT (paper's speech encoder): mean of the hidden states over time, per chunk.

    Preprocessing follows the folder's ``preprocessor_config.json`` (Wav2Vec2FeatureExtractor:
    resample to its rate, zero-mean/unit-variance if ``do_normalize``); without one, 16 kHz + normalise.
    ``hubert_layer`` picks ``hidden_states[layer]`` (default: the last hidden state).
    """

    modalities = ("audio",)

    def __init__(
        self,
        hubert_path: str | os.PathLike | None = None,
        k: int = 1,
        hubert_layer: int | None = None,
        torch_threads: int | None = None,
    ):
        import torch
        from transformers import HubertModel

        _torch_threads(torch_threads)
        self.path = _local_folder(hubert_path, "hubert", "hubert_path")
        self.k, self.layer = int(k), hubert_layer
        self.model = HubertModel.from_pretrained(self.path, local_files_only=True).eval().float()
        self.audio_dim = int(self.model.config.hidden_size)
        pre = self.path / "preprocessor_config.json"
        pcfg = json.loads(pre.read_text()) if pre.is_file() else {}
        self.sample_rate = int(pcfg.get("sampling_rate", 16000))
        self.do_normalize = bool(pcfg.get("do_normalize", True))
        self._torch = torch

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "k": self.k,
            "path": str(self.path),
            "layer": self.layer,
            "audio_dim": self.audio_dim,
            "sample_rate": self.sample_rate,
            "do_normalize": self.do_normalize,
            "config_sha256": _config_fingerprint(self.path),
        }

    def encode_audio(self, audio: AudioInput) -> np.ndarray:
        torch = self._torch
        x = load_audio(audio, self.sample_rate)
        if len(x) < 400:  # the conv front-end needs >= 1 output frame
            x = np.pad(x, (0, 400 - len(x)))
        if self.do_normalize:
            x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
        with torch.no_grad():
            out = self.model(
                torch.from_numpy(x[None].astype(np.float32)), output_hidden_states=self.layer is not None
            )
            h = out.last_hidden_state if self.layer is None else out.hidden_states[self.layer]
        h = h[0].numpy()
        return np.stack([h[sl].mean(0) for sl in chunks(len(h), self.k)]).astype(np.float32)


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@register_encoder("clip")
class ClipEncoder(Encoder):
    """CLIP vision tower (paper: ViT-L/14@336px) on evenly sampled frames: mean of pooled outputs per chunk.

    The image processor is re-implemented in torch (no PIL here) from the folder's
    ``preprocessor_config.json`` (shortest-edge bicubic resize, centre crop, rescale, normalise), or
    CLIP's fixed preprocessing at the model's ``image_size`` if the folder has none. Bicubic resizing
    may differ from PIL's in the last bits; with frames already at the model size it is exact.
    """

    modalities = ("video",)

    def __init__(
        self,
        clip_path: str | os.PathLike | None = None,
        k: int = 1,
        clip_frames: int = 8,
        torch_threads: int | None = None,
    ):
        import torch
        from transformers import CLIPVisionModel

        _torch_threads(torch_threads)
        self.path = _local_folder(clip_path, "clip", "clip_path")
        self.k, self.frames = int(k), int(clip_frames)
        if self.frames < self.k:
            raise ValueError(f"clip_frames={self.frames} must be >= k={self.k}")
        self.model = CLIPVisionModel.from_pretrained(self.path, local_files_only=True).eval().float()
        self.video_dim = int(self.model.config.hidden_size)
        size = int(self.model.config.image_size)
        pre = self.path / "preprocessor_config.json"
        p = json.loads(pre.read_text()) if pre.is_file() else {}
        s = p.get("size", size)
        self.resize = int(s.get("shortest_edge", s.get("height", size)) if isinstance(s, dict) else s)
        c = p.get("crop_size", size)
        self.crop = int(c.get("height", size) if isinstance(c, dict) else c)
        self.do_resize = bool(p.get("do_resize", True))
        self.do_crop = bool(p.get("do_center_crop", True))
        self.rescale = float(p.get("rescale_factor", 1 / 255)) if p.get("do_rescale", True) else 1.0
        self.do_normalize = bool(p.get("do_normalize", True))
        self.mean = tuple(p.get("image_mean", CLIP_MEAN))
        self.std = tuple(p.get("image_std", CLIP_STD))
        self._torch = torch

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "k": self.k,
            "path": str(self.path),
            "frames": self.frames,
            "video_dim": self.video_dim,
            "resize": self.resize,
            "crop": self.crop,
            "mean": list(self.mean),
            "std": list(self.std),
            "config_sha256": _config_fingerprint(self.path),
        }

    def preprocess(self, frames: np.ndarray) -> Any:
        """uint8 [F,H,W,3] -> normalised pixel_values [F,3,crop,crop] (torch float32)."""
        torch = self._torch
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
        if self.do_resize:
            h, w = x.shape[-2:]
            scale = self.resize / min(h, w)
            nh, nw = max(self.resize, round(h * scale)), max(self.resize, round(w * scale))
            if (nh, nw) != (h, w):
                x = (
                    torch.nn.functional.interpolate(
                        x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True
                    )
                    .clamp(0, 255)
                    .round()
                )
        if self.do_crop:
            h, w = x.shape[-2:]
            top, left = max((h - self.crop) // 2, 0), max((w - self.crop) // 2, 0)
            x = x[..., top : top + self.crop, left : left + self.crop]
        x = x * self.rescale
        if self.do_normalize:
            x = (x - torch.tensor(self.mean).view(1, 3, 1, 1)) / torch.tensor(self.std).view(1, 3, 1, 1)
        return x

    def encode_video(self, video: VideoInput) -> np.ndarray:
        torch = self._torch
        frames, _ = read_video_rgb(video, max_frames=self.frames)
        with torch.no_grad():
            pooled = self.model(pixel_values=self.preprocess(frames)).pooler_output.numpy()
        return np.stack([pooled[sl].mean(0) for sl in chunks(len(pooled), self.k)]).astype(np.float32)
