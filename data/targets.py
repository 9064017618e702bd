"""The command line of `empatheia_jax.data.targets`: stand-in targets for a RAW folder, or a targets folder's
summary and check.

    python -m data.targets standin --raw RAW --out TARGETS [--splits a,b] [--workers 2]
    python -m data.targets info TARGETS
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from empatheia_jax.data import targets as _lib
from empatheia_jax.data.targets import (
    TargetReader,
    make_standin_targets,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.targets",
                                 description=_lib.__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("standin", help="compute stand-in targets for a RAW folder (sample data)")
    s.add_argument("--raw", required=True, help="RAW folder with {split}.json and media/")
    s.add_argument("--out", required=True, help="TARGETS folder to write")
    s.add_argument("--splits", default=None, help="comma-separated splits (default: every RAW/*.json)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--shard-size", type=int, default=512)
    s.add_argument("--workers", type=int, default=1)
    i = sub.add_parser("info", help="print meta.json and verify every tensor")
    i.add_argument("dir")
    args = ap.parse_args(argv)
    if args.cmd == "standin":
        t0 = time.perf_counter()
        counts = make_standin_targets(
            args.raw,
            args.out,
            splits=args.splits.split(",") if args.splits else None,
            seed=args.seed,
            shard_size=args.shard_size,
            workers=args.workers,
        )
        print(f"[targets] wrote stand-in targets {counts} in {time.perf_counter() - t0:.1f}s to {args.out}")
        return 0
    reader = TargetReader(args.dir)
    print(json.dumps(reader.summary(), indent=2))
    problems = reader.verify()
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
