"""The one transformer-VAE block behind the Content Synchronizer and the Style Disentangler (paper eqs 1-6).

    z   = Enc(FFN(h), q)     learnable queries q [Q, d_model] self-attend and cross-attend to FFN(h)
    out = Dec(FFN'(z), q)    the same queries self-attend and cross-attend to FFN'(z)

One output row per query: row i of `out` predicts target row i (CS: phoneme / video frame i; SD: the
emotion or profile code). The CS instantiates it once per modality over r^t, the SD twice per modality
(emotion, profile) over r^s / r^v; `empatheia_jax.models.heads` assembles them.

A block with `num_units` > 0 aligns its rows to content units: query i is q_i + U[unit_i] for the unit
(e.g. the phoneme) that target row i stands for, given per example, so row i knows WHAT it renders and
cross-attention to h supplies HOW (docs/design.md "Aligned Content Synchronizer").

Attention is Flax's own `nnx.MultiHeadAttention`: its `kernel_init` / `out_kernel_init` / `bias_init` /
`out_bias_init` take `nnx.with_partitioning` initializers, so every projection carries logical axis names
and nothing had to be rewritten. Parameters are created inside `nnx.use_eager_sharding(False)`, as in the
backbone: placement comes from `empatheia_jax.sharding` at jit time.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx, struct

from empatheia_jax.models.unit_context import UnitContext

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """Shape of one VAE block.

    d_in: width of the input rows h (the LLM's d_model); d_model: the block's internal width;
    num_queries: Q, the number of learnable queries = output rows; d_latent: width of z per query;
    d_out: width of an output row (e.g. 1024 for StyleTTS2 content, 256 for a style half).
    positions: add sinusoidal positions to both attention memories. Cross-attention is otherwise
    permutation-invariant over the memory rows, and the CS must map the i-th response token / latent row
    to output row i; the positions count valid rows only, so left or right padding gives the same result.
    logvar_limit: logvar is soft-clamped to (-limit, limit) with limit*tanh(x/limit), so exp(logvar) can
    neither overflow nor underflow early in training while keeping a gradient everywhere.
    num_units: size of the unit vocabulary the queries are aligned to (0 = position-only queries, the
    paper's block); the block then needs `units` [B, Q] ids in [0, num_units) on every call.
    conv_kernel: width of a depthwise convolution over the query rows in every layer (0 = none, the
    paper's block). A unit-aligned row's content depends on its neighbours (Kokoro's text encoder is a CNN
    + BiLSTM over the phonemes); learnable absolute queries reach a neighbour only through attention
    patterns learnt separately at every index, a convolution reads it at any index with one kernel.
    unit_context: read the unit rows U[unit_i] in context before they join the queries
    (`models.unit_context.UnitContext`: Kokoro's text-encoder shape, convolutions and a BiLSTM over the
    units); needs num_units > 0. Such a block's encoder cross-attention to h starts silent (zero output
    projection): the units alone define its first function, and h refines it.
    context_width: the width of the unit_context reader (0 = d_model); Kokoro's own text encoder reads at 512.
    context_skip: the reader's features also reach the output rows directly, through a linear map from its
    width to d_out that starts at 0, past the d_model-wide stacks. An output row is otherwise a linear
    function of one d_model-wide vector, and the rows a listener hears (Kokoro's 512-wide t_en) are heard
    worse when projected on fewer principal directions than that (docs/benchmarks.md "How wide a row must
    come from"); a reader alone, mapped linearly to the rows, was heard at WER 0.162.
    d_used: the leading dims of an output row its consumer reads (0 = all d_out); the rest are exactly 0.
    The embedded face generator reads 2 of its 256 content dims (mouth, eyelids) and its targets hold 0 in
    the others: a learnt projection there only adds noise on unseen inputs, which on ED dev was half the
    video rows' error (docs/benchmarks.md "The face's unused control dims").
    dtype: compute dtype (bf16 on accelerators); param_dtype: parameter dtype (fp32 master weights).
    The mu/logvar heads always compute in float32 and every output is float32.
    """

    d_in: int
    d_model: int
    num_queries: int
    d_latent: int
    d_out: int
    num_heads: int
    enc_layers: int = 4
    dec_layers: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    positions: bool = True
    logvar_limit: float = 10.0
    num_units: int = 0
    conv_kernel: int = 0
    unit_context: bool = False
    context_width: int = 0
    context_skip: bool = False
    d_used: int = 0
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        problems = []
        # Zero layers would make mu ignore h (or out ignore z): never what a config means.
        for name in ("d_in", "d_model", "num_queries", "d_latent", "d_out", "num_heads", "enc_layers",
                     "dec_layers"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads > 0 and self.d_model % self.num_heads:
            problems.append(f"d_model={self.d_model} is not a multiple of num_heads={self.num_heads}")
        if self.mlp_ratio <= 0:
            problems.append(f"mlp_ratio={self.mlp_ratio} must be positive")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        if self.num_units < 0:
            problems.append(f"num_units={self.num_units} must be >= 0 (0 = no unit alignment)")
        if self.conv_kernel < 0 or (self.conv_kernel and self.conv_kernel % 2 == 0):
            problems.append(f"conv_kernel={self.conv_kernel} must be 0 (none) or a positive odd width")
        if self.unit_context and self.num_units <= 0:
            problems.append("unit_context=True needs num_units > 0 (it reads the units of the rows)")
        if self.context_width < 0 or self.context_width % 2:
            problems.append(f"context_width={self.context_width} must be 0 (d_model) or a positive even "
                            "width (two LSTM directions)")
        if self.context_width and not self.unit_context:
            problems.append(f"context_width={self.context_width} is the unit_context reader's: set "
                            "unit_context=True")
        if self.context_skip and not self.unit_context:
            problems.append("context_skip=True sends the unit_context reader's features to the output: set "
                            "unit_context=True")
        if self.unit_context and not self.context_width and self.d_model % 2:
            problems.append(f"unit_context=True needs an even d_model (two LSTM directions), got "
                            f"{self.d_model}")
        if not 0 <= self.d_used <= self.d_out:
            problems.append(f"d_used={self.d_used} must be in [0, d_out={self.d_out}] (0 = every dim)")
        if self.logvar_limit <= 0:
            problems.append(f"logvar_limit={self.logvar_limit} must be positive")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                problems.append(f"{name}={getattr(self, name)!r} not in {sorted(_DTYPES)}")
        if problems:
            raise ValueError("invalid VAEConfig: " + "; ".join(problems))

    @property
    def d_hidden(self) -> int:
        """Hidden width of every MLP / FFN in the block."""
        return max(1, int(round(self.d_model * self.mlp_ratio)))

    @property
    def compute_dtype(self):
        return _DTYPES[self.dtype]

    def replace(self, **kw) -> VAEConfig:
        return dataclasses.replace(self, **kw)


@struct.dataclass
class VAEOutput:
    """What one VAE block returns; all float32."""

    out: jax.Array  # [B, Q, d_out]   row i predicts target row i
    mu: jax.Array  # [B, Q, d_latent]
    logvar: jax.Array  # [B, Q, d_latent] log sigma^2
    z: jax.Array  # [B, Q, d_latent] mu + sigma*eps when sampled, else mu


def kl_divergence(mu: jax.Array, logvar: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """KL(N(mu, sigma^2) || N(0, I)) per example, [B], in float32.

    Reduction: summed over the latent dims (the KL of a diagonal Gaussian), then averaged over the valid
    queries of the example (mask [B, Q], None = all valid). Averaging over queries keeps the weight from
    config independent of Q (16 SD queries vs. hundreds of CS rows); an example with no valid query gives 0.
    """
    mu = mu.astype(jnp.float32)
    logvar = logvar.astype(jnp.float32)
    per_query = 0.5 * jnp.sum(jnp.square(mu) + jnp.exp(logvar) - 1.0 - logvar, axis=-1)  # [B, Q]
    if mask is None:
        return jnp.mean(per_query, axis=-1)
    m = mask.astype(bool)
    total = jnp.sum(jnp.where(m, per_query, 0.0), axis=-1)
    return total / jnp.maximum(jnp.sum(m, axis=-1), 1).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------------------
# Keys: one key for the whole batch, or one key per example
# ----------------------------------------------------------------------------------------------------------
#
# Every random draw of the block goes through these helpers, which accept either ONE key (shape [], the
# draw covers the whole batch as one array) or a batch of keys (shape [B], one per example: example b's
# draws depend only on keys[b], whatever else is in the batch, which makes micro-batching exact). Raw
# uint32 keys (jax.random.PRNGKey) are wrapped first; the values drawn are the same.


def as_key(key: jax.Array) -> jax.Array:
    """A typed key array ([] or [B]); raw uint32 keys ([2] or [B, 2]) are wrapped."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if key.ndim > 1:
        raise ValueError(f"expected one key or a batch of keys [B], got a key array of shape {key.shape}")
    return key


def split_keys(key: jax.Array, num: int = 2) -> jax.Array:
    """`jax.random.split` of one key -> [num]; of per-example keys [B] -> [num, B] (row i holds every
    example's i-th sub-key, i.e. split(keys[b], num)[i])."""
    key = as_key(key)
    if key.ndim == 0:
        return jax.random.split(key, num)
    return jax.vmap(lambda k: jax.random.split(k, num), out_axes=1)(key)


def fold_in_keys(key: jax.Array, data: int) -> jax.Array:
    """`jax.random.fold_in` of one key or of each per-example key."""
    key = as_key(key)
    if key.ndim == 0:
        return jax.random.fold_in(key, data)
    return jax.vmap(lambda k: jax.random.fold_in(k, data))(key)


def normal_draw(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """Standard normal noise of `shape` ([B, ...]): one draw of the whole shape from one key, or, with
    per-example keys [B], row b = normal(keys[b], shape[1:])."""
    key = as_key(key)
    if key.ndim == 0:
        return jax.random.normal(key, shape, dtype)
    _check_key_batch(key, shape[0])
    return jax.vmap(lambda k: jax.random.normal(k, shape[1:], dtype))(key)


def bernoulli_draw(key: jax.Array, p: float, shape: tuple[int, ...]) -> jax.Array:
    """Bernoulli(p) mask of `shape` ([B, ...]), per example with per-example keys (as `normal_draw`)."""
    key = as_key(key)
    if key.ndim == 0:
        return jax.random.bernoulli(key, p, shape)
    _check_key_batch(key, shape[0])
    return jax.vmap(lambda k: jax.random.bernoulli(k, p, shape[1:]))(key)


def _check_key_batch(key: jax.Array, batch: int) -> None:
    if key.ndim == 1 and key.shape[0] != batch:
        raise ValueError(f"{key.shape[0]} per-example keys for a batch of {batch} examples")


def sinusoidal_positions(positions: jax.Array, dim: int) -> jax.Array:
    """Transformer sine/cosine encoding of integer positions [...] -> float32 [..., dim]; no length limit."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / max(half, 1))
    angles = positions.astype(jnp.float32)[..., None] * freqs
    enc = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    if dim % 2:
        enc = jnp.pad(enc, [(0, 0)] * (enc.ndim - 1) + [(0, 1)])
    return enc


# ----------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------


_XAVIER = nnx.initializers.xavier_uniform()


def _init(axes: tuple[str, ...], init=_XAVIER):
    return nnx.with_partitioning(init, axes)


def _zeros(axes: tuple[str, ...]):
    return nnx.with_partitioning(nnx.initializers.zeros_init(), axes)


def _linear(cfg: VAEConfig, d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs, dtype=None):
    return nnx.Linear(
        d_in,
        d_out,
        dtype=dtype or cfg.compute_dtype,
        param_dtype=_DTYPES[cfg.param_dtype],
        kernel_init=_init(axes),
        bias_init=_zeros(axes[1:]),
        rngs=rngs,
    )


def _layer_norm(cfg: VAEConfig, dim: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        dim,
        epsilon=1e-5,
        dtype=cfg.compute_dtype,
        param_dtype=_DTYPES[cfg.param_dtype],
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",)),
        bias_init=_zeros(("norm",)),
        rngs=rngs,
    )


def _attention(cfg: VAEConfig, rngs: nnx.Rngs, *, silent: bool = False) -> nnx.MultiHeadAttention:
    """silent: the output projection starts at zero, so the layer adds nothing until it has learnt to."""
    # LinearGeneral calls the initializer on the flattened 2-D kernel, so xavier sees the true fan in/out.
    out_init = nnx.initializers.zeros_init() if silent else _XAVIER
    return nnx.MultiHeadAttention(
        num_heads=cfg.num_heads,
        in_features=cfg.d_model,
        qkv_features=cfg.d_model,
        out_features=cfg.d_model,
        dtype=cfg.compute_dtype,
        param_dtype=_DTYPES[cfg.param_dtype],
        kernel_init=_init(("embed", "heads", "head_dim")),
        out_kernel_init=_init(("heads", "head_dim", "embed"), out_init),
        bias_init=_zeros(("heads", "head_dim")),
        out_bias_init=_zeros(("embed",)),
        dropout_rate=0.0,  # dropout is applied on the residual branches, with an explicit key
        decode=False,
        keep_rngs=False,
        rngs=rngs,
    )


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = bernoulli_draw(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


class FFN(nnx.Module):
    """Two-layer GELU MLP; the paper's FFN(r) (d_in -> d_model) and FFN(z) (d_latent -> d_model)."""

    def __init__(self, cfg: VAEConfig, d_in: int, d_out: int, in_axis: str, *, rngs: nnx.Rngs):
        self.fc1 = _linear(cfg, d_in, cfg.d_hidden, (in_axis, "mlp"), rngs)
        self.fc2 = _linear(cfg, cfg.d_hidden, d_out, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class RowConv(nnx.Module):
    """Depthwise 1-D convolution over the query rows, zero-padded at both ends ('same' length)."""

    def __init__(self, cfg: VAEConfig, *, rngs: nnx.Rngs):
        pdt = _DTYPES[cfg.param_dtype]
        self.dtype = cfg.compute_dtype
        self.kernel = nnx.Param(nnx.initializers.normal(1.0 / math.sqrt(cfg.conv_kernel))(
            rngs.params(), (cfg.conv_kernel, cfg.d_model), pdt), out_sharding=("conv", "embed"))
        self.bias = nnx.Param(jnp.zeros((cfg.d_model,), pdt), out_sharding=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel.shape[0]
        kernel = self.kernel[...].astype(self.dtype)
        padded = jnp.pad(x.astype(self.dtype), ((0, 0), (k // 2, k // 2), (0, 0)))
        q = x.shape[1]
        out = sum(padded[:, j:j + q] * kernel[j] for j in range(k))
        return out + self.bias[...].astype(self.dtype)


class QueryLayer(nnx.Module):
    """Pre-norm transformer layer over the query stream: self-attention, (a row convolution), cross-attention
    to a memory, MLP. `silent_cross`: the cross-attention starts as a no-op (`_attention(silent=True)`)."""

    def __init__(self, cfg: VAEConfig, *, silent_cross: bool = False, rngs: nnx.Rngs):
        self.dropout = cfg.dropout
        self.self_norm = _layer_norm(cfg, cfg.d_model, rngs)
        self.self_attn = _attention(cfg, rngs)
        if cfg.conv_kernel:
            self.conv_norm = _layer_norm(cfg, cfg.d_model, rngs)
            self.conv = RowConv(cfg, rngs=rngs)
        self.cross_norm = _layer_norm(cfg, cfg.d_model, rngs)
        self.cross_attn = _attention(cfg, rngs, silent=silent_cross)
        self.mlp_norm = _layer_norm(cfg, cfg.d_model, rngs)
        self.mlp = FFN(cfg, cfg.d_model, cfg.d_model, "embed", rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        memory: jax.Array,
        attn_mask: jax.Array,
        has_memory: jax.Array,
        key: jax.Array | None,
    ) -> jax.Array:
        """x [B,Q,d], memory [B,L,d], attn_mask [B,1,Q,L] (never all False), has_memory [B,1,1].

        key: dropout key, one or per example [B] (None: no dropout)."""
        conv = hasattr(self, "conv")
        keys = (None,) * 4 if key is None else (*split_keys(key, 4 if conv else 3),)
        h = self.self_norm(x)
        x = x + _dropout(self.self_attn(h), self.dropout, keys[0])
        if conv:
            x = x + _dropout(self.conv(self.conv_norm(x)), self.dropout, keys[3])
        h = self.cross_attn(self.cross_norm(x), memory, mask=attn_mask)
        x = x + _dropout(h * has_memory.astype(h.dtype), self.dropout, keys[1])
        x = x + _dropout(self.mlp(self.mlp_norm(x)), self.dropout, keys[2])
        return x


class QueryStack(nnx.Module):
    """The learnable queries run through `n` QueryLayers over a memory; ends in a LayerNorm."""

    def __init__(self, cfg: VAEConfig, n: int, *, silent_cross: bool = False, rngs: nnx.Rngs):
        self.layers = nnx.List([QueryLayer(cfg, silent_cross=silent_cross, rngs=rngs) for _ in range(n)])
        self.memory_norm = _layer_norm(cfg, cfg.d_model, rngs)
        self.final_norm = _layer_norm(cfg, cfg.d_model, rngs)

    def __call__(
        self, queries: jax.Array, memory: jax.Array, mask: jax.Array, key: jax.Array | None
    ) -> jax.Array:
        """queries [Q, d] (shared) or [B, Q, d] (per example, unit-aligned); memory [B, L, d]."""
        b, q = memory.shape[0], queries.shape[-2]
        x = jnp.broadcast_to(queries.astype(memory.dtype), (b, q, queries.shape[-1]))
        memory = self.memory_norm(memory)
        has_memory = jnp.any(mask, axis=-1)  # [B]
        # A row with no valid memory attends uniformly (finite) and its cross-attention output is zeroed,
        # so its result is the same for any h and never NaN, on every attention implementation.
        attn_mask = mask | ~has_memory[:, None]
        attn_mask = jnp.broadcast_to(attn_mask[:, None, None, :], (b, 1, q, mask.shape[1]))
        has_memory = has_memory[:, None, None]
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, attn_mask, has_memory, None if key is None else fold_in_keys(key, i))
        return self.final_norm(x)


# ----------------------------------------------------------------------------------------------------------
# The block
# ----------------------------------------------------------------------------------------------------------


class TransformerVAE(nnx.Module):
    """z = Enc(FFN(h), q); out = Dec(FFN(z), q) with one learnable query per output row (eqs 1-6)."""

    def __init__(self, cfg: VAEConfig, *, rngs: nnx.Rngs):
        with nnx.use_eager_sharding(False):
            self._build(cfg, rngs)

    def _build(self, cfg: VAEConfig, rngs: nnx.Rngs) -> None:
        self.config = cfg
        pdt = _DTYPES[cfg.param_dtype]
        self.queries = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (cfg.num_queries, cfg.d_model), pdt),
            out_sharding=("queries", "embed"),
        )
        if cfg.num_units:
            self.unit_embed = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (cfg.num_units, cfg.d_model), pdt),
                out_sharding=("queries", "embed"),
            )
        if cfg.unit_context:
            self.unit_context = UnitContext(cfg.d_model, width=cfg.context_width or None,
                                            dtype=cfg.compute_dtype, param_dtype=pdt, rngs=rngs)
        self.in_ffn = FFN(cfg, cfg.d_in, cfg.d_model, "embed", rngs=rngs)
        # A block that reads its units in context is a whole function of the units (Kokoro's text encoder
        # is): its cross-attention to h starts silent, so a block pre-trained without h (stage ccl_units)
        # computes the same rows when h arrives, and h can only refine them (docs/design.md "Units read in
        # context").
        self.encoder = QueryStack(cfg, cfg.enc_layers, silent_cross=cfg.unit_context, rngs=rngs)
        # float32 heads: mu/logvar feed exp() and the KL, where bf16 rounding would show.
        self.mu_head = _linear(cfg, cfg.d_model, cfg.d_latent, ("embed", "features"), rngs, jnp.float32)
        self.logvar_head = _linear(cfg, cfg.d_model, cfg.d_latent, ("embed", "features"), rngs, jnp.float32)
        self.z_ffn = FFN(cfg, cfg.d_latent, cfg.d_model, "features", rngs=rngs)
        self.decoder = QueryStack(cfg, cfg.dec_layers, rngs=rngs)
        self.out_proj = _linear(cfg, cfg.d_model, cfg.d_out, ("embed", "features"), rngs)
        if cfg.context_skip:  # starts at 0: the block's function is unchanged until the map learns
            self.context_out = nnx.Linear(
                cfg.context_width or cfg.d_model, cfg.d_out, dtype=cfg.compute_dtype, param_dtype=pdt,
                kernel_init=_zeros((None, "features")), bias_init=_zeros(("features",)), rngs=rngs)

    def _memory(self, ffn: FFN, x: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.config
        # Padding rows are zeroed before and after the FFN, so whatever sits there (even inf/NaN) reaches
        # neither the output nor the gradients.
        x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
        mem = ffn(x.astype(cfg.compute_dtype))
        if cfg.positions:
            pos = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)  # index among the valid rows
            mem = mem + sinusoidal_positions(pos, cfg.d_model).astype(mem.dtype)
        return jnp.where(mask[..., None], mem, jnp.zeros((), mem.dtype))

    def _queries(self, units: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
        """(q [Q, d], or q + U[units] [B, Q, d] for a unit-aligned block (ids outside the table clip), the
        U rows read in context first with `unit_context`; the reader's features for `context_skip`, else
        None)."""
        if not self.config.num_units:
            if units is not None:
                raise ValueError("units given to a block without unit alignment (num_units=0)")
            return self.queries[...], None
        if units is None or units.ndim != 2 or units.shape[1] != self.config.num_queries:
            got = None if units is None else list(units.shape)
            raise ValueError(f"this block aligns its {self.config.num_queries} rows to content units: pass "
                             f"units [B, {self.config.num_queries}] (got {got})")
        rows = jnp.take(self.unit_embed[...], units.astype(jnp.int32), axis=0, mode="clip")
        read = None
        if self.config.unit_context:
            rows, read = self.unit_context.read(rows)
        return self.queries[...][None] + rows, read if self.config.context_skip else None

    def encode(
        self, h: jax.Array, h_mask: jax.Array, queries: jax.Array, *, dropout_key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Eq 1: (mu, logvar), each float32 [B, Q, d_latent]; `queries` from `_queries`."""
        cfg = self.config
        mask = h_mask.astype(bool)
        x = self.encoder(queries, self._memory(self.in_ffn, h, mask), mask, dropout_key)
        x = x.astype(jnp.float32)
        mu = self.mu_head(x)
        logvar = cfg.logvar_limit * jnp.tanh(self.logvar_head(x) / cfg.logvar_limit)
        return mu, logvar

    def decode(self, z: jax.Array, queries: jax.Array, *, read: jax.Array | None = None,
               dropout_key: jax.Array | None = None) -> jax.Array:
        """Eq 2: output rows, float32 [B, Q, d_out], from z [B, Q, d_latent]; the encoder's `queries`, and
        the unit reader's features `read` of a `context_skip` block."""
        mask = jnp.ones(z.shape[:2], bool)
        x = self.decoder(queries, self._memory(self.z_ffn, z, mask), mask, dropout_key)
        out = self.out_proj(x).astype(jnp.float32)
        if read is not None:
            out = out + self.context_out(read).astype(jnp.float32)
        if self.config.d_used:
            out = jnp.where(jnp.arange(out.shape[-1]) < self.config.d_used, out, 0.0)
        return out

    def __call__(
        self, h: jax.Array, h_mask: jax.Array, *, sample: bool, rng: jax.Array | None = None,
        units: jax.Array | None = None,
    ) -> VAEOutput:
        """Runs the block on h [B, L, d_in] with h_mask [B, L] (True = valid row); `units` [B, Q] are the
        content-unit ids of the output rows, needed iff the block is unit-aligned (`num_units`).

        `sample` is a Python bool (static under jit). sample=True is training: z = mu + exp(0.5*logvar)*eps
        and dropout (if configured), which needs `rng`; it is split once,
        `eps_key, dropout_key = jax.random.split(rng)`, and eps = jax.random.normal(eps_key, mu.shape,
        float32). sample=False is evaluation: z = mu, no dropout, deterministic.

        `rng` is one key (shape [], the noise of the whole batch is one draw, so an example's noise depends
        on the batch it is in) or one key per example (shape [B]): then every draw is made per example
        (`eps[b] = normal(split(rng[b])[0], (Q, d_latent))`, dropout likewise from `split(rng[b])[1]`), so
        example b gets the same noise in any batch. Raw uint32 keys are accepted too.
        """
        if sample and rng is None:
            raise ValueError("TransformerVAE(sample=True) needs an rng for the reparameterisation")
        eps_key = drop_key = None
        if sample:
            rng = as_key(rng)
            _check_key_batch(rng, h.shape[0])
            eps_key, drop_key = split_keys(rng)
            if self.config.dropout == 0.0:
                drop_key = None
        enc_key = dec_key = None
        if drop_key is not None:
            enc_key, dec_key = split_keys(drop_key)
        # once for both stacks: a unit-aligned block's queries may hold a BiLSTM scan (`unit_context`)
        queries, read = self._queries(units)
        mu, logvar = self.encode(h, h_mask, queries, dropout_key=enc_key)
        if sample:
            eps = normal_draw(eps_key, mu.shape, jnp.float32)
            z = mu + jnp.exp(0.5 * logvar) * eps
        else:
            z = mu
        out = self.decode(z, queries, read=read, dropout_key=dec_key)
        return VAEOutput(out=out, mu=mu, logvar=logvar, z=z)
