"""The command line of `empatheia_jax.data.ed`: an EmpatheticDialogues csv -> AvaMERG-format JSON.

    python -m data.import_ed --csv FILE --out DIR [--split NAME]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from empatheia_jax import logs
from empatheia_jax.data import ed as _lib
from empatheia_jax.data.ed import (
    convert_ed_csv,
    dumps,
    holdout,
    split_from_filename,
    write_atomic,
    write_outputs,
)
from empatheia_jax.data.schema import (
    EmotionMap,
    validate_dialogues,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.import_ed", description=_lib.__doc__.split("\n\n")[0])
    ap.add_argument(
        "--csv", required=True, help="EmpatheticDialogues csv, e.g. empathetic_dialogues_validation.csv"
    )
    ap.add_argument("--out", required=True, help="raw AvaMERG directory to write {split}.json into")
    ap.add_argument("--split", default=None, help="split name (default: from the file name, e.g. valid)")
    ap.add_argument("--holdout", default=None, metavar="NAME:FRACTION",
                    help="also write NAME.json with about FRACTION of the conversations (whole "
                    "conversations, by a seeded hash of their id), e.g. dev:0.2; the split keeps the rest")
    ap.add_argument("--holdout-seed", type=int, default=0, help="seed of the --holdout hash")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--verbose", action="store_true",
                    help="library logging (absl, jax, transformers, ...) at INFO instead of WARNING")
    args = ap.parse_args(argv)
    logs.configure(args.verbose)
    split = args.split or split_from_filename(args.csv)
    held_name, fraction = None, 0.0
    if args.holdout:
        held_name, _, frac = args.holdout.partition(":")
        try:
            fraction = float(frac)
        except ValueError:
            fraction = -1.0
        if not held_name or held_name == split or not 0.0 < fraction < 1.0:
            ap.error(f"--holdout {args.holdout}: expected NAME:FRACTION with NAME other than {split!r} and "
                     "FRACTION in (0, 1), e.g. dev:0.2")
    result = convert_ed_csv(args.csv, progress=not args.quiet)
    problems = validate_dialogues(
        result.dialogues, source=f"{split}.json", media_dir=None, emotion_map=EmotionMap.load("avamerg7")
    )
    if problems:  # the importer's own output must be valid; refuse to write a broken split
        for p in problems[:20]:
            print(p, file=sys.stderr)
        print(f"error: conversion gave {len(problems)} schema problem(s); nothing written", file=sys.stderr)
        return 1
    held: list[dict[str, Any]] = []
    if held_name:
        result.dialogues, held = holdout(result.dialogues, fraction, args.holdout_seed)
    json_path, report_path = write_outputs(result, args.csv, args.out, split)
    if held_name:
        held_path = os.path.join(args.out, f"{held_name}.json")
        write_atomic(held_path, dumps(held))
        with open(report_path, "a", encoding="utf-8") as f:
            turns = sum(len(d["turns"]) for d in held)
            f.write(f"\nholdout: {held_name}.json {len(held)} dialogues, {turns} turns "
                    f"(fraction {fraction}, seed {args.holdout_seed})\n")
        print(f"holdout: {len(held)} dialogues -> {held_path}", file=sys.stderr)
    print(
        f"{len(result.dialogues)} dialogues, {result.num_turns} turns -> {json_path}; "
        f"{len(result.quirks)} quirk(s) -> {report_path}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
