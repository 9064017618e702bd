"""The procedural avatar's painter: numpy strokes of one face with its expression, and the cached still parts
(three eyelid states, MOUTH_LEVELS mouth crops) that a frame is composed from.

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
- speech: mouth opening per 40 ms frame (the control space in `face_render.py`).

Frames are composed from cached parts (three blink states x 16 mouth openings per avatar and
expression), so rendering costs little next to encoding. The strokes paint on any canvas, so the idle
avatar (`face_idle.py`) draws its moving layers with the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from empatheia_jax.generators.speech_synth import check_profile

MOUTH_LEVELS = 16
BLINK_LEVELS = (0.0, 0.6, 1.0)  # eyelid closure of the three drawn eyelid states: open, half, closed
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
SKIN_TONES, HAIR_COLOURS = len(_SKIN), len(_HAIR)  # the palettes a profile ID picks from


def profile_id(profile: dict) -> int:
    try:
        return int(profile.get("ID", 0))
    except (TypeError, ValueError):
        return sum(str(profile.get("ID", "")).encode())


class Canvas:
    """A float RGB image (or a view into one) with pixel-centre coordinates of the full frame."""

    def __init__(self, img: np.ndarray, x0: int = 0, y0: int = 0):
        self.img = img
        h, w = img.shape[:2]
        self.y, self.x = np.mgrid[y0: y0 + h, x0: x0 + w].astype(np.float32) + 0.5
        self.x0, self.y0 = x0, y0

    def sub(self, x0: float, y0: float, x1: float, y1: float) -> Canvas:
        h, w = self.img.shape[:2]
        a = int(np.clip(np.floor(x0) - self.x0, 0, w))
        b = int(np.clip(np.ceil(x1) - self.x0, 0, w))
        c = int(np.clip(np.floor(y0) - self.y0, 0, h))
        d = int(np.clip(np.ceil(y1) - self.y0, 0, h))
        return Canvas(self.img[c:d, a:b], self.x0 + a, self.y0 + c)

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
    pid = profile_id(profile)
    skin = _SKIN[pid % len(_SKIN)] * np.asarray(expr.tint, np.float32)
    hair = _HAIR[(pid // len(_SKIN)) % len(_HAIR)]
    g = _GREY[age]
    hair = (1 - g) * hair + g * np.array([0.78, 0.78, 0.80], np.float32)
    return np.clip(skin, 0, 1), hair


def background_image(size: int) -> np.ndarray:
    img = np.empty((size, size, 3), np.float32)
    img[:] = _BACKGROUND
    # vertical background gradient, darker at the bottom
    img *= (1.0 - 0.12 * np.linspace(0, 1, size, dtype=np.float32))[:, None, None]
    return img


def _draw_base(profile: dict, emotion: str, size: int) -> np.ndarray:
    """Everything except eyes and mouth, which change per frame, painted in place on the background."""
    img = background_image(size)
    cv = Canvas(img)
    paint_base(cv, cv, cv, profile, emotion, size)
    return img


def paint_base(back: Canvas, torso: Canvas, head: Canvas, profile: dict, emotion: str, size: int) -> None:
    """The strokes of `_draw_base`, each on the canvas of the layer that carries it: `back` (long hair
    behind the shoulders), `torso` (shirt, neck) and `head` (the rest). The still face passes one canvas
    three times, so its pixels are exactly the sequential painting; the idle avatar passes three layers."""
    age, gender, timbre = check_profile(profile)
    expr = EXPRESSIONS[emotion]
    L = _layout(age, size)
    skin, hair = _colours(profile, age, expr)
    shade = skin * 0.82
    if gender == "female":  # long hair behind the head and shoulders
        back.ellipse(L.cx, L.cy + 14 * L.s, L.fa + 9 * L.s, L.fb + 16 * L.s, hair)
    _paint_torso(torso, L, timbre, shade)
    hairline = _paint_head(head, L, age, gender, skin, hair, shade, size)
    _paint_marks(head, L, age, expr, shade, hairline)


def _paint_torso(torso: Canvas, L: _Layout, timbre: str, shade: np.ndarray) -> None:
    """Shoulders in the timbre's shirt colour, the neck and the collar opening."""
    s, cx = L.s, L.cx
    chin = L.cy + L.fb
    torso.ellipse(cx, chin + 34 * s, 58 * s, 30 * s, _SHIRT[timbre])
    torso.ellipse(cx, chin, 10 * s, 12 * s, shade)  # neck
    torso.ellipse(cx, chin + 5 * s, 10 * s, 5 * s, shade)  # collar opening


