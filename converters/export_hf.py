"""Exports a converted or trained backbone to HuggingFace: a PEFT LoRA adapter, or a merged full checkpoint.

    python -m converters.export_hf --ckpt DIR --out OUT --peft    # adapter_config.json + adapter_model.*
    python -m converters.export_hf --ckpt DIR --out OUT --merged  # config.json + model*.safetensors + tok.

The command line only; the file formats are `empatheia_jax.weights.export_hf`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from empatheia_jax.weights.export_hf import (
    DEFAULT_MAX_SHARD_BYTES,
    STORE_DTYPES,
    ExportError,
    export_merged,
    export_peft,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m converters.export_hf",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, help="converted/trained checkpoint folder (checkpoint_io)")
    parser.add_argument("--out", required=True, help="output folder (written atomically)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--peft", action="store_true", help="PEFT LoRA adapter (+ added rows, tokenizer)")
    mode.add_argument("--merged", action="store_true", help="full HF checkpoint with LoRA merged")
    parser.add_argument("--base", default=None,
                        help="base_model_name_or_path for the adapter (default: the checkpoint's source)")
    parser.add_argument("--dtype", default="float32", choices=STORE_DTYPES,
                        help="--merged weights dtype")
    parser.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1024**3)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)

    from empatheia_jax.weights.checkpoint_io import load_checkpoint

    model, tokenizer = load_checkpoint(args.ckpt)
    try:
        if args.peft:
            base = args.base
            if base is None:
                ckpt_cfg = json.loads((Path(args.ckpt) / "config.json").read_text())
                base = ckpt_cfg.get("source") or None
            out = export_peft(model, None, args.out, base, tokenizer=tokenizer, overwrite=args.overwrite)
        else:
            out = export_merged(model, tokenizer, args.out, dtype=args.dtype,
                                max_shard_bytes=int(args.max_shard_gb * 1024**3), overwrite=args.overwrite)
    except ExportError as e:
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
