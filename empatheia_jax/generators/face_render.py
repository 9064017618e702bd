"""Procedural talking-face video for the AvaMERG-format sample: numpy drawing + PyAV h264.

Why procedural: the sample must carry real, controllable visual signal (who speaks, how they
feel, when they talk) without any model download. Every visual factor is tied to a label:

- age: face proportions (children: rounder face, bigger eyes), hair greying, wrinkles, glasses
  for the elderly;
- gender: long hair and fuller, redder lips (female) vs short hair, squarer jaw and thicker
  brows (male);
- timbre: shirt colour (low = navy, mid = teal, high = orange);
- profile ID: skin tone and base hair colour (one avatar identity per ID);
- emotion: brows, eye openness, lid slant, mouth curvature/width/base opening, cheek blush,
  skin tint, tears, nose wrinkles, asymmetric mouth (`EXPRESSIONS`);
- speech: mouth opening per 40 ms frame follows the speech RMS envelope.

Frames are composed from cached parts (three blink states x 16 mouth openings per avatar and
expression), so rendering costs little next to encoding. Encoding uses one x264 thread and
bit-exact muxing: the same inputs give a byte-identical .mp4.

The face users watch (`FaceRenderer`) is drawn at AVATAR_SIZE (256) with idle life: the same strokes
painted on three layers (back hair, torso, head) that move by a deterministic schedule (`idle_life`:
head sway and nod, breathing, blinks), so a listening avatar with flat controls is never frozen. The
sample, its targets and eval keep the still 128-pixel face, where a frame is exactly its controls.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from empatheia_jax.data.schema import AGES, GENDERS, TIMBRES
from empatheia_jax.generators.base import VideoGenerator, video_frames
from empatheia_jax.generators.speech_synth import FRAME_RATE, STYLES, check_profile, read_wav

DEFAULT_SIZE = 128  # the sample, its targets and eval: unchanged so their bytes and figures hold
AVATAR_SIZE = 256  # the face users watch (`FaceRenderer`: chat --avatar, converters.synthesize)
MOUTH_LEVELS = 16
_ZOOM = 1.2  # face size relative to a 128-pixel frame; the shoulders fill the bottom


@dataclass(frozen=True)
class Expression:
    """Facial configuration of one emotion; lengths are in units of the face half-width."""

    brow_inner: float = 0.0  # + raises the inner brow end
    brow_outer: float = 0.0
    brow_asym: float = 0.0  # extra raise of the right brow (contempt)
    eye_open: float = 1.0  # vertical eye opening factor
    lid_slant: float = 0.0  # + lowers the outer end of the upper lid (sad)
    mouth_curve: float = 0.0  # + corners up (smile), - corners down
    mouth_width: float = 1.0
    mouth_base_open: float = 0.0  # opening with no speech (surprise "O")
    mouth_asym: float = 0.0  # raise of the right mouth corner only (contempt)
    upper_lip_raise: float = 0.0  # disgust
    blush: float = 0.0
    tint: tuple[float, float, float] = (1.0, 1.0, 1.0)  # skin colour multiplier
    tear: bool = False
    nose_wrinkle: bool = False


EXPRESSIONS: dict[str, Expression] = {
    "happy": Expression(brow_inner=0.03, brow_outer=0.05, eye_open=0.75, mouth_curve=0.16, mouth_width=1.2,
                        mouth_base_open=0.15, blush=0.55),
    "surprised": Expression(brow_inner=0.17, brow_outer=0.15, eye_open=1.5, mouth_width=0.72,
                            mouth_base_open=0.75),
    "angry": Expression(brow_inner=-0.14, brow_outer=0.05, eye_open=0.7, mouth_curve=-0.07, mouth_width=0.9,
                        tint=(1.12, 0.86, 0.84)),
    "fear": Expression(brow_inner=0.15, brow_outer=0.02, eye_open=1.4, mouth_curve=-0.05, mouth_width=1.25,
                       mouth_base_open=0.3, tint=(0.9, 0.95, 1.02)),
    "sad": Expression(brow_inner=0.12, brow_outer=-0.07, eye_open=0.65, lid_slant=0.5, mouth_curve=-0.14,
                      mouth_width=0.9, tint=(0.93, 0.95, 1.04), tear=True),
    "disgusted": Expression(brow_inner=-0.09, brow_outer=-0.03, eye_open=0.6, mouth_curve=-0.06,
                            upper_lip_raise=1.0, tint=(0.94, 1.02, 0.88), nose_wrinkle=True),
    "contempt": Expression(brow_asym=0.09, eye_open=0.85, mouth_width=0.95, mouth_asym=0.14),
    "neutral": Expression(),
    "empathetic": Expression(brow_inner=0.07, brow_outer=0.0, eye_open=0.95, mouth_curve=0.06, blush=0.2),
}

_SKIN = np.array([(0.96, 0.82, 0.72), (0.90, 0.72, 0.58), (0.78, 0.58, 0.42), (0.60, 0.42, 0.30),
                  (0.42, 0.29, 0.21)], np.float32)
_HAIR = np.array([(0.08, 0.07, 0.07), (0.22, 0.14, 0.08), (0.40, 0.26, 0.14), (0.50, 0.22, 0.10),
                  (0.80, 0.66, 0.38)], np.float32)
_GREY = {"child": 0.0, "young": 0.0, "middle-aged": 0.35, "elderly": 0.9}
_SHIRT = {"low": (0.12, 0.16, 0.38), "mid": (0.10, 0.50, 0.46), "high": (0.92, 0.52, 0.14)}
_BACKGROUND = (0.86, 0.88, 0.90)


def _profile_id(profile: dict) -> int:
    try:
        return int(profile.get("ID", 0))
    except (TypeError, ValueError):
        return sum(str(profile.get("ID", "")).encode())


class _Canvas:
    """A float RGB image (or a view into one) with pixel-centre coordinates of the full frame."""

    def __init__(self, img: np.ndarray, x0: int = 0, y0: int = 0):
        self.img = img
        h, w = img.shape[:2]
        self.y, self.x = np.mgrid[y0: y0 + h, x0: x0 + w].astype(np.float32) + 0.5
        self.x0, self.y0 = x0, y0

    def sub(self, x0: float, y0: float, x1: float, y1: float) -> _Canvas:
        h, w = self.img.shape[:2]
        a = int(np.clip(np.floor(x0) - self.x0, 0, w))
        b = int(np.clip(np.ceil(x1) - self.x0, 0, w))
        c = int(np.clip(np.floor(y0) - self.y0, 0, h))
        d = int(np.clip(np.ceil(y1) - self.y0, 0, h))
        return _Canvas(self.img[c:d, a:b], self.x0 + a, self.y0 + c)

    def paint(self, alpha: np.ndarray, color) -> None:
        """Paint `color` with coverage `alpha`. On a premultiplied RGBA layer (4 channels) the same formula
        with colour (r, g, b, 1) is the "over" operator, so a layer composited later equals painting its
        strokes in place."""
        if self.img.size == 0:
            return
        alpha = np.clip(alpha, 0.0, 1.0)[..., None]
        color = np.asarray(color, np.float32)
        if self.img.shape[-1] == 4:
            color = np.append(color, np.float32(1.0))
        self.img += alpha * (color - self.img)

    def ellipse_alpha(self, cx, cy, a, b, p: float = 2.0) -> np.ndarray:
        """Anti-aliased coverage of a (super)ellipse; p > 2 gives a squarer outline."""
        r = (np.abs((self.x - cx) / a) ** p + np.abs((self.y - cy) / b) ** p) ** (1.0 / p)
        return np.clip((1.0 - r) * min(a, b) + 0.5, 0.0, 1.0)

    def ellipse(self, cx, cy, a, b, color, p: float = 2.0, alpha: float = 1.0) -> None:
        self.sub(cx - a - 1, cy - b - 1, cx + a + 1, cy + b + 1).paint_ellipse(cx, cy, a, b, color, p, alpha)

    def paint_ellipse(self, cx, cy, a, b, color, p, alpha) -> None:
        if self.img.size:
            self.paint(self.ellipse_alpha(cx, cy, a, b, p) * alpha, color)

    def stroke(self, pts, width: float, color, alpha: float = 1.0) -> None:
        """Polyline of the given width (pixels) through pts [(x, y), ...]."""
        pts = np.asarray(pts, np.float32)
        lo, hi = pts.min(0) - width - 1, pts.max(0) + width + 1
        sub = self.sub(lo[0], lo[1], hi[0], hi[1])
        if sub.img.size == 0:
            return
        d = np.full(sub.x.shape, np.inf, np.float32)
        for (ax, ay), (bx, by) in zip(pts[:-1], pts[1:], strict=True):
            vx, vy = bx - ax, by - ay
            t = np.clip(((sub.x - ax) * vx + (sub.y - ay) * vy) / max(vx * vx + vy * vy, 1e-6), 0, 1)
            d = np.minimum(d, np.hypot(sub.x - ax - t * vx, sub.y - ay - t * vy))
        sub.paint((width / 2 - d + 0.5) * alpha, color)


def _curve(x0, y0, x1, y1, bend, n: int = 8) -> list[tuple[float, float]]:
    """Quadratic curve from (x0, y0) to (x1, y1) whose middle is pushed up by `bend` pixels."""
    t = np.linspace(0, 1, n)
    mx, my = (x0 + x1) / 2, (y0 + y1) / 2 - 2 * bend
    xs = (1 - t) ** 2 * x0 + 2 * (1 - t) * t * mx + t**2 * x1
    ys = (1 - t) ** 2 * y0 + 2 * (1 - t) * t * my + t**2 * y1
    return list(zip(xs.tolist(), ys.tolist(), strict=True))


@dataclass(frozen=True)
class _Layout:
    s: float  # pixels per 128-frame unit
    cx: float
    cy: float
    fa: float  # face half-width
    fb: float  # face half-height
    eye_dx: float
    eye_y: float
    eye_w: float
    eye_h: float
    mouth_y: float
    mouth_w: float


def _layout(age: str, size: int) -> _Layout:
    s = size / 128.0 * _ZOOM
    child = age == "child"
    fa = (33.0 if child else 30.0) * s
    fb = (35.0 if child else 39.0) * s
    cy = size / 2 + (0.0 if child else -3.0) * s
    return _Layout(s=s, cx=size / 2, cy=cy, fa=fa, fb=fb, eye_dx=(13.0 if child else 12.5) * s,
                   eye_y=cy - (3.0 if child else 6.0) * s, eye_w=(8.0 if child else 7.0) * s,
                   eye_h=(5.2 if child else 4.2) * s, mouth_y=cy + (17.0 if child else 20.0) * s,
                   mouth_w=(9.0 if child else 10.5) * s)


def _colours(profile: dict, age: str, expr: Expression):
    pid = _profile_id(profile)
    skin = _SKIN[pid % len(_SKIN)] * np.asarray(expr.tint, np.float32)
    hair = _HAIR[(pid // len(_SKIN)) % len(_HAIR)]
    g = _GREY[age]
    hair = (1 - g) * hair + g * np.array([0.78, 0.78, 0.80], np.float32)
    return np.clip(skin, 0, 1), hair


def _background(size: int) -> np.ndarray:
    img = np.empty((size, size, 3), np.float32)
    img[:] = _BACKGROUND
    # vertical background gradient, darker at the bottom
    img *= (1.0 - 0.12 * np.linspace(0, 1, size, dtype=np.float32))[:, None, None]
    return img


def _draw_base(profile: dict, emotion: str, size: int) -> np.ndarray:
    """Everything except eyes and mouth, which change per frame, painted in place on the background."""
    img = _background(size)
    cv = _Canvas(img)
    _paint_base(cv, cv, cv, profile, emotion, size)
    return img


def _paint_base(back: _Canvas, torso: _Canvas, head: _Canvas, profile: dict, emotion: str, size: int) -> None:
    """The strokes of `_draw_base`, each on the canvas of the layer that carries it: `back` (long hair
    behind the shoulders), `torso` (shirt, neck) and `head` (the rest). The still face passes one canvas
    three times, so its pixels are exactly the sequential painting; the idle avatar passes three layers."""
    age, gender, timbre = check_profile(profile)
    expr = EXPRESSIONS[emotion]
    L = _layout(age, size)
    s, cx, cy, fa, fb = L.s, L.cx, L.cy, L.fa, L.fb
    lo, hi = -size, 2 * size  # "unbounded": a sub-canvas is clipped to its canvas, frame or layer
    skin, hair = _colours(profile, age, expr)
    shade = skin * 0.82
    female = gender == "female"
    if female:  # long hair behind the head and shoulders
        back.ellipse(cx, cy + 14 * s, fa + 9 * s, fb + 16 * s, hair)
    # shoulders, shirt, neck
    chin = cy + fb
    torso.ellipse(cx, chin + 34 * s, 58 * s, 30 * s, _SHIRT[timbre])
    torso.ellipse(cx, chin, 10 * s, 12 * s, shade)  # neck
    torso.ellipse(cx, chin + 5 * s, 10 * s, 5 * s, shade)  # collar opening
    cv = head
    # ears
    for side in (-1, 1):
        cv.ellipse(cx + side * (fa + 1.5 * s), L.eye_y + 5 * s, 4.5 * s, 7 * s, shade)
    # face: rounder for children, squarer jaw for men
    p = 2.0 if age == "child" else (2.7 if gender == "male" else 2.15)
    upper = cv.sub(lo, lo, hi, cy)
    upper.paint_ellipse(cx, cy, fa, fb, skin, 2.0, 1.0)
    lower = cv.sub(lo, cy, hi, hi)
    lower.paint_ellipse(cx, cy, fa, fb, skin, p, 1.0)
    # hair cap on top of the head
    bald = age == "elderly" and gender == "male"
    hairline = cy - fb * (0.55 if age != "child" else 0.5)
    cap = cv.sub(lo, lo, hi, hairline + 14 * s)
    # hairline curve: lowest at the temples
    edge = hairline + 12 * s * np.clip(np.abs(cap.x - cx) / fa, 0, 1) ** 4
    cap_alpha = cap.ellipse_alpha(cx, cy - 2 * s, fa + 3 * s, fb + 4 * s) * np.clip(edge - cap.y + 0.5, 0, 1)
    if bald:  # receding: keep only the sides
        cap_alpha *= np.clip((np.abs(cap.x - cx) - 0.6 * fa) / (3 * s), 0, 1)
    cap.paint(cap_alpha, hair)
    if female:  # fringe strands at the temples
        for side in (-1, 1):
            cv.ellipse(cx + side * (fa - 2 * s), cy - 6 * s, 4 * s, 16 * s, hair)
    # cheeks (blush) and skin tint already applied
    if expr.blush:
        for side in (-1, 1):
            cv.ellipse(cx + side * 16 * s, L.mouth_y - 8 * s, 6 * s, 4 * s, (0.95, 0.45, 0.45),
                       alpha=0.45 * expr.blush)
    # nose
    cv.stroke([(cx - 1 * s, L.eye_y + 3 * s), (cx - 2.5 * s, cy + 9 * s), (cx + 2 * s, cy + 10 * s)],
              1.2 * s, shade * 0.8)
    if expr.nose_wrinkle:
        for k in range(3):
            y = L.eye_y + (2 + 2.2 * k) * s
            cv.stroke([(cx - 3.5 * s, y), (cx + 3.5 * s, y + 0.5 * s)], 0.9 * s, shade * 0.7)
    # wrinkles by age
    lines = {"middle-aged": 1, "elderly": 3}.get(age, 0)
    for k in range(lines):
        y = hairline + (5 + 3.2 * k) * s
        cv.stroke(_curve(cx - 11 * s, y + 1 * s, cx + 11 * s, y + 1 * s, 1.0 * s), 0.8 * s, shade * 0.85)
    if age == "elderly":
        for side in (-1, 1):
            ex = cx + side * (L.eye_dx + L.eye_w + 2 * s)
            for k in (-1, 1):
                cv.stroke([(ex, L.eye_y), (ex + side * 4 * s, L.eye_y + k * 2.5 * s)], 0.7 * s, shade * 0.8)
            cv.stroke([(cx + side * 6 * s, cy + 9 * s), (cx + side * 13 * s, L.mouth_y + 3 * s)], 0.8 * s,
                      shade * 0.85)
    if expr.tear:
        cv.ellipse(cx + L.eye_dx + 2 * s, L.eye_y + L.eye_h + 6 * s, 1.6 * s, 2.6 * s, (0.55, 0.75, 0.98))


def _draw_eyes(cv: _Canvas, profile: dict, emotion: str, blink: float, size: int) -> None:
    """Eyes (with lids, iris, pupil), brows and glasses; blink in [0, 1] closes the lids."""
    age, gender, _ = check_profile(profile)
    expr = EXPRESSIONS[emotion]
    L = _layout(age, size)
    s, cx = L.s, L.cx
    skin, hair = _colours(profile, age, expr)
    openness = expr.eye_open * (1.0 - blink)
    iris = (0.25, 0.18, 0.12) if _profile_id(profile) % 3 else (0.25, 0.40, 0.55)
    for side in (-1, 1):  # side -1: image-left eye
        ex, ey = cx + side * L.eye_dx, L.eye_y
        w, h = L.eye_w, L.eye_h
        sub = cv.sub(ex - w - 2, ey - 2.2 * h - 2, ex + w + 2, ey + 2.2 * h + 2)
        top = h * min(openness, 1.6)
        bottom = h * min(0.75 + 0.25 * openness, 1.3) if blink < 1 else 0.0
        # upper lid line, slanting down at the outer end for sad lids
        lid = ey - top + expr.lid_slant * h * side * (sub.x - ex) / w
        dy = np.where(sub.y < ey, (sub.y - ey) / max(top, 1e-3), (sub.y - ey) / max(bottom, 1e-3))
        shape = np.clip((1.0 - np.hypot((sub.x - ex) / w, dy)) * h + 0.5, 0, 1)
        shape = shape * np.clip(sub.y - lid + 0.5, 0, 1)
        if openness < 0.08 or blink >= 1.0:
            shape = shape * 0.0
        sub.paint(shape, (0.97, 0.97, 0.95))
        ir = 0.62 * h * (1.15 if age == "child" else 1.0)
        r = np.hypot(sub.x - ex, sub.y - ey)
        sub.paint(shape * np.clip(ir - r + 0.5, 0, 1), iris)
        sub.paint(shape * np.clip(0.45 * ir - r + 0.5, 0, 1), (0.03, 0.03, 0.03))
        # lid edge / lashes: a dark curve along the upper boundary
        slant = expr.lid_slant * h * side
        cv.stroke([(ex - w, ey - slant), (ex - w / 2, ey - 0.9 * top - 0.5 * slant), (ex, ey - top),
                   (ex + w / 2, ey - 0.9 * top + 0.5 * slant), (ex + w, ey + slant)],
                  (1.3 if gender == "female" else 0.9) * s, (0.12, 0.08, 0.07))
        # brow: inner end near the nose, outer end at the temple
        raise_ = expr.brow_asym if side == 1 else 0.0
        by = ey - h - 4.0 * s
        inner = (ex - side * w * 0.9, by - (expr.brow_inner + raise_) * L.fa)
        outer = (ex + side * w * 1.1, by - (expr.brow_outer + raise_) * L.fa + 1.0 * s)
        thick = (2.6 if gender == "male" else 1.7) * s * (0.8 if age == "child" else 1.0)
        cv.stroke(_curve(inner[0], inner[1], outer[0], outer[1], 1.2 * s), thick, hair * 0.85)
        if age == "elderly":  # glasses
            cv.stroke([(ex + w * 1.25 * np.cos(a), ey + 1 * s + h * 1.7 * np.sin(a))
                       for a in np.linspace(0, 2 * np.pi, 25)], 1.0 * s, (0.15, 0.15, 0.18))
    if age == "elderly":
        cv.stroke([(cx - L.eye_dx + L.eye_w * 1.25, L.eye_y), (cx + L.eye_dx - L.eye_w * 1.25, L.eye_y)],
                  1.0 * s, (0.15, 0.15, 0.18))


def _mouth_box(L: _Layout) -> tuple[float, float, float, float]:
    return (L.cx - 1.6 * L.mouth_w - 3 * L.s, L.mouth_y - 0.6 * L.mouth_w - 4 * L.s,
            L.cx + 1.6 * L.mouth_w + 3 * L.s, L.mouth_y + 1.3 * L.mouth_w + 4 * L.s)


def _draw_mouth(cv: _Canvas, profile: dict, emotion: str, opening: float, size: int) -> None:
    """Lips and mouth cavity; opening in [0, 1] (1 = widest speaking mouth)."""
    age, gender, _ = check_profile(profile)
    expr = EXPRESSIONS[emotion]
    L = _layout(age, size)
    s, mx, my = L.s, L.cx, L.mouth_y
    w = L.mouth_w * expr.mouth_width
    open_px = (0.9 + 8.5 * opening) * s * (0.85 if expr.mouth_width > 1.1 else 1.0)
    t = np.clip((cv.x - mx) / w, -1.2, 1.2)
    inside = np.clip((1.0 - np.abs(t)) * w + 0.5, 0, 1)
    lift = expr.mouth_curve * L.fa * t**2 + expr.mouth_asym * L.fa * np.clip(t, 0, None) ** 2
    mid = my - lift
    hprof = np.sqrt(np.clip(1 - t**2, 0, 1))
    y_up = mid - 0.45 * open_px * hprof - expr.upper_lip_raise * 2.2 * s * hprof
    y_lo = mid + 0.55 * open_px * hprof
    female = gender == "female"
    lip = np.array((0.72, 0.25, 0.28) if female else (0.62, 0.34, 0.32), np.float32)
    skin, _ = _colours(profile, age, expr)
    lip = 0.75 * lip + 0.25 * skin
    thick_up = (1.9 if female else 1.4) * s * (0.5 + 0.5 * hprof)
    thick_lo = (2.6 if female else 2.0) * s * (0.5 + 0.5 * hprof)
    # lips: band from (y_up - thick_up) to (y_lo + thick_lo)
    lips = np.clip(cv.y - (y_up - thick_up) + 0.5, 0, 1) * np.clip((y_lo + thick_lo) - cv.y + 0.5, 0, 1)
    cv.paint(lips * inside, lip)
    cavity = np.clip(cv.y - y_up + 0.5, 0, 1) * np.clip(y_lo - cv.y + 0.5, 0, 1) * inside
    cavity = cavity * np.clip(open_px - 1.2 * s, 0, 1)
    cv.paint(cavity, (0.30, 0.06, 0.08))
    teeth = cavity * np.clip(y_up + 0.22 * open_px + 0.6 - cv.y, 0, 1)
    teeth = teeth * np.clip(0.85 * w - np.abs(cv.x - mx), 0, 1)
    cv.paint(teeth, (0.95, 0.94, 0.90))
    # the line where the lips meet (visible when closed)
    seam = np.clip(1.0 - np.abs(cv.y - mid) / (0.6 * s), 0, 1) * inside * np.clip(1.2 * s - open_px + 1, 0, 1)
    cv.paint(seam * 0.8, lip * 0.55)


@lru_cache(maxsize=64)
def _parts(age: str, gender: str, timbre: str, pid: int, emotion: str, size: int):
    """Cached frames for one avatar + expression: 3 blink states and MOUTH_LEVELS mouth crops."""
    profile = {"age": age, "gender": gender, "timbre": timbre, "ID": pid}
    base = _draw_base(profile, emotion, size)
    frames = []
    for blink in (0.0, 0.6, 1.0):
        f = base.copy()
        _draw_eyes(_Canvas(f), profile, emotion, blink, size)
        frames.append(f)
    y0, y1, x0, x1 = _mouth_slice(age, size)
    mouths = []
    for level in range(MOUTH_LEVELS):
        crop = frames[0][y0:y1, x0:x1].copy()
        _draw_mouth(_Canvas(crop, x0, y0), profile, emotion, _mouth_opening(emotion, level), size)
        mouths.append(_to_u8(crop))
    return [_to_u8(f) for f in frames], mouths, (y0, y1, x0, x1)


def _mouth_slice(age: str, size: int) -> tuple[int, int, int, int]:
    """(y0, y1, x0, x1): the frame pixels a mouth crop covers (the mouth box, clipped to the frame)."""
    x0, y0, x1, y1 = (int(np.floor(v)) for v in _mouth_box(_layout(age, size)))
    return max(y0, 0), min(y1 + 1, size), max(x0, 0), min(x1 + 1, size)


def _mouth_opening(emotion: str, level: int) -> float:
    """The drawn opening of mouth level `level`: the expression's resting opening up to the widest."""
    base_open = EXPRESSIONS[emotion].mouth_base_open
    return base_open + (1 - base_open) * level / (MOUTH_LEVELS - 1)


