"""Idle life of the user-facing avatar (`render_controls(idle=True)`, `FaceRenderer`): head sway and nod,
breathing, natural blinks, on a deterministic schedule per avatar.

The renderer's own, not a control (docs/design.md "Video out"): the avatar is painted by the still face's
strokes onto three layers (back hair, torso, head with each eyelid state and mouth level) that move by the
schedule, so a listening avatar with flat controls is never frozen while its mouth follows the content.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from empatheia_jax.generators.face_paint import (
    BLINK_LEVELS,
    MOUTH_LEVELS,
    Canvas,
    background_image,
    draw_eyes,
    draw_mouth,
    mouth_opening,
    mouth_slice,
    paint_base,
    to_u8,
)
from empatheia_jax.generators.speech_synth import FRAME_RATE

IDLE_SWAY = 0.015  # head sway amplitude, fraction of the frame size (3.8 px at 256)
IDLE_NOD = 0.01  # head nod amplitude (2.6 px at 256)
IDLE_BREATH = 0.01  # torso rise per breath (2.6 px at 256); the head rides half of it
BREATH_HZ = 0.25
BLINK_EVERY = (3.0, 5.0)  # seconds between idle blinks, uniform
_BLINK_SHAPE = (1, 2, 2, 1)  # eyelid states of one blink (half, closed, closed, half)
_IDLE_SALT = 0x1D1E  # idle schedules draw from their own stream, not one a test might seed with the ID


@dataclass(frozen=True)
class IdleLife:
    """Per-frame idle motion in pixels (+x right, +y down) and idle eyelid states (BLINK_LEVELS indices)."""

    head_dx: np.ndarray
    head_dy: np.ndarray
    torso_dy: np.ndarray
    blink: np.ndarray


def idle_life(n_frames: int, avatar_id: int, size: int, fps: int = FRAME_RATE) -> IdleLife:
    """The idle schedule of one avatar: slow sway (periods 6.1 s and 2.3 s) and nod (4.3 s) with phases from
    the avatar ID, breathing at BREATH_HZ, and 4-frame blinks every BLINK_EVERY s (the first within 0.8-2.5
    s) from a generator seeded with the ID: deterministic, different between avatars, never frozen."""
    rng = np.random.default_rng([_IDLE_SALT, int(avatar_id)])
    phase = rng.uniform(0, 2 * np.pi, 4)
    t = np.arange(n_frames, dtype=np.float64) / fps
    two_pi = 2 * np.pi
    sway = IDLE_SWAY * size * (0.75 * np.sin(two_pi * t / 6.1 + phase[0]) + 0.25 * np.sin(two_pi * t / 2.3
                                                                                            + phase[1]))
    nod = IDLE_NOD * size * np.sin(two_pi * t / 4.3 + phase[2])
    breath = IDLE_BREATH * size * 0.5 * (1 - np.cos(two_pi * BREATH_HZ * t + phase[3]))
    blink = np.zeros(n_frames, np.int64)
    start = rng.uniform(0.8, 2.5)
    while start * fps < n_frames:
        i = int(round(start * fps))
        shape = _BLINK_SHAPE[: max(0, n_frames - i)]
        blink[i: i + len(shape)] = shape
        start += rng.uniform(*BLINK_EVERY)
    return IdleLife(head_dx=sway, head_dy=nod - 0.5 * breath, torso_dy=-breath, blink=blink)


def _margin(size: int) -> int:
    """Layer border beyond the frame, so a moved layer brings its own pixels in at the frame edges."""
    return int(np.ceil(0.05 * size)) + 2


def _sprite(layer: np.ndarray, m: int, alpha_of: np.ndarray | None = None) -> tuple[np.ndarray, int, int]:
    """(premultiplied RGBA crop with a 1-pixel transparent border, frame row, frame column of the crop's
    first pixel inside the border): the layer cut to where it (or `alpha_of`) is not transparent."""
    alpha = (layer if alpha_of is None else alpha_of)[..., 3] > 0
    rows, cols = np.flatnonzero(alpha.any(1)), np.flatnonzero(alpha.any(0))
    r0, r1, c0, c1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    return np.pad(layer[r0:r1, c0:c1], ((1, 1), (1, 1), (0, 0))), int(r0) - m, int(c0) - m


@lru_cache(maxsize=8)
def _idle_parts(age: str, gender: str, timbre: str, pid: int, emotion: str, size: int):
    """The avatar as layers for idle motion: background (RGB), back hair, torso, and the head with each
    eyelid state and each mouth level (premultiplied RGBA sprites), drawn by the still face's own strokes."""
    profile = {"age": age, "gender": gender, "timbre": timbre, "ID": pid}
    m = _margin(size)
    side = size + 2 * m
    back, torso, head = (Canvas(np.zeros((side, side, 4), np.float32), -m, -m) for _ in range(3))
    paint_base(back, torso, head, profile, emotion, size)
    heads = []
    for blink in BLINK_LEVELS:
        cv = Canvas(head.img.copy(), -m, -m)
        draw_eyes(cv, profile, emotion, blink, size)
        heads.append(cv.img)
    y0, y1, x0, x1 = mouth_slice(age, size)
    mouths = []
    for level in range(MOUTH_LEVELS):
        crop = heads[0][y0 + m: y1 + m, x0 + m: x1 + m].copy()
        draw_mouth(Canvas(crop, x0, y0), profile, emotion, mouth_opening(emotion, level), size)
        mouths.append(crop)
    union = np.maximum.reduce(heads)  # the sprite box holds every eyelid state and the whole mouth box
    union[y0 + m: y1 + m, x0 + m: x1 + m, 3] = 1.0
    head_sprites = [_sprite(h, m, union) for h in heads]
    hy, hx = head_sprites[0][1:]
    mouth_at = (y0 - hy + 1, y1 - hy + 1, x0 - hx + 1, x1 - hx + 1)  # in the head sprite, border included
    back_sprite = _sprite(back.img, m) if back.img[..., 3].any() else None
    return (background_image(size), back_sprite, _sprite(torso.img, m), [h[0] for h in head_sprites],
            (hy, hx), mouths, mouth_at)


