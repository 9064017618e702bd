"""The small interface every output generator implements, so synthesis, eval and chat never name one.

A generator reads the feature kind the heads predict for its modality (speech: C^s/S^s, video: C^v/S^v)
and whose targets were exported from it: `name` is that target source, as meta.json records it. Speech
generators return a waveform; video generators draw frames into an mp4 with the reply's speech.
`registry.py` maps names to classes; a generator outside the library (the DreamTalk bridge in
converters/) registers itself the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import numpy as np


class GeneratorError(ValueError):
    """Features a generator cannot use: another target source, wrong shapes or row counts; names the file."""


class Generator(ABC):
    """One output generator. Options (threads, checkpoint paths) go to the constructor."""

    name: ClassVar[str]  # the target source it reads ("kokoro", "face_render", ...)
    modality: ClassVar[str]  # "speech" or "video"
    description: ClassVar[str]  # what a person calls it, for messages
    how: ClassVar[str]  # how a user gets targets of this source

    @classmethod
    def content_rows(cls, text: str) -> int | None:
        """Rows of content this generator reads for a reply `text` (T_ph), or None if it cannot count them."""
        return None

    num_units: ClassVar[int] = 0
    """Size of the unit vocabulary of `content_units` (0: the generator has no content units)."""

    @classmethod
    def content_units(cls, text: str) -> np.ndarray | None:
        """One unit id per content row of a reply `text` (Kokoro: its phoneme tokens with the two pads), what
        a unit-aligned Content Synchronizer is told each row stands for; None if the generator has none."""
        return None

    @classmethod
    def avatar_style(cls, profile: dict[str, str], style: str) -> tuple[np.ndarray, float]:
        """(style vector, speaking rate) of the avatar `profile` ({age, gender, timbre}) in `style` (an
        emotion of `speech_synth.STYLES`): what `chat --listener` pins in place of the predicted S^m.

        Only a generator whose style targets are CHOSEN from labels has such a map (Kokoro's voice map, the
        face generator's one-hots); one whose style is measured from media (StyleTTS2's style encoder,
        DreamTalk's) has no vector for a profile it never heard, so it refuses.
        """
        raise GeneratorError(f"{cls.description} has no avatar map (its style targets are measured from "
                             "media, not chosen from the profile), so it cannot pin a --listener avatar")

    @classmethod
    def expressed(cls, style_vector: np.ndarray, style: str) -> np.ndarray:
        """The predicted style `style_vector` showing the expression of `style` (an emotion of
        `speech_synth.STYLES`): the avatar without a pinned --listener keeps the SD's prediction of WHO it is
        and shows the reply's emotion, as the pinned one does. A generator whose style vector does not hold
        the expression apart from the identity keeps the predicted vector: Kokoro's voice map puts an
        emotion's pitch on the direction an age's pitch also moves along, and a measured style (StyleTTS2's,
        DreamTalk's) has no expression coordinate at all."""
        return np.asarray(style_vector)


class SpeechGenerator(Generator):
    modality = "speech"
    sample_rate: ClassVar[int]

    @abstractmethod
    def speak(self, content: np.ndarray, style: np.ndarray, rows: int, speed: float = 1.0) -> np.ndarray:
        """float32 audio at `sample_rate` from the first `rows` content rows and the style vector."""

    def frame_units(self, content: np.ndarray, style: np.ndarray, rows: int, speed: float,
                    row_units: np.ndarray, fps: int = 25) -> np.ndarray | None:
        """The unit id per video frame (at `fps`) of the audio `speak(content, style, rows, speed)` gives:
        `row_units` [rows] laid on the durations it speaks the rows with, what a unit-aligned video block
        (`cv_units`) renders after the speech; None for a generator that cannot say when each row sounds."""
        return None


class VideoGenerator(Generator):
    modality = "video"
    fps: ClassVar[int] = 25

    @abstractmethod
    def render(self, content: np.ndarray, style: np.ndarray, wav: str | Path, out: Path
               ) -> tuple[int, list[str]]:
        """Draws the talking face for the speech in `wav` into the mp4 `out`; (frames, notes)."""


def video_frames(content: np.ndarray, n_frames: int) -> tuple[np.ndarray, list[str]]:
    """The first `n_frames` predicted video_content rows (as many as the spoken reply lasts), zero rows
    (mouth closed, face still) past the ones the model predicts."""
    notes = []
    if n_frames > len(content):
        notes.append(f"the reply lasts {n_frames} frames but the model predicts {len(content)} "
                     "(config.data.max_video_len); the face holds still with its mouth closed after that")
        rest = np.zeros((n_frames - len(content), content.shape[1]), np.float32)
        content = np.concatenate([content, rest])
    return content[:n_frames], notes
