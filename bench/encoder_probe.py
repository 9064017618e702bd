"""Do the input encoders' features carry what the model should read from the media? A linear probe per
shards folder, fitted on one split's utterances and scored on another's.

The same AvaMERG sample prepared with two encoders (e.g. `lite` and `whisper_tiny_en+facemesh`) differs only
in its `<Aud>` / `<Vid>` features, so a probe on those features measures the encoders apart from the LLM
training's noise (40 test turns of a short demo run move the emotion accuracy by ~0.07 per turn flipped).
Each history utterance (deduplicated by utt_id across the turns that repeat it) is one example: its audio
rows, its video rows, or both, averaged over the encoder's k chunks. Labels: the speaker's emotion (7
classes, the record's `emotion` label) on the speaker's utterances; the profile (age, gender, timbre) of
whoever speaks it on every utterance. The probe is eval's `LinearStyleProbe` (shrinkage LDA on standardised
features), fitted on `--fit` and scored on `--score`; the majority class of the fitted split is the floor.

    python bench/encoder_probe.py --shards work/shards work/shards_real
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from empatheia_jax.data.schema import EMOTIONS_7  # noqa: E402
from empatheia_jax.data.shard_format import decode_shard_record, load_manifest, shard_paths  # noqa: E402
from empatheia_jax.eval.metrics.speech import LinearStyleProbe  # noqa: E402

ATTRS = ("emotion", "age", "gender", "timbre")


def utterances(shards: Path, split: str) -> list[dict]:
    """One entry per history utterance with media: {audio, video, emotion (speaker only), age, gender,
    timbre}."""
    from array_record.python.array_record_module import ArrayRecordReader

    seen: dict[str, dict] = {}
    for path in shard_paths(shards, split):
        reader = ArrayRecordReader(str(path))
        for i, blob in enumerate(reader.read_all()):
            rec = decode_shard_record(blob, shard=path, index=i)
            n = len(rec["history"])
            if n == 0 or len(rec["audio_feats"]) % n or len(rec["video_feats"]) % n:
                continue  # text-only history: no media rows to read
            audio = rec["audio_feats"].reshape(n, -1, rec["audio_feats"].shape[-1]).mean(1)
            video = rec["video_feats"].reshape(n, -1, rec["video_feats"].shape[-1]).mean(1)
            emotion = rec["labels"]["emotion"]
            for j, u in enumerate(rec["history"]):
                if u["utt_id"] in seen:
                    continue
                profile = rec["speaker_profile" if u["role"] == "speaker" else "listener_profile"]
                seen[u["utt_id"]] = {
                    "audio": audio[j], "video": video[j],
                    "emotion": EMOTIONS_7[emotion] if u["role"] == "speaker" and emotion >= 0 else None,
                    **{a: profile.get(a) for a in ("age", "gender", "timbre")},
                }
        reader.close()
    return list(seen.values())


def probe(fit: list[dict], score: list[dict], part: str) -> dict[str, float]:
    def x(rows: list[dict]) -> np.ndarray:
        cols = {"audio": ["audio"], "video": ["video"], "both": ["audio", "video"]}[part]
        return np.stack([np.concatenate([r[c] for c in cols]) for r in rows])

    labels = {a: [r[a] for r in fit] for a in ATTRS}
    model = LinearStyleProbe().fit(x(fit), labels)
    pred = model.predict(x(score))
    out = {}
    for a in ATTRS:
        pairs = [(p, r[a]) for p, r in zip(pred[a], score, strict=True) if r[a] is not None]
        out[a] = sum(p == str(t) for p, t in pairs) / max(1, len(pairs))
    return out


def majority(fit: list[dict], score: list[dict]) -> dict[str, float]:
    out = {}
    for a in ATTRS:
        top = Counter(str(r[a]) for r in fit if r[a] is not None).most_common(1)[0][0]
        truth = [str(r[a]) for r in score if r[a] is not None]
        out[a] = sum(t == top for t in truth) / max(1, len(truth))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", nargs="+", required=True, help="shards folders of the same sample")
    ap.add_argument("--fit", default="train")
    ap.add_argument("--score", default="test")
    ap.add_argument("--json", default=None, help="also write the table here")
    args = ap.parse_args()
    rows = []
    for folder in map(Path, args.shards):
        enc = load_manifest(folder).get("encoder") or {}
        fit, score = utterances(folder, args.fit), utterances(folder, args.score)
        name = enc.get("name", "?")
        n_speaker = sum(r["emotion"] is not None for r in score)
        if not rows:
            rows.append({"encoder": "majority class", **majority(fit, score)})
        for part in ("audio", "video", "both"):
            rows.append({"encoder": name, "part": part, **probe(fit, score, part)})
        print(f"{folder}: {name}, {len(fit)} {args.fit} / {len(score)} {args.score} utterances "
              f"({n_speaker} speaker's)", file=sys.stderr)
    print("| encoder | features | " + " | ".join(ATTRS) + " |")
    print("|---|---|" + "---|" * len(ATTRS))
    for r in rows:
        print(f"| {r['encoder']} | {r.get('part', '-')} | " + " | ".join(f"{r[a]:.3f}" for a in ATTRS) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
