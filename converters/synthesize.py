"""The speech bridge: Empatheia's predicted speech content C^s and style S^s -> a wav, through Kokoro-82M.

Usage::

    python -m converters.synthesize --features reply.npz --out reply.wav [--rows N] [--speed 1.0]
        [--avatar reply.mp4]                                  # the procedural face generator
    python -m converters.synthesize --features reply.npz (--out reply.wav | --wav SPEECH.wav)
        --avatar reply.mp4 --dreamtalk-repo CHECKOUT --ckpt denoising_network.pth --renderer renderer.pt
        --image FACE256.png [--pose POSE.mat] [--ddim-steps 10] [--seed 0] [--device D]   # DreamTalk

`reply.npz`/`reply.json` are what `empatheia chat` writes. The Content Synchronizer predicts a fixed
number of rows (config.data.max_speech_len); the generator reads the first T of them, T = the reply's
phoneme count plus Kokoro's two boundary pads (`targets.content_rows`), which chat records as
`speech_content_units`. Durations come from Kokoro's own prosody predictor inside the synthesizer graph,
fed the predicted d_en rows and the prosodic half of S^s, as in StyleTTS2 inference: Empatheia predicts no
durations (the paper's CS targets are t_en and d_en only), and the predictor is what maps content and style
to timing. `--speed` defaults to 1.0, the listener's speaking rate in the sample's voice map
(empatheia_jax/generators/kokoro_voices.py), since Empatheia speaks as the listener.

Only checkpoints trained on Kokoro speech targets can be spoken here: stand-in targets are not generator
features, and StyleTTS2 features belong to the user's StyleTTS2 checkpoint (a different model).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.generators import kokoro


class SpeechBridgeError(ValueError):
    """Features that cannot drive Kokoro: wrong target source, shapes, or row count; names the file."""


def reply_rows(meta: dict[str, Any], available: int, source: str = "features") -> tuple[int, list[str]]:
    """(rows to read, notes) from chat's JSON (`speech_targets`, `speech_content_units`)."""
    src = meta.get("speech_targets")
    if src != "kokoro":
        why = {
            "stand-in": "stand-in speech targets (deterministic functions of the sample, not generator "
                        "features); train on Kokoro targets (python -m converters.styletts2_targets "
                        "--backend kokoro) to speak",
            "styletts2": "StyleTTS2 features, which drive the StyleTTS2 checkpoint they were exported from, "
                         "not Kokoro",
        }.get(src, f"speech targets of source {src!r}")
        raise SpeechBridgeError(f"{source}: the model was trained on {why}")
    rows = meta.get("speech_content_units")
    if not isinstance(rows, int) or rows < 3:
        raise SpeechBridgeError(f"{source}: speech_content_units={rows!r}; need the reply's phoneme rows "
                                "(>= 3)")
    notes = []
    if rows > available:
        notes.append(f"the reply has {rows} phoneme rows but the model predicts {available} "
                     f"(config.data.max_speech_len); the speech stops after {available}")
        rows = available
    return rows, notes


MAX_MEAN_FRAMES = 12.0
"""Cap on the mean predicted duration: 12 frames of 25 ms = 0.3 s per phoneme row, 3.5x Kokoro's mean on the
sample's English (3.4 frames; the slowest voice, sad at speed 0.8, ~4.3). Real speech never reaches it; an
untrained model's features reached 10x the expected length (15 s of decoding per reply in the demo's
untrained column)."""


def speak_features(content: np.ndarray, style: np.ndarray, rows: int, speed: float = 1.0,
                   threads: int = 1) -> np.ndarray:
    """Audio (float32, 24 kHz) from the first `rows` predicted content rows and the predicted style, rows
    held MAX_MEAN_FRAMES frames on average at most."""
    content = np.asarray(content, np.float32)
    if content.ndim != 2 or content.shape[1] != kokoro.CONTENT_DIM:
        raise SpeechBridgeError(f"speech_content must be [rows, {kokoro.CONTENT_DIM}], "
                                f"got {list(content.shape)}")
    return kokoro.shared(threads).synthesize(content[:rows], style, speed,
                                             max_mean_frames=MAX_MEAN_FRAMES)


RENDERERS = {
    "face_render": "the procedural face generator (--avatar; python -m converters.face_targets exports its "
                   "controls)",
    "dreamtalk": "DreamTalk (--avatar with --dreamtalk-repo; python -m converters.dreamtalk_targets exports "
                 "its features)",
}
"""The video target source each renderer draws, and how a user gets there."""


