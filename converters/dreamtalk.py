"""Render a talking-head video with DreamTalk from Empatheia's predicted video content C^v and style S^v.

DreamTalk (ali-vilab/dreamtalk) makes a video in two steps: its denoising network samples 64 expression
coefficients per 25-fps frame from audio content and a style, and its PIRenderer (``FaceGenerator``) draws
each frame of a source face from a 27-frame window of expression + pose coefficients. This bridge runs
both with OUR features in place of DreamTalk's two encoders:

- **where content and style go in**: ``DiffusionNet.sample(audio, style_clip, style_pad_mask, ...,
  sample_method="ddim", ready_style_code=S)`` calls ``NoisePredictor.forward`` at every step, and that is
  the only place the encoders run: ``content = self.content_encoder(audio)`` ([B, T, 11, 256]) and
  ``style_code = ready_style_code`` when one is given (else ``self.style_encoder(style_clip, mask)``).
  So the bridge puts an identity module in ``net.content_encoder`` for the duration of the call, passes
  the content windows [1, T, 11, 256] as ``audio`` (T and the window length W are read from its shape),
  and S^v [1, 256] as ``ready_style_code``. ``style_clip``/``style_pad_mask`` are then unused zeros.
- **content layout**: a ``full`` target/prediction [T, 11*256] is unflattened to the exact windows. A
  ``center`` or ``mean`` one [T, 256] is repeated over the 11 window positions: an approximation (the
  encoder's 11 rows differ), so use ``--content-window full`` targets when the video must match
  DreamTalk's own output closely.
- **guidance**: DreamTalk refuses classifier-free guidance with a ready style code; its default scale
  (``CF_GUIDANCE.SCALE`` 1.0) makes guidance the conditional output anyway, so sampling is unguided.
- **frames**: T = wav2vec2 vectors // 2 of the reply's 16 kHz speech (``dreamtalk_targets.num_video_frames``);
  the first T rows of C^v are read. Pose: the first T rows of a Deep3DFaceRecon .mat (angles
  ``coeff[:, 224:227]``, translation ``coeff[:, 254:257]``, crop ``transform_params[:, -3:]``), the last row
  repeated when it is shorter; without one, the still head DreamTalk's ``render_video`` uses.
- **rendering**: the source face is a 256x256 RGB crop (DreamTalk's ``crop_src_image`` output), scaled to
  [-1, 1]; frame t reads coefficient rows t-13 .. t+13 clamped to [0, T-1] ([73, 27]); the output is
  ``(clamp(fake_image, -1, 1) + 1) / 2 * 255`` cast to uint8, as DreamTalk's ``render_video`` does. The
  mp4 (h264 + AAC, 25 fps) is written with PyAV, so neither torchvision nor an ffmpeg binary is needed.

Checkpoints: ``checkpoints/denoising_network.pth`` (``model_state_dict``, ``diff_net.*``) and
``checkpoints/renderer.pt`` (``net_G_ema``), read with ``torch.load(weights_only=True)`` or as
``.safetensors`` only. The checkout's ``configs/default.py`` (yacs), ``core/networks`` and
``generators/face_model.py`` + ``generators/renderer_conf.yaml`` are used; ``generators/utils.py`` is not
(it needs torchvision, cv2 and ffmpeg).

The command line is the bridge's (``python -m converters.synthesize --features OUT.npz --out REPLY.wav
--avatar VIDEO.mp4 --dreamtalk-repo CHECKOUT --ckpt denoising_network.pth --renderer renderer.pt --image
FACE256.png``, or ``--wav REPLY.wav`` for speech made elsewhere), so one command speaks and draws a reply
whichever generator the model was trained for.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from converters.dreamtalk_targets import (
    SAMPLE_RATE,
    UsageError,
    dreamtalk_modules,
    num_video_frames,
    read_dreamtalk_checkpoint,
)
from empatheia_jax.generators import registry
from empatheia_jax.generators.base import GeneratorError, VideoGenerator

FPS = 25
STILL_POSE = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9370641, 126.84911, 129.03864)  # render_video's no-move pose
SEMANTIC_RADIUS = 13  # render_video: 27 coefficient rows per drawn frame
IMAGE_SIZE = 256


@dataclass
class DreamTalkRenderer:
    """DreamTalk's denoising network and PIRenderer (torch, eval mode) plus the sizes they were built with."""

    diff_net: Any  # core.networks.diffusion_net.DiffusionNet
    face_generator: Any  # generators.face_model.FaceGenerator
    win_size: int = 5
    d_model: int = 256
    face3d_dim: int = 64
    style_max_len: int = 256
    device: str = "cpu"
    meta: dict[str, Any] = field(default_factory=dict)


