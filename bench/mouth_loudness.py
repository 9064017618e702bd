"""How well a reply's mouth track moves with its speech: its phonemes alone, or with Kokoro's loudness.

    python bench/mouth_loudness.py --shards RUN/ed/shards [--split dev] [--replies 16] [--json OUT]

SHARDS are text shards with Kokoro reply targets (`launch/ed_reference.py`'s RUN/ed/shards). For the first
REPLIES records: the gold speech is Kokoro speaking the record's speech targets (`gold_speech_from_targets`,
the timeline its phoneme mouth was laid on); each mouth track (`visemes.mouth_track` without and with
`energy=Kokoro.energy`) is scored by the eval's `lip_sync` against that speech's RMS envelope, as a track
and drawn on the record's gold avatar (`render_controls`, FaceMesh landmarks). The drawn figure is what the
eval's lip-sync row measures for a model that predicts the track exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", required=True)
    ap.add_argument("--split", default="dev")
    ap.add_argument("--replies", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from empatheia_jax.data.shard_reader import ShardReader
    from empatheia_jax.eval.metrics.video import lip_sync
    from empatheia_jax.eval.speech import gold_speech_from_targets
    from empatheia_jax.generators import kokoro, visemes
    from empatheia_jax.generators.face_paint import MOUTH_LEVELS
    from empatheia_jax.generators.face_render import CONTENT_MOUTH, render_controls
    from empatheia_jax.generators.kokoro_voices import LISTENER_SPEED, to_pcm16
    from empatheia_jax.generators.speech_synth import speech_envelope

    reader = ShardReader.for_split(args.shards, args.split)
    engine = kokoro.shared(1)
    scores: dict[str, list[float]] = {}
    for i in tqdm(range(min(args.replies, len(reader))), desc="replies", unit="reply"):
        rec = reader[i]
        t = rec["targets"]
        content = np.asarray(t["speech_content"], np.float32)
        style = np.asarray(t["speech_style"], np.float32)
        env = speech_envelope(to_pcm16(gold_speech_from_targets(content, style)), kokoro.SAMPLE_RATE)
        phonemes = kokoro.phonemize(rec["response"])
        features = engine.content_features(phonemes)
        durations = engine.durations(features, style, LISTENER_SPEED)
        frames = kokoro.frames_of(durations)
        energy = engine.energy(features, style, durations)
        tracks = {"phonemes": visemes.mouth_track(phonemes, frames),
                  "phonemes_loudness": visemes.mouth_track(phonemes, frames, energy=energy)}
        controls = np.asarray(t["video_content"], np.float32)
        video_style = np.asarray(t["video_style"], np.float32)
        for name, track in tracks.items():
            if len(track) != len(controls):
                raise ValueError(f"record {i}: {len(track)} frames for {len(controls)} video_content rows")
            drawn = controls.copy()
            drawn[:, CONTENT_MOUTH] = np.round(track * (MOUTH_LEVELS - 1)) / (MOUTH_LEVELS - 1)
            scores.setdefault(f"{name}_track", []).append(lip_sync(track, env))
            scores.setdefault(f"{name}_drawn", []).append(lip_sync(render_controls(drawn, video_style), env))
    result: dict[str, float | int] = {k: float(np.nanmean(v)) for k, v in scores.items()}
    result["replies"] = min(args.replies, len(reader))
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