def check_video_targets(src: str | None, renderer: str, source: str = "features") -> None:
    """Refuse video features that `renderer` cannot draw, before anything is generated or loaded."""
    if src == renderer:
        return
    if src == "stand-in":
        why = "stand-in video targets (functions of the sample's media, not generator controls)"
    elif src in RENDERERS:
        why = f"{src} features, which {RENDERERS[src]} renders"
    else:
        why = f"video targets of source {src!r}"
    raise SpeechBridgeError(f"{source}: the model was trained on {why}; {RENDERERS[renderer]} renders "
                            f"{renderer} features")


def video_frames(content: np.ndarray, n_frames: int) -> tuple[np.ndarray, list[str]]:
    """The first `n_frames` predicted video_content rows (25 fps, as many as the spoken reply lasts)."""
    notes = []
    if n_frames > len(content):
        notes.append(f"the reply lasts {n_frames} frames but the model predicts {len(content)} "
                     "(config.data.max_video_len); the face holds still with its mouth closed after that")
        rest = np.zeros((n_frames - len(content), content.shape[1]), np.float32)
        content = np.concatenate([content, rest])
    return content[:n_frames], notes


def _video_features(features: str | Path, renderer: str) -> tuple[np.ndarray, np.ndarray]:
    """(C^v, S^v) of chat's output, checked against the renderer that is to draw them."""
    from empatheia_jax.serve.chat import read_outputs

    arrays, meta = read_outputs(Path(features))
    for key in ("video_content", "video_style"):
        if key not in arrays:
            raise SpeechBridgeError(f"{features}: no {key!r} array (the model has no video heads)")
    check_video_targets(meta.get("video_targets"), renderer, str(features))
    return arrays["video_content"], arrays["video_style"]