def _identity_module() -> Any:
    import torch

    class GivenContent(torch.nn.Module):
        """Stands in for ContentW2VEncoder: the `audio` argument already is the content windows."""

        def forward(self, x: Any) -> Any:
            return x

    return GivenContent()


def content_windows(content: np.ndarray, win_size: int = 5, d_model: int = 256) -> np.ndarray:
    """[T, 2*win_size+1, d_model] from predicted content rows: [T, W*d] unflattened (window-major, the
    ``full`` layout), or [T, d] repeated over the W positions (``center``/``mean``, an approximation)."""
    c = np.asarray(content, np.float32)
    w = 2 * win_size + 1
    if c.ndim != 2 or c.shape[0] < 1:
        raise ValueError(f"video content must be [T, {d_model}] or [T, {w * d_model}], got {list(c.shape)}")
    if c.shape[1] == w * d_model:
        return c.reshape(len(c), w, d_model)
    if c.shape[1] == d_model:
        return np.repeat(c[:, None, :], w, axis=1)
    raise ValueError(f"video content rows have {c.shape[1]} values; DreamTalk takes {d_model} (one window "
                     f"position) or {w * d_model} (the whole window)")


def pose_rows(pose: np.ndarray | None, frames: int) -> np.ndarray:
    """[frames, 9] pose (3 angles, 3 translations, 3 crop parameters): `pose` cut or extended with its last
    row, or DreamTalk's still head when None."""
    if pose is None:
        return np.tile(np.asarray(STILL_POSE, np.float32), (frames, 1))
    p = np.asarray(pose, np.float32)
    if p.ndim != 2 or p.shape[1] != 9 or len(p) < 1:
        raise ValueError(f"pose must be [L, 9], got {list(p.shape)}")
    if len(p) >= frames:
        return p[:frames]
    return np.concatenate([p, np.tile(p[-1:], (frames - len(p), 1))], axis=0)


def load_pose(path: str | os.PathLike) -> np.ndarray:
    """[L, 9] pose of a Deep3DFaceRecon .mat: coeff[:, 224:227] ++ coeff[:, 254:257] ++
    transform_params[:, -3:]."""
    from scipy.io import loadmat

    mat = loadmat(str(path))
    if "coeff" not in mat or "transform_params" not in mat:
        raise UsageError(f"{path}: a pose .mat needs 'coeff' and 'transform_params' (Deep3DFaceRecon output)")
    coeff, trans = np.asarray(mat["coeff"]), np.asarray(mat["transform_params"])
    if coeff.ndim != 2 or coeff.shape[1] < 257 or trans.ndim != 2 or len(trans) != len(coeff):
        raise UsageError(f"{path}: coeff {list(coeff.shape)} / transform_params {list(trans.shape)} are not "
                         "[L, 257] / [L, >=3]")
    return np.concatenate([coeff[:, 224:227], coeff[:, 254:257], trans[:, -3:]], axis=1).astype(np.float32)


def face_motion(r: Any, content: np.ndarray, style: np.ndarray, *, pose: np.ndarray | None = None,
                ddim_steps: int = 10, seed: int | None = 0) -> np.ndarray:
    """[T, 73] = 64 expression coefficients sampled by DreamTalk's denoising network from our content
    windows and style code (see the module docstring), then 9 pose values."""
    import torch

    windows = content_windows(content, r.win_size, r.d_model)
    code = np.asarray(style, np.float32).reshape(-1)
    if code.shape[0] != r.d_model:
        raise ValueError(f"video style has {code.shape[0]} values, DreamTalk's style code has {r.d_model}")
    device = r.device
    audio = torch.from_numpy(windows)[None].to(device)
    net = r.diff_net.net
    original = net.content_encoder
    net.content_encoder = _identity_module()
    try:
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            exp = r.diff_net.sample(
                audio,
                torch.zeros(1, r.style_max_len, r.face3d_dim, device=device),
                torch.zeros(1, r.style_max_len, dtype=torch.bool, device=device),
                output_dim=r.face3d_dim,
                use_cf_guidance=False,
                sample_method="ddim",
                ddim_num_step=ddim_steps,
                ready_style_code=torch.from_numpy(code)[None].to(device),
            )
    finally:
        net.content_encoder = original
    exp = exp[0].float().cpu().numpy()
    return np.concatenate([exp, pose_rows(pose, len(exp))], axis=1)


