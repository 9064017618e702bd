"""Matmul precision "bfloat16" on every device: the backbone's float32 dots with bfloat16 operands.

Why a module of its own: it is a numerics policy (custom VJP, a context flag the decoding programs flip),
not a step of the model's story, and `serve/generation.py` needs it without the rest of `llama.py`.
"""

from __future__ import annotations

import contextvars
import functools

import jax
import jax.numpy as jnp

#
# `jax_default_matmul_precision="bfloat16"` (config.model.matmul_precision) means bfloat16 operands with
# float32 accumulation: one MXU pass on TPU, BF16_BF16_F32 on GPU. XLA:CPU ignores the precision of a dot
# (and its algorithm), so there a float32 model never gets the faster bf16 dot kernels (on this project's
# AVX512-BF16 CPUs 1.8x a float32 dot: docs/benchmarks.md "The coe step on the CPU"). The backbone's dense
# projections and its LM head therefore cast their float32 operands themselves under that precision, on
# every device alike, and so do their gradients: JAX would transpose `dot(bf16, bf16) -> f32` into a float32
# dot of the float32 cotangent, so the custom VJP casts the cotangent too, as XLA does for a bf16-precision
# dot's transpose. Activations, norms, softmax, LoRA's rank-r dots and the optimizer stay float32.


_FLOAT32_OPERANDS = contextvars.ContextVar("llama_float32_operands", default=False)


def bf16_operands() -> bool:
    """Whether float32 dots run with bfloat16 operands: the trace-time matmul precision (part of jit's cache
    key, so flipping it retraces), unless traced inside `with_float32_operands`."""
    return not _FLOAT32_OPERANDS.get() and jax.config.jax_default_matmul_precision == "bfloat16"


def with_float32_operands(fn):
    """`fn` traced with float32 dot operands whatever the precision: the decoding programs
    (serve/generation). XLA:CPU's DotThunk, which some dots of a decode loop lower to, has no BF16 x BF16
    = F32 kernel (UNIMPLEMENTED at run time), and a memory-bound decode step would only pay for casting
    every weight per token. Only for functions traced nowhere else: the flag is not part of jit's cache
    key."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        token = _FLOAT32_OPERANDS.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _FLOAT32_OPERANDS.reset(token)

    return traced


def _transposed_specs(spec: str) -> tuple[str, str]:
    """'a,b->c' -> ('c,b->a', 'a,c->b'): the einsums of the two input cotangents (every index of an input
    is in the other input or the output, true of the specs here)."""
    inputs, out = spec.split("->")
    a, b = inputs.split(",")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


def _bf16_dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum(spec) of two bfloat16 arrays into float32, as ONE `dot_general` in its own output order
    (batch, a's free, b's free) and a transpose after it. Why not `jnp.einsum`: XLA:CPU hands a
    BF16 x BF16 = F32 dot whose output order it must permute (e.g. 'bkgts,bksd->btkgd') to its DotThunk,
    which has no such kernel (UNIMPLEMENTED at run time); in dot_general's own order the YNNPACK kernels
    take it. The operands are swapped where that gives the output's order ('btkgd,bkgts->bksd'), since a
    transpose after the dot that XLA can fold into its layout fails the same way
    (tests/test_bf16_operands.py). Each index is in both inputs (batch: also in the output; else
    contracted) or in one input and the output; '...' (the same count wherever it appears) names leading
    axes."""
    ins, out = spec.split("->")
    sa, sb = ins.split(",")
    if "..." in spec:
        lead = "".join(chr(ord("A") + i) for i in range((a.ndim if "..." in sa else b.ndim) - len(
            (sa if "..." in sa else sb).replace("...", ""))))
        sa, sb, out = (x.replace("...", lead) for x in (sa, sb, out))
    batch = [c for c in sa if c in sb and c in out]
    free_a, free_b = [c for c in out if c not in sb], [c for c in out if c not in sa]
    if free_b + free_a == [c for c in out if c not in batch]:
        a, b, sa, sb = b, a, sb, sa  # b's free axes first in the output: swapped, the natural order
    contract = [c for c in sa if c in sb and c not in out]
    dims = (([sa.index(c) for c in contract], [sb.index(c) for c in contract]),
            ([sa.index(c) for c in batch], [sb.index(c) for c in batch]))
    y = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    natural = batch + [c for c in sa if c not in sb] + [c for c in sb if c not in sa]
    perm = [natural.index(c) for c in out]
    return y if perm == sorted(perm) else jnp.transpose(y, perm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bf16_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return _bf16_dot(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))


def _bf16_einsum_fwd(spec, a, b):
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return _bf16_dot(spec, a, b), (a, b)


def _bf16_einsum_bwd(spec, residuals, g):
    a, b = residuals
    g = g.astype(jnp.bfloat16)
    da_spec, db_spec = _transposed_specs(spec)
    return _bf16_dot(da_spec, g, b), _bf16_dot(db_spec, a, g)


_bf16_einsum.defvjp(_bf16_einsum_fwd, _bf16_einsum_bwd)


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`einsum(spec, a, b)` with float32 output; float32 operands under matmul precision "bfloat16" go in as
    bfloat16 (with a bfloat16 gradient), on every device."""
    if a.dtype == b.dtype == jnp.float32 and bf16_operands():
        return _bf16_einsum(spec, a, b)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """nnx.Linear's dot (last axis of x with the kernel's first): `einsum_f32` where it applies."""
    if (lhs.dtype == rhs.dtype == jnp.float32 and precision is None and preferred_element_type is None
            and kwargs.get("out_sharding") is None and bf16_operands()):
        return _bf16_einsum("...i,io->...o", lhs, rhs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)
