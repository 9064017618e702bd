"""What a Content Synchronizer can reach: oracle predictors of Kokoro content rows, spoken, heard by Whisper.

    python bench/cs_oracles.py --raw RUN/ed/raw --targets RUN/ed/targets [--replies 24] [--ranks 128,256]
        [--oracles gold,unit_mean,...] [--json OUT]

RAW is an imported ED folder (train.json, dev.json) and TARGETS its reply targets
(`converters.styletts2_targets --responses-only`). Each oracle is fitted on the train replies' speech_content
targets and predicts every row of a dev reply; Kokoro speaks the prediction in the reply's gold voice at speed
1 (durations from its predictor, capped as chat caps them) and Whisper tiny.en (`asr`) transcribes it:
- `gold`: the reply's own targets (the recogniser's floor on Kokoro speech);
- `unit_mean`: the mean train row of each Kokoro phoneme token: a CS told which phoneme each row renders
  (`cs_units`) and nothing else; the bar an aligned CS should pass with the context it reads from r^t;
- `position_mean`: the mean train row at each row index: the best a position-only CS (the paper's learnable
  queries) can do without reading which phoneme comes where from r^t;
- `mean`: one mean row everywhere (what a CS that learnt the mean says);
- `unit_mean_t_en` / `unit_mean_d_en`: the table's t_en (d_en) half with the other half gold, and
  `gold_shrunk_0.6`: gold rows pulled 40 % towards the mean row: where in a row intelligibility lives;
- `rank_k` (`--ranks`): gold rows projected on the mean + the top k principal directions of the train rows,
  the best affine function of k numbers per row: what a CS whose rows leave a k-wide layer
  (`vae_d_model`, then the linear `out_proj`) can say at best, however well it reads.
`--oracles` keeps a subset (speaking is the slow part).
Rows: corpus speech_wer / speech_cer over the dev replies, and the mean squared row L2 (the ccl loss's
measure) over every dev row, so a trained CS's dev ccl_speech can be read against them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _replies(raw: Path, split: str) -> list[tuple[str, str]]:
    """(utterance id, text) of the split's turn responses: the utterances the targets were exported for."""
    from converters.styletts2_targets import speech_jobs

    return [(job.uid, job.text) for job in speech_jobs(raw, [split], responses_only=True)]


def halves(t_en_from: np.ndarray, d_en_from: np.ndarray) -> np.ndarray:
    """Rows [T, 1024] with the t_en half (512) of one and the d_en half of the other: where a row is heard."""
    half = t_en_from.shape[-1] // 2
    return np.concatenate([t_en_from[:, :half], d_en_from[:, half:]], -1)