def render_avatar(features: str | Path, wav: str | Path, out: str | Path) -> tuple[Path, int, list[str]]:
    """The talking avatar: predicted C^v/S^v drawn by the face generator
    (empatheia_jax/generators/face_render.py) at 25 fps,
    as many frames as `wav` (the spoken reply) lasts, with that speech muxed in; (path, frames, notes)."""
    from empatheia_jax.generators.face_render import FRAME_RATE, encode_mp4, render_controls
    from empatheia_jax.generators.speech_synth import read_wav

    content, style = _video_features(features, "face_render")
    sr, samples = read_wav(wav)
    n_frames = max(1, -(-len(samples) * FRAME_RATE // sr))
    content, notes = video_frames(content, n_frames)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    encode_mp4(render_controls(content, style), out, audio=(samples, sr))
    return out, n_frames, notes


@dataclasses.dataclass(frozen=True)
class DreamTalkFiles:
    """What DreamTalk needs beside our features: the user's checkout, its two checkpoints and a face."""

    repo: str
    ckpt: str
    renderer: str
    image: str
    pose: str | None = None
    ddim_steps: int = 10
    seed: int = 0
    device: str | None = None


def render_dreamtalk(features: str | Path, wav: str | Path, out: str | Path, files: DreamTalkFiles
                     ) -> tuple[Path, int, list[str]]:
    """The talking head through the user's DreamTalk (converters/dreamtalk.py): its denoiser samples face
    motion from our C^v windows and S^v, its PIRenderer draws `files.image`; (path, frames, notes)."""
    from converters import dreamtalk

    content, style = _video_features(features, "dreamtalk")
    for flag, p in (("--image", files.image), ("--pose", files.pose)):
        if p is not None and not Path(p).is_file():
            raise SpeechBridgeError(f"{flag} {p} does not exist")
    r = dreamtalk.load_renderer(files.repo, files.ckpt, files.renderer, device=files.device)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    frames, notes = dreamtalk.render_video(r, content, style, wav, files.image, out, pose=files.pose,
                                           ddim_steps=files.ddim_steps, seed=files.seed)
    return out, frames, notes


def synthesize_reply(features: str | Path, out: str | Path, *, rows: int | None = None,
                     speed: float = 1.0) -> tuple[Path, float, list[str]]:
    """Speak chat's output `features` (OUT.npz or its stem) into the wav `out`; (path, seconds, notes)."""
    from empatheia_jax.generators.kokoro_voices import to_pcm16
    from empatheia_jax.generators.speech_synth import write_wav
    from empatheia_jax.serve.chat import read_outputs

    stem = Path(features)
    try:
        arrays, meta = read_outputs(stem)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--features {features}: {e.strerror or e}: {e.filename}") from e
    for key in ("speech_content", "speech_style"):
        if key not in arrays:
            raise SpeechBridgeError(f"{features}: no {key!r} array (the model has no speech heads)")
    content = arrays["speech_content"]
    notes: list[str] = []
    if rows is None:
        rows, notes = reply_rows(meta, content.shape[0], str(features))
    elif not 3 <= rows <= content.shape[0]:
        raise SpeechBridgeError(f"--rows {rows}: must be in [3, {content.shape[0]}]")
    audio = speak_features(content, arrays["speech_style"], rows, speed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_wav(out, to_pcm16(audio), kokoro.SAMPLE_RATE)
    return out, len(audio) / kokoro.SAMPLE_RATE, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m converters.synthesize", description=__doc__.split("\n")[0])
    ap.add_argument("--features", required=True, help="chat output (OUT.npz, OUT.json or the stem OUT)")
    speech = ap.add_mutually_exclusive_group(required=True)
    speech.add_argument("--out", help="speak the reply with Kokoro-82M into this wav (24 kHz mono int16)")
    speech.add_argument("--wav", help="the reply's speech made elsewhere (e.g. by your StyleTTS2); only the "
                                      "avatar is rendered, with this speech")
    ap.add_argument("--rows", type=int, default=None, help="content rows to read (default: from the json)")
    ap.add_argument("--speed", type=float, default=1.0, help="speaking rate (default 1.0, the listener's)")
    ap.add_argument("--avatar", default=None,
                    help="also render the talking head to this .mp4: the procedural face generator, or "
                         "DreamTalk with --dreamtalk-repo")
    dt = ap.add_argument_group("DreamTalk (for models trained on DreamTalk video targets)")
    dt.add_argument("--dreamtalk-repo", default=None, help="a checkout of ali-vilab/dreamtalk")
    dt.add_argument("--ckpt", default=None, help="its checkpoints/denoising_network.pth (or .safetensors)")
    dt.add_argument("--renderer", default=None, help="its checkpoints/renderer.pt (or .safetensors)")
    dt.add_argument("--image", default=None, help="256x256 RGB face crop (DreamTalk's crop_src_image output)")
    dt.add_argument("--pose", default=None, help="Deep3DFaceRecon .mat with the head pose (default: still)")
    dt.add_argument("--ddim-steps", type=int, default=10)
    dt.add_argument("--seed", type=int, default=0)
    dt.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    args = ap.parse_args(argv)
    dreamtalk = None
    if args.dreamtalk_repo:
        missing = [f for f, v in (("--avatar", args.avatar), ("--ckpt", args.ckpt),
                                  ("--renderer", args.renderer), ("--image", args.image)) if not v]
        if missing:
            ap.error(f"--dreamtalk-repo needs {', '.join(missing)}")
        dreamtalk = DreamTalkFiles(args.dreamtalk_repo, args.ckpt, args.renderer, args.image, args.pose,
                                   args.ddim_steps, args.seed, args.device)
    elif any(v is not None for v in (args.ckpt, args.renderer, args.image, args.pose)):
        ap.error("--ckpt/--renderer/--image/--pose are DreamTalk's: give --dreamtalk-repo too")
    if args.wav and not args.avatar:
        ap.error("--wav is the speech for --avatar; without --avatar there is nothing to do")
    notes: list[str] = []
    try:
        if dreamtalk is not None:  # refuse features DreamTalk cannot draw before speaking them
            _video_features(args.features, "dreamtalk")
        if args.wav:
            path = Path(args.wav)
            if not path.is_file():
                raise FileNotFoundError(f"--wav {path} does not exist")
        else:
            path, seconds, notes = synthesize_reply(args.features, args.out, rows=args.rows, speed=args.speed)
            print(f"speech ({seconds:.2f} s) -> {path}")
        if args.avatar and dreamtalk is not None:
            mp4, frames, more = render_dreamtalk(args.features, path, args.avatar, dreamtalk)
            print(f"avatar ({frames} frames at 25 fps, DreamTalk) -> {mp4}")
        elif args.avatar:
            mp4, frames, more = render_avatar(args.features, path, args.avatar)
            print(f"avatar ({frames} frames at 25 fps, procedural face generator) -> {mp4}")
        else:
            more = []
    except (FileNotFoundError, ValueError, kokoro.KokoroAssetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for n in notes + more:
        print(f"note: {n}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