def _over(frame: np.ndarray, sprite: np.ndarray, row: int, col: int, dy: float, dx: float) -> None:
    """Composite a bordered premultiplied sprite whose first pixel sits at (row, col) onto `frame`, moved by
    (dy, dx) pixels: integer placement plus a bilinear sub-pixel shift of the sprite alone."""
    iy, ix = int(np.floor(dy)), int(np.floor(dx))
    fy, fx = np.float32(dy - iy), np.float32(dx - ix)
    a = sprite[:, 1:] * (1 - fx) + sprite[:, :-1] * fx
    b = a[1:] * (1 - fy) + a[:-1] * fy  # [h + 1, w + 1], b[0, 0] lands on (row + iy, col + ix)
    top, left = row + iy, col + ix
    h, w = frame.shape[:2]
    r0, r1, c0, c1 = max(top, 0), min(top + b.shape[0], h), max(left, 0), min(left + b.shape[1], w)
    if r0 >= r1 or c0 >= c1:
        return
    b = b[r0 - top: r1 - top, c0 - left: c1 - left]
    region = frame[r0:r1, c0:c1]
    region *= 1 - b[..., 3:]
    region += b[..., :3]


def render_idle(avatar: dict[str, Any], levels: np.ndarray, blinks: np.ndarray, size: int) -> np.ndarray:
    """Frames of the idle avatar: mouth levels exactly as given, eyelids = the controls' OR the idle
    blinks (the more closed state), head, back hair and torso moved by `idle_life`."""
    background, back, torso, heads, (hy, hx), mouths, (my0, my1, mx0, mx1) = _idle_parts(
        avatar["age"], avatar["gender"], avatar["timbre"], avatar["ID"], avatar["emotion"], size)
    life = idle_life(len(levels), avatar["ID"], size)
    blinks = np.maximum(blinks, life.blink)
    composed: dict[tuple[int, int], np.ndarray] = {}
    out = np.empty((len(levels), size, size, 3), np.uint8)
    for i, (level, blink) in enumerate(zip(levels.tolist(), blinks.tolist(), strict=True)):
        head = composed.get((blink, level))
        if head is None:
            head = composed[(blink, level)] = heads[blink].copy()
            head[my0:my1, mx0:mx1] = mouths[level]
        frame = background.copy()
        if back is not None:
            _over(frame, *back, life.head_dy[i], life.head_dx[i])
        _over(frame, *torso, life.torso_dy[i], 0.0)
        _over(frame, head, hy, hx, life.head_dy[i], life.head_dx[i])
        out[i] = to_u8(frame)
    return out
