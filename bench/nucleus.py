"""The nucleus (top-p) filter of a sampled decode step: `generation._nucleus` (the nucleus among the top
`NUCLEUS_CANDIDATES` logits, the vocabulary sorted only when they hold less than top_p) against one sort of
the whole vocabulary, on the shape of the eval's consensus draws (a batch of 8 x 16 samples = 128 rows,
SmolLM2's 49,152 tokens), for a language model's peaked rows and for flat rows (the fallback).

    python bench/nucleus.py [--rows 128] [--vocab 49152] [--top_p 0.95] [--repeats 5]

Prints seconds per call for each and checks that both keep the same tokens.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from empatheia_jax.serve import generation


def whole_sort(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """The filter as one sort of the vocabulary (what `_nucleus` did before its top-k path)."""
    return jnp.where(logits >= generation._sorted_nucleus_threshold(logits, top_p), logits, -jnp.inf)


def seconds(fn, x: jax.Array, top_p: jax.Array, repeats: int) -> tuple[float, jax.Array]:
    out = fn(x, top_p).block_until_ready()  # compiles
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(x, top_p)
    out.block_until_ready()
    return (time.perf_counter() - start) / repeats, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--top_p", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    peaked = rng.normal(size=(args.rows, args.vocab)).astype(np.float32) * 1.5
    peaked[:, :20] += 14  # a language model's few likely tokens
    flat = rng.normal(size=(args.rows, args.vocab)).astype(np.float32) * 0.5
    top_p = jnp.float32(args.top_p)
    print(f"{jax.devices()[0].platform}, jax {jax.__version__}, [{args.rows}, {args.vocab}], "
          f"top_p {args.top_p}")
    for name, x in (("peaked", peaked), ("flat", flat)):
        x = jnp.asarray(x)
        ours, kept = seconds(jax.jit(generation._nucleus), x, top_p, args.repeats)
        sort, want = seconds(jax.jit(whole_sort), x, top_p, args.repeats)
        same = bool((jnp.isfinite(kept) == jnp.isfinite(want)).all())
        print(f"{name}: _nucleus {ours:.4f} s, whole sort {sort:.4f} s ({sort / ours:.1f}x); "
              f"{float(jnp.isfinite(kept).sum(-1).mean()):.1f} tokens kept a row; same kept set: {same}")


if __name__ == "__main__":
    main()
