"""Speech-out benchmark: our cut Kokoro pipeline beside the reference (the uncut Kokoro ONNX graph), same run.

    python bench/speech.py [--threads 1] [--repeats 3] [--sentences 6] [--raw work/sample] [--json OUT]

Measured on the same sentences, voices and onnxruntime threads:
- synthesis: the uncut `kokoro-v1.0.int8.onnx` (tokens, style, speed -> audio; what kokoro-onnx runs) vs our
  two cuts (encoder -> t_en ++ d_en rows -> synthesizer), real-time factor = compute seconds / audio
  seconds, and their ratio; both sides are checked to give the same samples first;
- content targets: phonemize + encoder (what converters.styletts2_targets --backend kokoro runs per
  utterance), utterances/s;
- target export (with --raw): `export_speech_targets` over a whole AvaMERG folder, utterances/s.
Each figure is the median of --repeats runs (best also printed: other processes share the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SENTENCES = (
    "I am so sorry to hear that. How are you holding up?",
    "That sounds like a wonderful day, you must have been thrilled.",
    "Losing a friend to distance is hard, and it is okay to miss her.",
    "What happened after you told your boss about it?",
    "I can imagine how frightening that must have been for you and your family.",
    "Thank you for telling me. Would you like to talk about what helped last time?",
)


def timed(fn, repeats: int) -> tuple[float, float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sentences", type=int, default=len(SENTENCES))
    ap.add_argument("--raw", default=None, help="an AvaMERG folder to time the target export on")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from empatheia_jax.generators import kokoro
    from empatheia_jax.generators.kokoro_voices import voice

    engine = kokoro.Kokoro(threads=args.threads)
    profiles = [{"age": a, "gender": g, "timbre": "mid"} for a, g in
                (("young", "female"), ("middle-aged", "male"), ("elderly", "female"), ("child", "male"))]
    rows = []
    for i, text in enumerate(SENTENCES[: args.sentences]):
        ph = kokoro.phonemize(text)
        style = voice(profiles[i % len(profiles)], "empathetic").style
        engine.full_model(ph, style)  # warm-up: session load, first-call allocation
        engine.synthesize(engine.content_features(ph), style)
        ref_t, ref_best, ref = timed(lambda ph=ph, s=style: engine.full_model(ph, s), args.repeats)
        def cut(ph=ph, s=style):
            return engine.synthesize(engine.content_features(ph), s)

        our_t, our_best, ours = timed(cut, args.repeats)
        if not np.array_equal(ref, ours):
            raise SystemExit(f"sentence {i}: the cut pipeline's audio differs from the uncut model's")
        seconds = len(ours) / kokoro.SAMPLE_RATE
        rows.append({"phonemes": kokoro.content_length(ph), "audio_s": seconds, "reference_s": ref_t,
                     "ours_s": our_t, "reference_best_s": ref_best, "ours_best_s": our_best})
    audio = sum(r["audio_s"] for r in rows)
    rtf_ref, rtf_ours = sum(r["reference_s"] for r in rows) / audio, sum(r["ours_s"] for r in rows) / audio
    texts = list(SENTENCES[: args.sentences]) * 5
    enc_t, enc_best, _ = timed(lambda: [engine.content_features(kokoro.phonemize(t)) for t in texts],
                               args.repeats)
    result = {
        "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
                  f"onnxruntime threads={args.threads}",
        "sentences": len(rows), "audio_seconds": round(audio, 2),
        "rtf_reference_uncut": round(rtf_ref, 3), "rtf_ours_cut": round(rtf_ours, 3),
        "ours_over_reference_time": round(rtf_ours / rtf_ref, 3),
        "content_targets_utt_per_s": round(len(texts) / enc_t, 1),
        "content_targets_utt_per_s_best": round(len(texts) / enc_best, 1),
    }
    if args.raw:
        from converters.styletts2_targets import export_speech_targets, speech_jobs

        n = len(speech_jobs(args.raw))
        for workers in (1, 2):
            with tempfile.TemporaryDirectory() as tmp:
                t = time.perf_counter()
                export_speech_targets(args.raw, Path(tmp) / "targets", workers=workers, progress=False)
                result[f"export_utt_per_s_workers{workers}"] = round(n / (time.perf_counter() - t), 1)
        result["export_utterances"] = n
    for k, v in result.items():
        print(f"{k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "per_sentence": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
