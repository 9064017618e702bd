"""The command line of the avatar bridge (`empatheia_jax.serve.avatar`): chat's features -> reply.wav/.mp4.

Usage::

    python -m converters.synthesize --features reply.npz --out reply.wav [--rows N] [--speed 1.0]
        [--avatar reply.mp4]                                  # the procedural face generator
    python -m converters.synthesize --features reply.npz (--out reply.wav | --wav SPEECH.wav)
        --avatar reply.mp4 --dreamtalk-repo CHECKOUT --ckpt denoising_network.pth --renderer renderer.pt
        --image FACE256.png [--pose POSE.mat] [--ddim-steps 10] [--seed 0] [--device D]   # DreamTalk

`reply.npz`/`reply.json` are what `empatheia chat` writes. The Content Synchronizer predicts a fixed
number of rows (config.data.max_speech_len); the generator reads the first T of them, T = the reply's
phoneme count plus Kokoro's two boundary pads (`generators.registry.content_rows`), which chat records as
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
import sys
from pathlib import Path

import converters.dreamtalk  # noqa: F401 - registers the "dreamtalk" video generator
from empatheia_jax.generators import registry
from empatheia_jax.generators.kokoro import KokoroAssetError
from empatheia_jax.serve.avatar import render_avatar, synthesize_reply
from empatheia_jax.serve.outputs import read_outputs


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
        dreamtalk = {"repo": args.dreamtalk_repo, "ckpt": args.ckpt, "renderer": args.renderer,
                     "image": args.image, "pose": args.pose, "ddim_steps": args.ddim_steps, "seed": args.seed,
                     "device": args.device}
    elif any(v is not None for v in (args.ckpt, args.renderer, args.image, args.pose)):
        ap.error("--ckpt/--renderer/--image/--pose are DreamTalk's: give --dreamtalk-repo too")
    if args.wav and not args.avatar:
        ap.error("--wav is the speech for --avatar; without --avatar there is nothing to do")
    notes: list[str] = []
    try:
        if dreamtalk is not None:  # refuse features DreamTalk cannot draw before speaking them
            registry.check_trained_on("dreamtalk", read_outputs(args.features)[1].get("video_targets"),
                                      args.features)
        if args.wav:
            path = Path(args.wav)
            if not path.is_file():
                raise FileNotFoundError(f"--wav {path} does not exist")
        else:
            path, seconds, notes = synthesize_reply(args.features, args.out, rows=args.rows, speed=args.speed)
            print(f"speech ({seconds:.2f} s) -> {path}")
        if args.avatar and dreamtalk is not None:
            mp4, frames, more = render_avatar(args.features, path, args.avatar, generator="dreamtalk",
                                              **dreamtalk)
            print(f"avatar ({frames} frames at 25 fps, DreamTalk) -> {mp4}")
        elif args.avatar:
            mp4, frames, more = render_avatar(args.features, path, args.avatar)
            print(f"avatar ({frames} frames at 25 fps, procedural face generator) -> {mp4}")
        else:
            more = []
    except (FileNotFoundError, ValueError, KokoroAssetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for n in notes + more:
        print(f"note: {n}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