def hear(rows: np.ndarray, style: np.ndarray) -> str:
    """What Whisper tiny.en hears of Kokoro speaking `rows` in `style`, as chat speaks a reply
    (`KokoroSpeech.speak`: speed 1, durations capped)."""
    from empatheia_jax.data.encoders import asr
    from empatheia_jax.generators import kokoro
    from empatheia_jax.generators.kokoro_speech import KokoroSpeech

    audio = KokoroSpeech().speak(rows, style, len(rows))
    return asr.shared().transcribe(audio, kokoro.SAMPLE_RATE).text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/cs_oracles.py", description=__doc__.split("\n")[0])
    ap.add_argument("--raw", required=True, type=Path)
    ap.add_argument("--targets", required=True, type=Path)
    ap.add_argument("--replies", type=int, default=24, help="dev replies spoken and heard")
    ap.add_argument("--max_rows", type=int, default=256, help="rows a CS predicts (max_speech_len)")
    ap.add_argument("--ranks", default="", help="comma-separated k of the rank_k oracles (none by default)")
    ap.add_argument("--oracles", default="", help="comma-separated oracles to speak (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from tqdm import tqdm

    from empatheia_jax.data.encoders import asr
    from empatheia_jax.data.targets import TargetReader
    from empatheia_jax.generators import kokoro
    from empatheia_jax.generators.kokoro_speech import KokoroSpeech

    t0 = time.perf_counter()
    reader = TargetReader(args.targets)
    n_units, dim, L = KokoroSpeech.num_units, kokoro.CONTENT_DIM, args.max_rows
    unit_sum, unit_n = np.zeros((n_units, dim)), np.zeros(n_units)
    pos_sum, pos_n = np.zeros((L, dim)), np.zeros(L)
    second = np.zeros((dim, dim))  # sum of row outer products: the rows' covariance for the rank_k oracles
    for uid, text in tqdm(_replies(args.raw, "train"), desc="fit oracles", unit="reply"):
        rows = reader.get("speech_content", uid)[:L].astype(np.float64)
        units = KokoroSpeech.content_units(text)[:L]
        if len(units) != len(rows):
            raise SystemExit(f"{uid}: {len(units)} units but {len(rows)} target rows (another phonemizer?)")
        np.add.at(unit_sum, units, rows)
        np.add.at(unit_n, units, 1)
        pos_sum[: len(rows)] += rows
        pos_n[: len(rows)] += 1
        second += rows.T @ rows
    mean = unit_sum.sum(0) / unit_n.sum()
    _, vectors = np.linalg.eigh(second / unit_n.sum() - np.outer(mean, mean))  # ascending eigenvalues
    unit_mean = np.where(unit_n[:, None] > 0, unit_sum / np.maximum(unit_n, 1)[:, None], mean)
    position_mean = np.where(pos_n[:, None] > 0, pos_sum / np.maximum(pos_n, 1)[:, None], mean)

    oracles = {
        "gold": lambda rows, units: rows,
        "unit_mean": lambda rows, units: unit_mean[units],
        "position_mean": lambda rows, units: position_mean[: len(rows)],
        "mean": lambda rows, units: np.broadcast_to(mean, rows.shape),
        # which half of a row is heard: one half the unit-mean table's, the other gold
        "unit_mean_t_en": lambda rows, units: halves(unit_mean[units], rows),
        "unit_mean_d_en": lambda rows, units: halves(rows, unit_mean[units]),
        # a regression's shrinkage towards the mean, on gold rows
        "gold_shrunk_0.6": lambda rows, units: 0.6 * rows + 0.4 * mean,
    }
    for k in (int(k) for k in args.ranks.split(",") if k):
        basis = vectors[:, -k:]  # the top k principal directions
        oracles[f"rank_{k}"] = lambda rows, units, b=basis: mean + (rows - mean) @ b @ b.T
    if args.oracles:
        unknown = set(args.oracles.split(",")) - oracles.keys()
        if unknown:
            raise SystemExit(f"--oracles: no oracle {sorted(unknown)}; there are {sorted(oracles)}")
        oracles = {name: f for name, f in oracles.items() if name in args.oracles.split(",")}
    dev = _replies(args.raw, "dev")
    l2 = {name: [] for name in oracles}
    for uid, text in dev:
        rows = reader.get("speech_content", uid)[:L].astype(np.float64)
        units = KokoroSpeech.content_units(text)[:L]
        for name, f in oracles.items():
            l2[name].append(np.sum((f(rows, units) - rows) ** 2, -1))
    refs, heard = [], {name: [] for name in oracles}
    for uid, text in tqdm(dev[: args.replies], desc="speak and hear", unit="reply"):
        rows = reader.get("speech_content", uid)[:L]
        units = KokoroSpeech.content_units(text)[:L]
        style = reader.get("speech_style", uid)
        refs.append(text)
        for name, f in oracles.items():
            heard[name].append(hear(np.asarray(f(rows, units), np.float32), style))
    out = {name: {"speech_wer": asr.word_error_rate(refs, heard[name]),
                  "speech_cer": asr.char_error_rate(refs, heard[name]),
                  "row_l2": float(np.concatenate(l2[name]).mean())} for name in oracles}
    out["_meta"] = {"train_replies": int(pos_n[0]), "dev_replies": len(dev), "heard": len(refs),
                    "seconds": round(time.perf_counter() - t0, 1)}
    print(f"{'oracle':<14} {'speech_wer':>10} {'speech_cer':>10} {'row_l2':>9}")
    for name in oracles:
        r = out[name]
        print(f"{name:<14} {r['speech_wer']:>10.3f} {r['speech_cer']:>10.3f} {r['row_l2']:>9.1f}")
    print(json.dumps(out["_meta"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
