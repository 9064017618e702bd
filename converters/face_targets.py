"""Video targets for the embedded default: the controls the procedural face generator draws each video from.

    python -m converters.face_targets --raw RAW --out TARGETS [--splits a,b] [--workers 2] [--quiet]
        [--mouth speech|phonemes|replies] [--responses-only]

The sample's talking faces come from `empatheia_jax/generators/face_render.py`, a procedural stand-in for
DreamTalk with a
documented control space (`face_render.CONTENT_*`, `face_render.STYLE_GROUPS`): per 25-fps frame the mouth
opening and eyelid closure (`video_content` [T, 256]), per clip the avatar and its expression
(`video_style` [256]). Those controls are the complete description of the video: `render_controls` on
them gives the frames the sample's mp4 was encoded from, byte for byte after encoding. So they are real
generator targets for this generator, not stand-ins, and the bridge (`converters.synthesize --avatar`,
`empatheia chat --avatar`) renders the model's predicted C^v/S^v with the same function.

The controls are computed the way data/make_sample.py renders each utterance: the mouth follows the RMS
envelope of the utterance's own wav (RAW/media/{uid}.wav), the avatar is the speaker's or listener's profile,
the expression `kokoro_voices.utterance_style(role, emotion)`: the dialogue's emotion class for the
speaker, the listener's answer to it (joy, surprise, sadness mirrored, the calm "empathetic" style to the
rest) for the listener. A user with DreamTalk exports DreamTalk's features instead
(converters/dreamtalk_targets.py).

`--mouth phonemes` needs no media: the mouth track comes from the utterance's phonemes laid out with
Kokoro's predicted durations in the voice it is spoken with (`generators.visemes`), the same timeline
Kokoro's synthesis of it has. That gives text corpora (imported EmpatheticDialogues, whose replies have
no video) video_content targets; with `--responses-only` only the turns' responses are exported, which is
all a record reads.

`--mouth replies` (the demo's): the listener's utterances, which are the replies a record's targets are,
get the phoneme mouth (and their video_units) on the timeline of Kokoro speaking them at
`kokoro_voices.LISTENER_SPEED` in the listener's voice, exactly the gold speech data/make_sample.py writes
for the test replies (`kokoro_voices.gold_speech`); the speaker's utterances keep their wav's envelope.
So a reply's gold clip moves with the reply's gold speech, a model's mouth can be timed by the speech it
is spoken with, and eval measures lip sync against that speech (`eval/video.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

SOURCE = "face_render"
KINDS = ("video_content", "video_style")
MOUTHS = ("speech", "phonemes", "replies")
MOUTH_METHOD = {
    "speech": "mouth opening = the RMS envelope of the utterance's wav (speech_synth.speech_envelope)",
    "phonemes": ("mouth opening = generators.visemes.mouth_track of the utterance's Kokoro phonemes, laid "
                 "out with Kokoro's predicted durations in kokoro_voices.voice(profile, style) and opening "
                 "with its predicted loudness (Kokoro.energy); no media"),
    "replies": ("listener utterances (the replies): generators.visemes.mouth_track of their Kokoro phonemes "
                "at kokoro_voices.LISTENER_SPEED, the gold speech's timeline, with its predicted loudness; "
                "speaker utterances: the RMS "
                "envelope of their wav"),
}
METHOD = {
    "video_content": ("empatheia_jax/generators/face_render.py control space, "
                      "one row per 25-fps frame: dim 0 mouth opening "
                      "(MOUTH_LEVELS steps), dim 1 eyelid closure (0 / 0.6 / 1), dims 2-255 zero"),
    "video_style": ("empatheia_jax/generators/face_render.py STYLE_GROUPS one-hots: "
                    "age, gender, timbre, expression, skin, hair, "
                    "iris; dims 30-255 zero"),
    "video_units": ("per video_content row, the Kokoro unit id (KokoroSpeech.content_units' id space: 0 = "
                    "pad, else the phoneme token id) of the row the frame shows "
                    "(generators.visemes.frame_units), stored as float32"),
}


class FaceJob(NamedTuple):
    uid: str
    wav: str
    text: str
    profile: dict[str, Any]
    style: str  # the expression (and voice) the utterance is drawn in
    speed: float | None  # the phoneme mouth's rate: LISTENER_SPEED for a listener, else the style's


def face_jobs(raw: str | Path, splits: list[str] | None = None, dialogues: Iterable[Any] | None = None,
              responses_only: bool = False) -> list[FaceJob]:
    """Every distinct utterance as data/make_sample.py renders it: the utterances the speech exporter lists
    (`styletts2_targets.speech_jobs`) and the style they are drawn in."""
    from converters.styletts2_targets import speech_jobs
    from empatheia_jax.generators.kokoro_voices import utterance_delivery

    return [FaceJob(j.uid, j.wav, j.text, j.profile, *utterance_delivery(j.role, j.emotion))
            for j in speech_jobs(raw, splits, dialogues, responses_only)]


def utterance_controls(wav: str | Path, profile: dict, style: str) -> tuple[np.ndarray, np.ndarray]:
    """(video_content [T, 256], video_style [256]) of one utterance: `face_controls` of its speech."""
    from empatheia_jax.generators.face_render import face_controls
    from empatheia_jax.generators.speech_synth import SAMPLE_RATE, read_wav, speech_envelope

    sr, x = read_wav(wav)
    if sr != SAMPLE_RATE:
        raise ValueError(f"{wav}: {sr} Hz; the sample's media are {SAMPLE_RATE} Hz")
    return face_controls(speech_envelope(x, sr), profile, style)


def text_controls(text: str, profile: dict, style: str, speed: float | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(video_content, video_style) of one utterance without its media: the mouth follows its phonemes on
    the timeline Kokoro speaks them with in the utterance's voice (`generators.visemes`), at `speed` when
    given (as `kokoro_voices.gold_speech`), else the style's."""
    return text_targets(text, profile, style, speed)[:2]