def render_frames(r: Any, image: np.ndarray, motion: np.ndarray, batch: int = 16) -> np.ndarray:
    """uint8 RGB frames [T, 256, 256, 3] drawn by the PIRenderer from a 256x256 RGB face and [T, 73]."""
    import torch

    img = np.asarray(image)
    if img.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(f"source face must be {IMAGE_SIZE}x{IMAGE_SIZE} RGB, got {list(img.shape)}")
    src = (torch.from_numpy(img.astype(np.float32) / 255.0).permute(2, 0, 1) - 0.5) / 0.5
    m = np.asarray(motion, np.float32)
    t = len(m)
    idx = np.clip(np.arange(t)[:, None] + np.arange(-SEMANTIC_RADIUS, SEMANTIC_RADIUS + 1)[None], 0, t - 1)
    wins = torch.from_numpy(np.ascontiguousarray(m[idx].transpose(0, 2, 1)))  # [T, 73, 27]
    out = []
    with torch.no_grad():
        for i in range(0, t, batch):
            w = wins[i:i + batch].to(r.device)
            fake = r.face_generator(src[None].expand(len(w), -1, -1, -1).to(r.device), w)["fake_image"]
            out.append(((fake.cpu().clamp(-1, 1) + 1) / 2 * 255).to(torch.uint8).permute(0, 2, 3, 1))
    return torch.cat(out).numpy()