def _to_u8(img: np.ndarray) -> np.ndarray:
    return np.clip(np.round(img * 255.0), 0, 255).astype(np.uint8)


def _blink_state(i: int, pid: int, fps: int) -> int:
    """0 open, 1 half, 2 closed: a 4-frame blink about every 3.4 s, phase from the avatar ID."""
    period = int(3.4 * fps)
    k = (i + 7 * pid + fps // 2) % period
    return {0: 1, 1: 2, 2: 2, 3: 1}.get(k, 0)


# ---------------------------------------------------------------------------------------------------------
# Idle life of the user-facing avatar (`render_controls(idle=True)`, `FaceRenderer`): head sway and nod,
# breathing, natural blinks. The renderer's own, not a control: see docs/design.md "Video out".

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
    back, torso, head = (_Canvas(np.zeros((side, side, 4), np.float32), -m, -m) for _ in range(3))
    _paint_base(back, torso, head, profile, emotion, size)
    heads = []
    for blink in BLINK_LEVELS:
        cv = _Canvas(head.img.copy(), -m, -m)
        _draw_eyes(cv, profile, emotion, blink, size)
        heads.append(cv.img)
    y0, y1, x0, x1 = _mouth_slice(age, size)
    mouths = []
    for level in range(MOUTH_LEVELS):
        crop = heads[0][y0 + m: y1 + m, x0 + m: x1 + m].copy()
        _draw_mouth(_Canvas(crop, x0, y0), profile, emotion, _mouth_opening(emotion, level), size)
        mouths.append(crop)
    union = np.maximum.reduce(heads)  # the sprite box holds every eyelid state and the whole mouth box
    union[y0 + m: y1 + m, x0 + m: x1 + m, 3] = 1.0
    head_sprites = [_sprite(h, m, union) for h in heads]
    hy, hx = head_sprites[0][1:]
    mouth_at = (y0 - hy + 1, y1 - hy + 1, x0 - hx + 1, x1 - hx + 1)  # in the head sprite, border included
    back_sprite = _sprite(back.img, m) if back.img[..., 3].any() else None
    return (_background(size), back_sprite, _sprite(torso.img, m), [h[0] for h in head_sprites], (hy, hx),
            mouths, mouth_at)


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


def _render_idle(avatar: dict[str, Any], levels: np.ndarray, blinks: np.ndarray, size: int) -> np.ndarray:
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
        out[i] = _to_u8(frame)
    return out


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
BLINK_LEVELS = (0.0, 0.6, 1.0)
_PALETTE = len(_SKIN)  # skin index = ID % 5, hair index = (ID // 5) % 5: the ID's whole visible effect
STYLE_GROUPS: dict[str, tuple[int, tuple]] = {
    "age": (0, AGES), "gender": (4, GENDERS), "timbre": (6, TIMBRES), "emotion": (9, STYLES),
    "skin": (18, tuple(range(_PALETTE))), "hair": (23, tuple(range(len(_HAIR)))),
    "iris": (28, ("brown", "blue")),
}
"""video_style [256]: one-hot groups (offset, classes): age 0-3, gender 4-5, timbre (shirt colour) 6-8,
expression 9-17 (EMOTIONS_7, neutral, empathetic), skin tone 18-22, hair colour 23-27, iris 28-29 (the
profile ID's whole visible effect: skin = ID % 5, hair = (ID // 5) % 5, blue iris iff ID % 3 == 0); dims
30-255 zero. Decoding takes the argmax of each group, so a predicted style renders as the nearest avatar."""


class ControlError(ValueError):
    """Controls of the wrong shape or holding NaN/inf."""


def face_controls(envelope_per_frame: np.ndarray, profile: dict, emotion: str, fps: int = FRAME_RATE,
                  smooth: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(content [T, 256], style [256]): the complete description of the clip `render_frames` draws.

    `smooth` holds a loud frame's opening into the next (an RMS envelope snaps shut within a frame; a
    mouth does not); a track that is already a mouth (`visemes.mouth_track`, its bilabial closures
    included) passes smooth=False and is only quantized to the drawn levels."""
    age, gender, timbre = check_profile(profile)
    if emotion not in EXPRESSIONS:
        raise ValueError(f"emotion {emotion!r} is not one of {STYLES}")
    pid = _profile_id(profile)
    env = np.clip(np.nan_to_num(np.asarray(envelope_per_frame, np.float64)), 0.0, 1.0)
    # light smoothing: a mouth does not snap shut within one 40 ms frame
    if smooth and env.size > 2:
        env = np.maximum(env, 0.6 * np.concatenate([[0.0], env[:-1]]))
    content = np.zeros((env.size, CONTENT_DIM), np.float32)
    content[:, CONTENT_MOUTH] = np.round(env * (MOUTH_LEVELS - 1)) / (MOUTH_LEVELS - 1)
    content[:, CONTENT_BLINK] = [BLINK_LEVELS[_blink_state(i, pid, fps)] for i in range(env.size)]
    style = np.zeros(STYLE_DIM, np.float32)
    values = {"age": age, "gender": gender, "timbre": timbre, "emotion": emotion, "skin": pid % _PALETTE,
              "hair": (pid // _PALETTE) % len(_HAIR), "iris": "blue" if pid % 3 == 0 else "brown"}
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
    out["ID"] = next(i for i in range(3 * _PALETTE * len(_HAIR)) if i % _PALETTE == out["skin"]
                     and (i // _PALETTE) % len(_HAIR) == out["hair"] and (i % 3 == 0) == blue)
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
        return _render_idle(avatar, levels, blinks, size)
    eyes, mouths, (y0, y1, x0, x1) = _parts(avatar["age"], avatar["gender"], avatar["timbre"], avatar["ID"],
                                            avatar["emotion"], size)
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