def _paint_head(cv: Canvas, L: _Layout, age: str, gender: str, skin: np.ndarray, hair: np.ndarray,
                shade: np.ndarray, size: int) -> float:
    """Ears, the face, the hair cap and a woman's fringe; returns the hairline, where forehead wrinkles go."""
    s, cx, cy, fa, fb = L.s, L.cx, L.cy, L.fa, L.fb
    lo, hi = -size, 2 * size  # "unbounded": a sub-canvas is clipped to its canvas, frame or layer
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
    if gender == "female":  # fringe strands at the temples
        for side in (-1, 1):
            cv.ellipse(cx + side * (fa - 2 * s), cy - 6 * s, 4 * s, 16 * s, hair)
    return hairline


def _paint_marks(cv: Canvas, L: _Layout, age: str, expr: Expression, shade: np.ndarray, hairline: float
                 ) -> None:
    """What lies on the face: blush, the nose (wrinkled in disgust), wrinkles by age, a tear."""
    s, cx, cy = L.s, L.cx, L.cy
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


def draw_eyes(cv: Canvas, profile: dict, emotion: str, blink: float, size: int) -> None:
    """Eyes (with lids, iris, pupil), brows and glasses; blink in [0, 1] closes the lids."""
    age, gender, _ = check_profile(profile)
    expr = EXPRESSIONS[emotion]
    L = _layout(age, size)
    s, cx = L.s, L.cx
    skin, hair = _colours(profile, age, expr)
    openness = expr.eye_open * (1.0 - blink)
    iris = (0.25, 0.18, 0.12) if profile_id(profile) % 3 else (0.25, 0.40, 0.55)
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


def draw_mouth(cv: Canvas, profile: dict, emotion: str, opening: float, size: int) -> None:
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
def still_parts(age: str, gender: str, timbre: str, pid: int, emotion: str, size: int):
    """Cached frames for one avatar + expression: 3 blink states and MOUTH_LEVELS mouth crops."""
    profile = {"age": age, "gender": gender, "timbre": timbre, "ID": pid}
    base = _draw_base(profile, emotion, size)
    frames = []
    for blink in BLINK_LEVELS:
        f = base.copy()
        draw_eyes(Canvas(f), profile, emotion, blink, size)
        frames.append(f)
    y0, y1, x0, x1 = mouth_slice(age, size)
    mouths = []
    for level in range(MOUTH_LEVELS):
        crop = frames[0][y0:y1, x0:x1].copy()
        draw_mouth(Canvas(crop, x0, y0), profile, emotion, mouth_opening(emotion, level), size)
        mouths.append(to_u8(crop))
    return [to_u8(f) for f in frames], mouths, (y0, y1, x0, x1)


def mouth_slice(age: str, size: int) -> tuple[int, int, int, int]:
    """(y0, y1, x0, x1): the frame pixels a mouth crop covers (the mouth box, clipped to the frame)."""
    x0, y0, x1, y1 = (int(np.floor(v)) for v in _mouth_box(_layout(age, size)))
    return max(y0, 0), min(y1 + 1, size), max(x0, 0), min(x1 + 1, size)


def mouth_opening(emotion: str, level: int) -> float:
    """The drawn opening of mouth level `level`: the expression's resting opening up to the widest."""
    base_open = EXPRESSIONS[emotion].mouth_base_open
    return base_open + (1 - base_open) * level / (MOUTH_LEVELS - 1)


def to_u8(img: np.ndarray) -> np.ndarray:
    return np.clip(np.round(img * 255.0), 0, 255).astype(np.uint8)
