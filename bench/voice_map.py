"""Can a probe read the listener's profile back from the voice map, whatever the emotion? And what do the
profiles sound like?

`chat --listener` pins a profile and lets the predicted emotion move the voice, so eval's pinned rows ask a
probe fitted on gold voices which age / gender / timbre it hears. This measures the map itself:
- the probe table: every profile (4 ages x 2 genders x 3 timbres) in each listener style
  (`speech_synth.listener_style` of the seven emotions), scored by the nearest-centroid probe and the
  shrinkage LDA (`eval/metrics/speech.py`), each fitted on the same 96 vectors ("grid") and on `--train`
  random draws of (profile, emotion) over `--seeds` seeds ("draws": min / mean);
- with `--f0`, Kokoro speaks one sentence in each age and timbre (neutral) and in four emotions, and prints
  the median F0 (librosa's yin) and the d-vector cosine between extremes (resemblyzer).

    python bench/voice_map.py [--train 24] [--seeds 10] [--f0]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from empatheia_jax.data.schema import AGES, EMOTIONS_7, GENDERS, TIMBRES  # noqa: E402
from empatheia_jax.eval.metrics.speech import LinearStyleProbe, StyleClassifier  # noqa: E402
from empatheia_jax.generators import kokoro_voices  # noqa: E402
from empatheia_jax.generators.speech_synth import listener_style  # noqa: E402

PROFILE = ("age", "gender", "timbre")
SENTENCE = "I am really glad you told me about it, that sounds wonderful."


def probe_table(train: int, seeds: int) -> list[str]:
    profiles = [dict(age=a, gender=g, timbre=t) for a, g, t in itertools.product(AGES, GENDERS, TIMBRES)]
    styles = sorted({listener_style(e) for e in EMOTIONS_7})
    grid = np.stack([kokoro_voices.voice(p, s).style for p in profiles for s in styles])
    truth = {k: [p[k] for p in profiles for _ in styles] for k in PROFILE}
    lines = [f"voice map version {kokoro_voices.MAP_VERSION}; {len(grid)} gold vectors, styles {styles}",
             "| probe | fitted on | age | gender | timbre |", "|---|---|---|---|---|"]
    for probe in (StyleClassifier, LinearStyleProbe):
        acc = probe().fit(grid, truth).accuracy(grid, truth)
        lines.append(f"| {probe.__name__} | grid | " + " | ".join(f"{acc[k]:.2f}" for k in PROFILE) + " |")
        runs = []
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            picks = [(profiles[rng.integers(len(profiles))], listener_style(EMOTIONS_7[rng.integers(7)]))
                     for _ in range(train)]
            x = np.stack([kokoro_voices.voice(p, s).style for p, s in picks])
            runs.append(probe().fit(x, {k: [p[k] for p, _ in picks] for k in PROFILE}).accuracy(grid, truth))
        lines.append(f"| {probe.__name__} | {train} draws x {seeds} seeds (min / mean) | " + " | ".join(
            f"{min(r[k] for r in runs):.2f} / {np.mean([r[k] for r in runs]):.2f}" for k in PROFILE) + " |")
    return lines


def f0_lines() -> list[str]:
    import librosa

    from empatheia_jax.eval.metrics.speech import embed
    from empatheia_jax.generators import kokoro

    engine = kokoro.shared(1)
    content = engine.content_features(kokoro.phonemize(SENTENCE))

    def say(profile, style):
        v = kokoro_voices.voice(profile, style)
        return engine.synthesize(content, v.style, v.speed)

    def f0(wav):
        track = librosa.yin(wav, fmin=60, fmax=500, sr=kokoro.SAMPLE_RATE, frame_length=1200, hop_length=300)
        rms = librosa.feature.rms(y=wav, frame_length=1200, hop_length=300)[0][: len(track)]
        return float(np.median(track[: len(rms)][rms > 0.02]))

    lines = [f"median F0 (Hz) of {SENTENCE!r}, neutral unless named"]
    for gender in GENDERS:
        ages = {a: say(dict(age=a, gender=gender, timbre="mid"), "neutral") for a in AGES}
        timbres = {t: say(dict(age="young", gender=gender, timbre=t), "neutral") for t in TIMBRES}
        e_age = {a: embed(ages[a], kokoro.SAMPLE_RATE) for a in ("child", "elderly")}
        e_tim = {t: embed(timbres[t], kokoro.SAMPLE_RATE) for t in ("low", "high")}
        lines.append(f"{gender}: ages " + " / ".join(f"{a} {f0(w):.0f}" for a, w in ages.items())
                     + "; young timbres " + " / ".join(f"{t} {f0(w):.0f}" for t, w in timbres.items())
                     + f"; d-vector cosine child-elderly {e_age['child'] @ e_age['elderly']:.2f}, "
                     f"low-high {e_tim['low'] @ e_tim['high']:.2f}")
    young = dict(age="young", gender="female", timbre="mid")
    lines.append("young female: " + " / ".join(f"{s} {f0(say(young, s)):.0f}"
                                                for s in ("happy", "surprised", "sad", "empathetic")))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", type=int, default=24, help="random gold voices a probe is fitted on")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--f0", action="store_true", help="also speak the profiles with Kokoro (~1 min)")
    args = ap.parse_args()
    print("\n".join(probe_table(args.train, args.seeds)))
    if args.f0:
        print("\n".join(f0_lines()))


if __name__ == "__main__":
    main()
