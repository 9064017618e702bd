"""Converts an HF LLaMA checkpoint (safetensors folder or GGUF file) into a converted-checkpoint folder.

    python -m converters.hf_to_flax --src SRC --out DIR [--dtype float32|bfloat16] [--extra-vocab N]

The command line only; the conversion is `empatheia_jax.weights.hf_to_flax.convert`.
"""

from __future__ import annotations

import argparse
import sys

from empatheia_jax import logs
from empatheia_jax.weights.hf_names import ConversionError
from empatheia_jax.weights.hf_to_flax import DTYPES, convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m converters.hf_to_flax", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--src", required=True, help="HF folder (config.json + safetensors) or a .gguf file")
    parser.add_argument("--out", required=True, help="output folder (converted checkpoint)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="parameter and compute dtype")
    parser.add_argument("--extra-vocab", type=int, default=0,
                        help="rows appended for added tokens, initialised at the mean of the existing rows")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--verbose", action="store_true",
                        help="library logging (absl, jax, transformers, ...) at INFO instead of WARNING")
    args = parser.parse_args(argv)
    logs.configure(args.verbose)
    try:
        out = convert(args.src, args.out, dtype=args.dtype, extra_vocab=args.extra_vocab,
                      overwrite=args.overwrite)
    except (ConversionError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
