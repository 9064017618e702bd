"""Kokoro-82M as the registry's speech generator: what the bridge, eval and chat call for "kokoro" targets.

It sits apart from `kokoro.py` (the model: wheels, graph cuts, phonemes, synthesis) because it also reads the
voice map (`kokoro_voices.py`, which builds on the model) to pin a listener avatar.
"""

from __future__ import annotations

import numpy as np

from empatheia_jax.generators.base import GeneratorError, SpeechGenerator
from empatheia_jax.generators.kokoro import (
    CONTENT_DIM,
    SAMPLE_RATE,
    content_length,
    frames_of,
    phonemize,
    shared,
    token_ids,
)
from empatheia_jax.generators.kokoro_voices import voice


class KokoroSpeech(SpeechGenerator):
    """Kokoro-82M speaking predicted content and style, durations from its own prosody predictor (the
    predicted d_en rows and the prosodic half of S^s, as in StyleTTS2 inference)."""

    name = "kokoro"
    description = "Kokoro-82M"
    how = "python -m converters.styletts2_targets --backend kokoro exports its features"
    sample_rate = SAMPLE_RATE
    MAX_MEAN_FRAMES = 12.0
    """Cap on the mean predicted duration: 12 frames of 25 ms = 0.3 s per phoneme row, 3.5x Kokoro's mean on
    the sample's English (3.4 frames; the slowest voice, sad at speed 0.8, ~4.3). Real speech never reaches
    it; an untrained model's features reached 10x the expected length (15 s of decoding per reply)."""

    def __init__(self, threads: int = 1):
        self.threads = threads

    num_units = 178  # pad 0 and the vocabulary's ids 1..177 (114 symbols; tests/test_kokoro.py checks it)

    @classmethod
    def content_rows(cls, text: str) -> int:
        """One row per phoneme token plus the two boundary pads."""
        return content_length(phonemize(text))

    @classmethod
    def content_units(cls, text: str) -> np.ndarray:
        """The row layout itself: `[0, *token_ids(phonemize(text)), 0]`."""
        return np.concatenate([[0], token_ids(phonemize(text)), [0]]).astype(np.int32)

    @classmethod
    def avatar_style(cls, profile: dict[str, str], style: str) -> tuple[np.ndarray, float]:
        """The voice map's vector and speaking rate (`kokoro_voices.voice`)."""
        v = voice(profile, style)
        return v.style, v.speed

    def speak(self, content: np.ndarray, style: np.ndarray, rows: int, speed: float = 1.0) -> np.ndarray:
        content = np.asarray(content, np.float32)
        if content.ndim != 2 or content.shape[1] != CONTENT_DIM:
            raise GeneratorError(f"speech_content must be [rows, {CONTENT_DIM}], got {list(content.shape)}")
        return shared(self.threads).synthesize(content[:rows], style, speed,
                                               max_mean_frames=self.MAX_MEAN_FRAMES)

    def frame_units(self, content: np.ndarray, style: np.ndarray, rows: int, speed: float,
                    row_units: np.ndarray, fps: int = 25) -> np.ndarray:
        """`visemes.row_frame_units` of `row_units` on the durations `speak` uses (the same cap)."""
        from empatheia_jax.generators import visemes  # its face_render import is heavy for speech-only users

        content = np.asarray(content, np.float32)[:rows]
        durations = shared(self.threads).capped_durations(content, style, speed, self.MAX_MEAN_FRAMES)
        return visemes.row_frame_units(np.asarray(row_units)[:rows], frames_of(durations), fps=fps)
