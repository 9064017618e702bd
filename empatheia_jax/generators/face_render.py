"""Procedural talking-face video: the control space a frame is drawn from, the renderer (`render_controls`,
`FaceRenderer`) and PyAV h264 encoding.

The face is a generator with two inputs, like DreamTalk: per-frame content (mouth opening, eyelids) and a
per-clip style (the avatar and its expression), Empatheia's video targets. It is drawn by `face_paint.py`;
the face users watch (`FaceRenderer`) is drawn at AVATAR_SIZE (256) with idle life (`face_idle.py`: head
sway and nod, breathing, blinks), so a listening avatar with flat controls is never frozen. The sample, its
targets and eval keep the still 128-pixel face, where a frame is exactly its controls. Encoding uses one
x264 thread and bit-exact muxing: the same inputs give a byte-identical .mp4.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from empatheia_jax.data.schema import AGES, GENDERS, TIMBRES
from empatheia_jax.generators.base import VideoGenerator, video_frames
from empatheia_jax.generators.face_idle import render_idle
from empatheia_jax.generators.face_paint import (
    BLINK_LEVELS,
    EXPRESSIONS,
    HAIR_COLOURS,
    MOUTH_LEVELS,
    SKIN_TONES,
    profile_id,
    still_parts,
)
from empatheia_jax.generators.speech_synth import FRAME_RATE, STYLES, check_profile, read_wav

DEFAULT_SIZE = 128  # the sample, its targets and eval: unchanged so their bytes and figures hold
AVATAR_SIZE = 256  # the face users watch (`FaceRenderer`: chat --avatar, converters.synthesize)

# ---------------------------------------------------------------------------------------------------------
# The control space: everything a frame is drawn from, as Empatheia's video targets (docs/design.md "Video
# out"). The renderer is a generator with two inputs, like DreamTalk: per-frame content and a per-clip style.

CONTENT_DIM = STYLE_DIM = 256
CONTENT_MOUTH, CONTENT_BLINK = 0, 1
"""video_content [T, 256] per 25-fps frame: dim 0 = mouth opening in [0, 1] (drawn at MOUTH_LEVELS steps),
dim 1 = eyelid closure (0 open, 0.6 half, 1 closed: the three drawn states); dims 2-255 are zero (reserved
for head motion, which no control draws: the user-facing avatar's idle motion is the renderer's own)."""
CONTENT_USED = 2
"""The leading video_content dims `render_controls` reads (the model's `EmpatheiaConfig.cv_dims`)."""
_PALETTE = SKIN_TONES  # skin index = ID % 5, hair index = (ID // 5) % 5: the ID's whole visible effect
STYLE_GROUPS: dict[str, tuple[int, tuple]] = {
    "age": (0, AGES), "gender": (4, GENDERS), "timbre": (6, TIMBRES), "emotion": (9, STYLES),
    "skin": (18, tuple(range(_PALETTE))), "hair": (23, tuple(range(HAIR_COLOURS))),
    "iris": (28, ("brown", "blue")),
}
"""video_style [256]: one-hot groups (offset, classes): age 0-3, gender 4-5, timbre (shirt colour) 6-8,
expression 9-17 (EMOTIONS_7, neutral, empathetic), skin tone 18-22, hair colour 23-27, iris 28-29 (the
profile ID's whole visible effect: skin = ID % 5, hair = (ID // 5) % 5, blue iris iff ID % 3 == 0); dims
30-255 zero. Decoding takes the argmax of each group, so a predicted style renders as the nearest avatar."""


class ControlError(ValueError):
    """Controls of the wrong shape or holding NaN/inf."""


def _blink_state(i: int, pid: int, fps: int) -> int:
    """0 open, 1 half, 2 closed: a 4-frame blink about every 3.4 s, phase from the avatar ID."""
    period = int(3.4 * fps)
    k = (i + 7 * pid + fps // 2) % period
    return {0: 1, 1: 2, 2: 2, 3: 1}.get(k, 0)


def face_controls(envelope_per_frame: np.ndarray, profile: dict, emotion: str, fps: int = FRAME_RATE,
                  smooth: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(content [T, 256], style [256]): the complete description of the clip `render_frames` draws.

    `smooth` holds a loud frame's opening into the next (an RMS envelope snaps shut within a frame; a
    mouth does not); a track that is already a mouth (`visemes.mouth_track`, its bilabial closures
    included) passes smooth=False and is only quantized to the drawn levels."""
    age, gender, timbre = check_profile(profile)
    if emotion not in EXPRESSIONS:
        raise ValueError(f"emotion {emotion!r} is not one of {STYLES}")
    pid = profile_id(profile)
    env = np.clip(np.nan_to_num(np.asarray(envelope_per_frame, np.float64)), 0.0, 1.0)
    # light smoothing: a mouth does not snap shut within one 40 ms frame
    if smooth and env.size > 2:
        env = np.maximum(env, 0.6 * np.concatenate([[0.0], env[:-1]]))
    content = np.zeros((env.size, CONTENT_DIM), np.float32)
    content[:, CONTENT_MOUTH] = np.round(env * (MOUTH_LEVELS - 1)) / (MOUTH_LEVELS - 1)
    content[:, CONTENT_BLINK] = [BLINK_LEVELS[_blink_state(i, pid, fps)] for i in range(env.size)]
    style = np.zeros(STYLE_DIM, np.float32)
    values = {"age": age, "gender": gender, "timbre": timbre, "emotion": emotion, "skin": pid % _PALETTE,
              "hair": (pid // _PALETTE) % HAIR_COLOURS, "iris": "blue" if pid % 3 == 0 else "brown"}
    for name, (offset, classes) in STYLE_GROUPS.items():
        style[offset + classes.index(values[name])] = 1.0
    return content, style


def decode_style(style: np.ndarray) -> dict[str, Any]:
    """The avatar a style vector draws: {age, gender, timbre, emotion, skin, hair, ID} (argmax per group)."""
    style = np.asarray(style, np.float32).reshape(-1)
    if style.shape != (STYLE_DIM,) or not np.isfinite(style).all():
        raise ControlError(f"video style must be {STYLE_DIM} finite values, got shape {list(style.shape)}")
    out = {name: classes[int(np.argmax(style[offset: offset + len(classes)]))]
           for name, (offset, classes) in STYLE_GROUPS.items()}
    blue = out["iris"] == "blue"
    out["ID"] = next(i for i in range(3 * _PALETTE * HAIR_COLOURS) if i % _PALETTE == out["skin"]
                     and (i // _PALETTE) % HAIR_COLOURS == out["hair"] and (i % 3 == 0) == blue)
    return out


def render_controls(content: np.ndarray, style: np.ndarray, size: int = DEFAULT_SIZE, idle: bool = False
                    ) -> np.ndarray:
    """uint8 RGB frames [T, size, size, 3] drawn from controls (gold or predicted): the generator proper.

    `idle` adds the avatar's idle life (`idle_life`: head sway and nod, breathing, blinks OR'ed with the
    eyelid control) for the face users watch; the mouth still follows the content exactly. Without it
    (the sample, targets and eval) a frame is exactly its controls, pixel for pixel."""
    content = np.asarray(content, np.float32)
    if content.ndim != 2 or content.shape[1] < 2 or len(content) == 0 or not np.isfinite(content).all():
        raise ControlError(f"video content must be finite [T>0, {CONTENT_DIM}], "
                           f"got shape {list(content.shape)}")
    if size % 2:
        raise ValueError("size must be even (yuv420p)")
    avatar = decode_style(style)
    levels = np.round(content[:, CONTENT_MOUTH] * (MOUTH_LEVELS - 1))
    levels = np.clip(levels, 0, MOUTH_LEVELS - 1).astype(int)
    blinks = np.abs(content[:, CONTENT_BLINK, None] - np.asarray(BLINK_LEVELS)[None]).argmin(1)
    if idle:
        return render_idle(avatar, levels, blinks, size)
    eyes, mouths, (y0, y1, x0, x1) = still_parts(avatar["age"], avatar["gender"], avatar["timbre"],
                                                 avatar["ID"], avatar["emotion"], size)
    out = np.empty((len(content), size, size, 3), np.uint8)
    for i, (level, blink) in enumerate(zip(levels, blinks, strict=True)):
        out[i] = eyes[blink]
        out[i, y0:y1, x0:x1] = mouths[level]
    return out


def render_frames(envelope_per_frame: np.ndarray, profile: dict, emotion: str, fps: int = FRAME_RATE,
                  size: int = DEFAULT_SIZE) -> np.ndarray:
    """uint8 RGB frames [T, size, size, 3]: the avatar of `profile` with `emotion`, mouth opening
    following `envelope_per_frame` (values in [0, 1], one per frame), through `face_controls` and
    `render_controls`."""
    return render_controls(*face_controls(envelope_per_frame, profile, emotion, fps), size=size)


def encode_mp4(frames: np.ndarray, path: str | os.PathLike, fps: int = FRAME_RATE, crf: int = 20,
               audio: tuple[np.ndarray, int] | None = None) -> None:
    """h264 yuv420p .mp4 with one encoder thread and bit-exact muxing, so bytes are reproducible; with
    `audio` = (mono int16 samples, sample rate) an AAC track is muxed in (the avatar with its voice)."""
    import av

    frames = np.asarray(frames, np.uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise ValueError(f"frames must be [T>0, H, W, 3] uint8, got {frames.shape}")
    with av.open(str(path), "w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": str(crf), "preset": "veryfast",
                                                                    "tune": "zerolatency"})
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1  # thread count is written into the stream; keep it fixed
        if audio is not None:  # every stream is added before the first packet is muxed
            samples, rate = np.asarray(audio[0], "<i2"), int(audio[1])
            track = container.add_stream("aac", rate=rate, layout="mono")
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = rate
            for packet in [*track.encode(frame), *track.encode(None)]:
                container.mux(packet)
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def render_face_video(envelope_per_frame: np.ndarray, profile: dict, emotion: str, path: str | os.PathLike,
                      fps: int = FRAME_RATE, size: int = DEFAULT_SIZE) -> int:
    """Render and encode the talking face to `path` (.mp4); returns the number of frames.

    One frame per envelope value, so a clip from `speech_envelope(wav)` lasts exactly as long as
    the wav from `synthesize_speech`.
    """
    frames = render_frames(envelope_per_frame, profile, emotion, fps=fps, size=size)
    encode_mp4(frames, path, fps=fps)
    return len(frames)


def frame_count(n_samples: int, sample_rate: int, fps: int = FRAME_RATE) -> int:
    """Video frames of `n_samples` of audio: ceil(n_samples x fps / sample_rate), at least one. The one rule
    for how long a clip of speech lasts on screen (`FaceRenderer.render`, `visemes.mouth_track`)."""
    return max(1, -(-int(n_samples) * fps // sample_rate))


class FaceRenderer(VideoGenerator):
    """The procedural face generator drawing predicted controls (mouth, eyelids per frame; avatar and
    expression per clip) at 25 fps, as many frames as the spoken reply lasts, with that speech muxed in.
    This is the face users watch: AVATAR_SIZE pixels square, with idle life (`render_controls(idle=True)`)."""

    name = "face_render"
    description = "the procedural face generator"
    how = "python -m converters.face_targets exports its controls"
    fps = FRAME_RATE

    @classmethod
    def avatar_style(cls, profile: dict[str, str], style: str) -> tuple[np.ndarray, float]:
        """The one-hot groups of that avatar and expression (`face_controls`' style); rate 1.

        A profile without an ID is drawn as the avatar the corpora give it (`ed.combo_index`: the sample
        and ED have one identity per profile), so the pinned listener looks like the person the model saw
        answer with that profile, not one stock identity (skin, hair, iris) for all 24 (docs/design.md)."""
        from empatheia_jax.data.ed import combo_index

        age, gender, timbre = check_profile(profile)
        who = {"ID": combo_index(age, gender, timbre), **profile}
        return face_controls(np.zeros(1), who, style)[1], 1.0

    @classmethod
    def expressed(cls, style_vector: np.ndarray, style: str) -> np.ndarray:
        """The predicted avatar (every group but the expression, as predicted) with `style`'s expression."""
        if style not in EXPRESSIONS:
            raise ValueError(f"expression {style!r} is not one of {STYLES}")
        decode_style(style_vector)  # the shape and finiteness check
        out = np.array(style_vector, np.float32).reshape(-1)
        offset, classes = STYLE_GROUPS["emotion"]
        out[offset: offset + len(classes)] = 0.0
        out[offset + classes.index(style)] = 1.0
        return out

    def render(self, content: np.ndarray, style: np.ndarray, wav: str | os.PathLike, out
               ) -> tuple[int, list[str]]:
        sr, samples = read_wav(wav)
        n_frames = frame_count(len(samples), sr, self.fps)
        content, notes = video_frames(content, n_frames)
        encode_mp4(render_controls(content, style, size=AVATAR_SIZE, idle=True), out, audio=(samples, sr))
        return n_frames, notes
