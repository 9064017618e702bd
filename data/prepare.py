"""The command line of `empatheia_jax.data.prepare`: AvaMERG-format data -> ArrayRecord shards.

    python -m data.prepare --raw RAW --out SHARDS --encoder lite [--targets TARGETS] ...  (--help lists all)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from empatheia_jax import logs
from empatheia_jax.data import prepare as _lib
from empatheia_jax.data import schema
from empatheia_jax.data.prepare import prepare
from empatheia_jax.data.raw_splits import MEDIA_MODES, InvalidInputError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.prepare", description=_lib.__doc__.split("\n")[0])
    ap.add_argument("--raw", required=True, help="folder with {split}.json and media/")
    ap.add_argument("--out", required=True, help="shard folder to write")
    ap.add_argument("--encoder", default=None,
                    help="encoder name: lite (default), hubert+clip, hubert+lite, ...")
    ap.add_argument(
        "--encoder-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="encoder keyword argument, e.g. hubert_path=/models/hubert (JSON values allowed)",
    )
    ap.add_argument("--k", type=int, default=None, help="vectors per <Aud>/<Vid> placeholder (encoder k)")
    ap.add_argument("--targets", default=None, help="generator-target folder (meta.json + safetensors)")
    ap.add_argument(
        "--make-standin-targets",
        action="store_true",
        help="first compute STAND-IN targets for RAW into --targets (sample data only)",
    )
    ap.add_argument("--splits", default=None, help="comma-separated splits (default: every RAW/*.json)")
    ap.add_argument(
        "--split-by",
        default="conversation",
        choices=["conversation"],
        help="splits come from RAW/{split}.json; a conversation in two splits is an error",
    )
    ap.add_argument(
        "--skip-invalid", action="store_true", help="skip invalid dialogues, listed in the report"
    )
    ap.add_argument("--require-targets", action="store_true", help="fail if a record lacks a target kind")
    ap.add_argument("--records-per-shard", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=1, help="feature-extraction processes")
    ap.add_argument("--emotion-map", default="avamerg7", choices=list(schema.EMOTION_MAP_NAMES))
    ap.add_argument("--overwrite", action="store_true", help="replace an existing shard folder")
    ap.add_argument(
        "--media",
        default=None,
        choices=list(MEDIA_MODES),
        help="required (default): every utterance has its .wav and .mp4; none: text only (no media read, no "
        "encoder); optional: a dialogue without any media file is text-only, one with some needs all",
    )
    ap.add_argument("--text-only", action="store_true", help="the same as --media none")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--verbose", action="store_true",
                    help="library logging (absl, jax, transformers, ...) at INFO instead of WARNING")
    args = ap.parse_args(argv)
    logs.configure(args.verbose)
    kwargs: dict[str, Any] = {}
    for item in args.encoder_arg:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--encoder-arg {item!r}: expected KEY=VALUE")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    if args.k is not None:
        kwargs["k"] = args.k
    if args.text_only and args.media not in (None, "none"):
        ap.error(f"--text-only contradicts --media {args.media}")
    media = "none" if args.text_only else args.media or "required"
    if media == "none" and (args.encoder or kwargs):
        ap.error("--text-only computes no features: --encoder, --encoder-arg and --k do not apply")
    if media != "required" and args.make_standin_targets:
        ap.error("--make-standin-targets reads every utterance's media: not with --text-only or "
                 "--media optional")
    try:
        prepare(
            args.raw,
            args.out,
            encoder=args.encoder or "lite",
            encoder_kwargs=kwargs,
            targets=args.targets,
            make_standin=args.make_standin_targets,
            splits=args.splits.split(",") if args.splits else None,
            split_by=args.split_by,
            skip_invalid=args.skip_invalid,
            records_per_shard=args.records_per_shard,
            workers=args.workers,
            emotion_map=args.emotion_map,
            overwrite=args.overwrite,
            require_targets=args.require_targets,
            progress=not args.no_progress,
            media=media,
            command=shlex.join(["python", "-m", "data.prepare", *(sys.argv[1:] if argv is None else argv)]),
        )
    except (InvalidInputError, FileExistsError, FileNotFoundError) as e:
        print(f"[prepare] ERROR: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