def write_mp4(frames: np.ndarray, audio: np.ndarray | None, path: str | os.PathLike, fps: int = FPS,
              sample_rate: int = SAMPLE_RATE) -> None:
    """h264 yuv420p video (+ mono AAC audio cut to the video's length) with PyAV."""
    import av

    frames = np.asarray(frames, np.uint8)
    with av.open(str(path), "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps, options={"crf": "18"})
        video.width, video.height = frames.shape[2], frames.shape[1]
        video.pix_fmt = "yuv420p"
        sound = None
        if audio is not None:
            sound = container.add_stream("aac", rate=sample_rate)
            sound.layout = "mono"
        for f in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(video.encode())
        if sound is not None:
            a = np.asarray(audio, np.float32)[: round(len(frames) * sample_rate / fps)]
            frame = av.AudioFrame.from_ndarray(a[None], format="fltp", layout="mono")
            frame.sample_rate = sample_rate
            container.mux(sound.encode(frame))
            container.mux(sound.encode())


def load_renderer(repo: str | os.PathLike, ckpt: str | os.PathLike, renderer: str | os.PathLike, *,
                  device: str | None = None) -> DreamTalkRenderer:
    """DreamTalk's DiffusionNet (from `ckpt`) and FaceGenerator (from `renderer`), built by the checkout."""
    import torch
    import yaml

    repo = Path(repo).expanduser().resolve()
    for rel in ("configs/default.py", "core/networks/diffusion_net.py", "generators/face_model.py",
                "generators/renderer_conf.yaml"):
        if not (repo / rel).is_file():
            raise UsageError(f"--repo {repo} is not a DreamTalk checkout (it has no {rel})")
    ckpt, renderer = Path(ckpt).expanduser().resolve(), Path(renderer).expanduser().resolve()
    for flag, p in (("--ckpt", ckpt), ("--renderer", renderer)):
        if not p.is_file():
            raise UsageError(f"{flag} {p} does not exist")
    state = read_dreamtalk_checkpoint(ckpt)
    diff_state = {k.removeprefix("module.").removeprefix("diff_net."): v for k, v in state.items()
                  if k.removeprefix("module.").startswith("diff_net.")}
    conf = yaml.safe_load((repo / "generators" / "renderer_conf.yaml").read_text(encoding="utf-8"))
    with dreamtalk_modules(repo):
        cfg = importlib.import_module("configs.default").get_cfg_defaults()
        dn = importlib.import_module("core.networks.diffusion_net")
        du = importlib.import_module("core.networks.diffusion_util")
        fm = importlib.import_module("generators.face_model")
        s = cfg.DIFFUSION.SCHEDULE
        diff_net = dn.DiffusionNet(cfg=cfg, net=du.NoisePredictor(cfg), var_sched=du.VarianceSchedule(
            num_steps=s.NUM_STEPS, beta_1=s.BETA_1, beta_T=s.BETA_T, mode=s.MODE))
        face_generator = fm.FaceGenerator(**conf)
    try:
        diff_net.load_state_dict(diff_state, strict=True)
    except RuntimeError as e:
        raise UsageError(f"{ckpt}: does not fit the DiffusionNet of {repo}'s configs/default.py "
                         f"({str(e).strip().splitlines()[0]})") from e
    result = face_generator.load_state_dict(read_dreamtalk_checkpoint(renderer, "net_G_ema"),
                                            strict=False)
    if result.missing_keys:
        raise UsageError(f"{renderer}: {len(result.missing_keys)} renderer weights missing "
                         f"{result.missing_keys[:4]} (expected the 'net_G_ema' of DreamTalk's renderer.pt)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return DreamTalkRenderer(
        diff_net=diff_net.to(device).eval(), face_generator=face_generator.to(device).eval(),
        win_size=int(cfg.WIN_SIZE), d_model=int(cfg.D_MODEL), face3d_dim=int(cfg.DATASET.FACE3D_DIM),
        style_max_len=int(cfg.DATASET.STYLE_MAX_LEN), device=device,
        meta={"repo": str(repo), "checkpoint": str(ckpt), "renderer": str(renderer)})


def render_video(r: Any, content: np.ndarray, style: np.ndarray, wav: str | os.PathLike,
                 image: str | os.PathLike, out: str | os.PathLike, *, pose: str | os.PathLike | None = None,
                 ddim_steps: int = 10, seed: int | None = 0) -> tuple[int, list[str]]:
    """Write `out` (.mp4) for the reply speech `wav` from predicted `content` [rows, D] and `style` [256];
    (frames, notes): T of the speech, at most the number of content rows."""
    from PIL import Image

    from empatheia_jax.data.encoders.media import load_audio

    audio = load_audio(wav, SAMPLE_RATE)
    t = num_video_frames(len(audio))
    if t < 1:
        raise UsageError(f"{wav}: {len(audio)} samples are shorter than one DreamTalk video frame")
    rows = np.asarray(content, np.float32)
    notes = []
    if t > len(rows):
        notes.append(f"the speech needs {t} frames, the model predicts {len(rows)} video content rows "
                     "(config.data.max_video_len); rendering those")
        t = len(rows)
    face = np.asarray(Image.open(image).convert("RGB"))
    if face.shape[:2] != (IMAGE_SIZE, IMAGE_SIZE):
        raise UsageError(f"{image}: {face.shape[1]}x{face.shape[0]}; DreamTalk's renderer takes a "
                         f"{IMAGE_SIZE}x{IMAGE_SIZE} face crop (its crop_src_image output)")
    motion = face_motion(r, rows[:t], style, pose=load_pose(pose) if pose else None, ddim_steps=ddim_steps,
                         seed=seed)
    write_mp4(render_frames(r, face, motion), audio, out)
    return t, notes


@registry.register
class DreamTalkVideo(VideoGenerator):
    """DreamTalk as a video generator: its denoiser samples face motion from our C^v windows and S^v, its
    PIRenderer draws `image`. Registered when this module is imported (`converters.synthesize` does so for
    `--dreamtalk-repo`): the library does not import converters/, so the bridge registers itself."""

    name = "dreamtalk"
    description = "DreamTalk"
    how = ("python -m converters.dreamtalk_targets exports its features; python -m converters.synthesize "
           "--dreamtalk-repo renders them")
    fps = FPS

    def __init__(self, repo: str, ckpt: str, renderer: str, image: str, pose: str | None = None,
                 ddim_steps: int = 10, seed: int = 0, device: str | None = None):
        for flag, p in (("--image", image), ("--pose", pose)):
            if p is not None and not Path(p).is_file():
                raise GeneratorError(f"{flag} {p} does not exist")
        self.repo, self.ckpt, self.renderer, self.image, self.pose = repo, ckpt, renderer, image, pose
        self.ddim_steps, self.seed, self.device = ddim_steps, seed, device

    def render(self, content: np.ndarray, style: np.ndarray, wav: str | os.PathLike, out: Path
               ) -> tuple[int, list[str]]:
        r = load_renderer(self.repo, self.ckpt, self.renderer, device=self.device)
        return render_video(r, content, style, wav, self.image, out, pose=self.pose,
                            ddim_steps=self.ddim_steps, seed=self.seed)