def text_targets(text: str, profile: dict, style: str, speed: float | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`text_controls` plus video_units [T, 1]: each frame's Kokoro unit id (`visemes.frame_units`) on the
    same timeline, so frame k's unit is the phoneme its mouth opening was drawn from."""
    from empatheia_jax.generators import kokoro, kokoro_voices, visemes
    from empatheia_jax.generators.face_render import face_controls

    engine = kokoro.shared(1)
    phonemes = kokoro.phonemize(text)
    voice = kokoro_voices.voice(profile, style)
    rate = voice.speed if speed is None else float(speed)
    features = engine.content_features(phonemes)
    durations = engine.durations(features, voice.style, rate)
    frames = kokoro.frames_of(durations)
    mouth = visemes.mouth_track(phonemes, frames, energy=engine.energy(features, voice.style, durations))
    content, style_vec = face_controls(mouth, profile, style, smooth=False)
    units = visemes.frame_units(phonemes, frames).astype(np.float32)[:, None]
    if len(units) != len(content):
        raise AssertionError(f"{len(units)} frame units for {len(content)} video_content rows")
    return content, style_vec, units


def _one(job: tuple[FaceJob, str]) -> tuple[str, tuple[np.ndarray, ...] | None, str | None]:
    (uid, wav, text, profile, style, speed), mouth = job
    try:
        if mouth == "phonemes" or (mouth == "replies" and speed is not None):  # speed: a listener's
            return uid, text_targets(text, profile, style, speed), None
        return uid, utterance_controls(wav, profile, style), None
    except Exception as e:  # noqa: BLE001 - collected and reported with the utterance id
        return uid, None, f"{uid}: {type(e).__name__}: {e}"


def export_face_targets(raw: str | Path, out: str | Path, *, splits: list[str] | None = None,
                        dialogues: Iterable[Any] | None = None, workers: int = 1, shard_size: int = 512,
                        progress: bool = True, mouth: str = "speech", responses_only: bool = False
                        ) -> dict[str, int]:
    """Write video_content / video_style (source "face_render") for every utterance of RAW; counts per kind.

    mouth "speech": every utterance must have its wav; "phonemes": no media is read (`text_targets`), and
    video_units (each frame's Kokoro unit id, for a unit-aligned video block) are written too; a speech
    mouth has no units (its frames follow a waveform, not phonemes), and a stale video_units kind from an
    earlier phoneme export is removed so no unit can label a frame it was not drawn from.
    Failures are collected and raised together, nothing committed then.
    """
    from tqdm import tqdm

    from empatheia_jax.data.targets import TargetWriter

    if mouth not in MOUTHS:
        raise ValueError(f"--mouth {mouth!r}: expected one of {', '.join(MOUTHS)}")
    jobs = face_jobs(raw, splits, dialogues, responses_only)
    needs_wav = [j for j in jobs if mouth == "speech" or (mouth == "replies" and j.speed is None)]
    missing = [j.wav for j in needs_wav if not Path(j.wav).is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} utterance wav(s) missing, e.g. {missing[:3]} "
                                "(--mouth phonemes needs no media)")
    if mouth != "speech":
        from empatheia_jax.generators import kokoro

        for cut in ("durations", "energy"):  # built once here, not raced by the workers
            kokoro.cut_model(cut)
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        from empatheia_jax.generators import visemes
        from empatheia_jax.generators.kokoro_voices import MAP_VERSION

        # the style rule (utterance_style) and the phoneme mouth's voice speed follow the voice map
        meta = {"raw": str(Path(raw).resolve()), "mouth": MOUTH_METHOD[mouth],
                "voice_map_version": MAP_VERSION, "mouth_version": visemes.MOUTH_VERSION}
        kinds = (*KINDS, "video_units") if mouth != "speech" else KINDS
        writers = {k: stack.enter_context(TargetWriter(out, k, SOURCE, None, shard_size,
                                                       {**meta, "method": METHOD[k]}))
                   for k in kinds}
        tasks = [(j, mouth) for j in jobs]
        if workers > 1:
            import multiprocessing as mp

            pool = stack.enter_context(mp.get_context("spawn").Pool(workers))
            results = pool.imap(_one, tasks, chunksize=16)
        else:
            results = map(_one, tasks)
        for uid, controls, err in tqdm(results, total=len(jobs), desc="video targets (face_render)",
                                       disable=not progress):
            if err:
                errors.append(err)
                continue
            for kind, x in zip(kinds, controls, strict=False):  # a speech mouth has no units
                writers[kind].add(uid, x)
        if errors:
            raise RuntimeError(f"{len(errors)} utterance(s) failed; no targets written:\n"
                               + "\n".join(errors))
    if mouth == "speech":
        from empatheia_jax.data.targets import remove_kind

        remove_kind(out, "video_units")
    return {k: len(w) for k, w in writers.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m converters.face_targets", description=__doc__.split("\n")[0])
    ap.add_argument("--raw", required=True, help="AvaMERG folder ({split}.json, media/)")
    ap.add_argument("--out", required=True, help="TARGETS folder (other kinds there are kept)")
    ap.add_argument("--splits", default=None, help="comma-separated splits (default: every RAW/*.json)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--shard-size", type=int, default=512)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--mouth", default="speech", choices=MOUTHS,
                    help="speech: the wav's envelope (default); phonemes: Kokoro's timeline, no media; "
                         "replies: phonemes for the listener's utterances, speech for the speaker's")
    ap.add_argument("--responses-only", action="store_true",
                    help="only the turns' responses (what records read)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        splits = args.splits.split(",") if args.splits else None
        counts = export_face_targets(args.raw, args.out, splits=splits, workers=args.workers,
                                     shard_size=args.shard_size, progress=not args.quiet, mouth=args.mouth,
                                     responses_only=args.responses_only)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[video targets] wrote {counts} ({SOURCE}) in {time.perf_counter() - t0:.1f}s to {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
