"""Which attention kernel a `LlamaConfig.attention="auto"` call runs, decided at trace time and said once.

Why this exists: `jax.nn.dot_product_attention(implementation=None)` does not choose. In jax 0.10 it always
takes its XLA path (its source: "TODO ... defaults to XLA for now"), so an "auto" that handed it None never
reached cuDNN's flash kernel, and a 7B step at T=2048 materialised float32 [B, H, T, T] scores (issue 32).

What "auto" does instead:

- a call with a KV cache (decode, prefill into the cache) runs our grouped einsum: it reads the head-major
  cache in place, and a token's decode is bound by memory, not by the score matrix flash avoids;
- a forward without a cache (training, teacher-forced scoring) runs cuDNN where it compiles: an NVIDIA GPU,
  bfloat16 or float16 operands, and a probe that compiles this shape's attention forward and backward on
  batch 1 succeeds. The probe asks cuDNN itself (head dim limits, compute capability, cuDNN version, odd
  lengths with a mask) instead of copying jax's checks, which change between versions;
- everywhere else (CPU, TPU, float32, a refused shape) our einsum, the path every CPU test pins down.

Each distinct decision is logged once per process at INFO (`empatheia_jax.models.attention_choice`; our
loggers print INFO), except on a CPU, where only the einsum exists and the line would be noise.
`decisions()` returns what was decided so far (bench/train_step.py records it).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

_FLASH_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class Choice(NamedTuple):
    kernel: str  # "cudnn" | "einsum"
    reason: str


class Shape(NamedTuple):
    """What the kernel depends on: query length T, key length S, heads, K/V heads, head dim, dtype."""

    t: int
    s: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str


_PROBED: dict[Shape, str | None] = {}  # shape -> None if cuDNN compiled it, else why not
_SAID: dict[tuple[Shape, bool], Choice] = {}


def decisions() -> dict[tuple[Shape, bool], Choice]:
    """Every decision of this process so far: (shape, cached) -> its Choice."""
    return dict(_SAID)


def choose(shape: Shape, *, cached: bool, platform: str | None = None, probe=None) -> Choice:
    """The kernel of one "auto" attention call. `platform` defaults to jax's default backend; `probe` (a
    function of the shape returning None or a refusal) defaults to compiling cuDNN's kernel for it."""
    platform = platform or jax.default_backend()
    if cached:
        choice = Choice("einsum", "a KV-cache call: the head-major cache read in place")
    elif platform != "gpu":
        choice = Choice("einsum", f"cuDNN needs an NVIDIA GPU; the backend is {platform}")
    elif jnp.dtype(shape.dtype) not in _FLASH_DTYPES:
        choice = Choice("einsum", f"cuDNN's flash attention takes bfloat16/float16, not {shape.dtype}")
    else:
        refusal = (probe or _cudnn_refusal)(shape)
        choice = Choice("einsum", f"cuDNN refused the shape: {refusal}") if refusal else \
            Choice("cudnn", "flash attention, causal with the padding/segment mask as a bias")
    key = (shape, cached)
    if key not in _SAID:
        _SAID[key] = choice
        if platform != "cpu":
            log.info("attention (auto) T=%d S=%d heads %d/%d head_dim %d %s%s: %s (%s)", shape.t, shape.s,
                     shape.heads, shape.kv_heads, shape.head_dim, shape.dtype, ", cached" if cached else "",
                     choice.kernel, choice.reason)
    return choice


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, index, *, cached: bool,
                          implementation: str) -> jax.Array:
    """jax.nn.dot_product_attention with the arguments both of its kernels are exact with.

    q [B, T, H, D]; k, v [B, S, K, D] token-major (GQA native); mask [B, T, S] (padding, causal, segments,
    cache slots). Without a cache the attention is causal from the first slot, so `is_causal` lets cuDNN
    skip the blocks above the diagonal; the mask still applies (as cuDNN's bias). A query whose every key is
    masked (a left-padding position) also sees its own slot: our einsum gives such a row a uniform average
    and XLA's path the same, but a row of bias-only logits is the case cuDNN's own code works around; no real
    query is changed, since a real query's own slot is always a key it sees.
    """
    t, s = q.shape[1], k.shape[1]
    own = jnp.arange(s)[None, :] == (index + jnp.arange(t))[:, None]  # [T, S]
    mask = mask | (own[None] & ~mask.any(axis=-1, keepdims=True))
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None, :, :], is_causal=not cached,
                                        implementation=implementation)


def _cudnn_refusal(shape: Shape) -> str | None:
    """None if cuDNN compiles this attention's forward and backward (batch 1), else the error's first line.
    Compiled once per shape and process: a few seconds at most, against a step's compile."""
    if shape in _PROBED:
        return _PROBED[shape]
    dt = jnp.dtype(shape.dtype)
    q = jax.ShapeDtypeStruct((1, shape.t, shape.heads, shape.head_dim), dt)
    kv = jax.ShapeDtypeStruct((1, shape.s, shape.kv_heads, shape.head_dim), dt)
    mask = jax.ShapeDtypeStruct((1, shape.t, shape.s), jnp.bool_)

    def loss(q, k, v, mask):
        out = dot_product_attention(q, k, v, mask, 0, cached=False, implementation="cudnn")
        return out.astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, mask).compile()
        _PROBED[shape] = None
    except Exception as e:  # noqa: BLE001 - any refusal (NotImplementedError, ValueError, XlaRuntimeError)
        _PROBED[shape] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return _PROBED[shape]
