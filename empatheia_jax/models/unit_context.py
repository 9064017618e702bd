"""The content units of a reply read in context, before they join the Content Synchronizer's queries.

A unit-aligned block (`VAEConfig.num_units`) adds U[unit_i] to query i: every /t/ gets the same row wherever
it stands. But the half of Kokoro's content row that a listener hears, t_en (docs/benchmarks.md "Where a
row is heard"), is its text encoder's output over the whole phoneme sequence: three width-5 convolutions
and a bidirectional LSTM. A per-unit table is heard at WER 0.19 at best (its oracle), and the transformer
block, which reaches a neighbour only through attention learnt separately at every query index, was heard
worse still while fitting t_en better in L2. `UnitContext` gives the block a reader of the generator's own
shape over the unit embeddings (`VAEConfig.unit_context`), so a row's unit arrives with its neighbours:
residual convolutions (LayerNorm, LeakyReLU 0.2, as Kokoro's CNN) for the local context, then a
bidirectional LSTM for the rest of the reply.

The units are always padded to the block's `num_queries` rows (id 0, Kokoro's boundary pad), in training
and at inference alike, so the backward LSTM reads the same padding run for a given reply either way and
needs no mask. Our own LSTM (a `lax.scan`) rather than `nnx.RNN`: its parameters carry logical axis names
for the sharding rules like every other parameter, and both directions run as one scan.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

CONV_LAYERS = 3  # Kokoro's text encoder: 3 convolutions of width 5, then the BiLSTM
CONV_WIDTH = 5


class UnitContext(nnx.Module):
    """[B, Q, d] unit embeddings -> [B, Q, d] the same rows with their context.

    `width` (even; default d) is the reader's own width. Kokoro's text encoder reads at 512, and a reader
    of that width was heard better than one at the block's 128-256 (docs/benchmarks.md "units read in
    context"); a wider reader takes the rows in through `widen` and gives them back through `narrow`,
    added to the rows it read (`narrow` starts at 0, so such a reader starts as the identity)."""

    def __init__(self, d_model: int, *, width: int | None = None, dtype, param_dtype, rngs: nnx.Rngs):
        width = d_model if width is None else width
        if width % 2:
            raise ValueError(f"UnitContext needs an even width for its two LSTM directions, got {width}")
        self.dtype = dtype
        if width != d_model:
            widen = nnx.initializers.lecun_normal()(rngs.params(), (d_model, width), param_dtype)
            self.widen = nnx.Param(widen, out_sharding=("embed", None))
            self.narrow = nnx.Param(jnp.zeros((width, d_model), param_dtype), out_sharding=(None, "embed"))
        h = width // 2
        n, k, d = CONV_LAYERS, CONV_WIDTH, width
        conv_init = nnx.initializers.normal(1.0 / math.sqrt(k * d))
        self.conv = nnx.Param(conv_init(rngs.params(), (n, k, d, d), param_dtype),
                              out_sharding=(None, "conv", "embed", None))
        self.conv_bias = nnx.Param(jnp.zeros((n, d), param_dtype), out_sharding=(None, "embed"))
        self.norm_scale = nnx.Param(jnp.ones((n, d), param_dtype), out_sharding=(None, "norm"))
        self.norm_bias = nnx.Param(jnp.zeros((n, d), param_dtype), out_sharding=(None, "norm"))
        # the LSTM of each direction (axis 0: forward, backward); gates i, f, g, o along the last axis
        self.lstm_in = nnx.Param(nnx.initializers.xavier_uniform()(rngs.params(), (2, d, 4 * h), param_dtype),
                                 out_sharding=(None, "embed", "mlp"))
        self.lstm_rec = nnx.Param(nnx.initializers.orthogonal()(rngs.params(), (2, h, 4 * h), param_dtype),
                                  out_sharding=(None, None, "mlp"))
        forget_one = jnp.zeros((2, 4, h), param_dtype).at[:, 1].set(1.0).reshape(2, 4 * h)
        self.lstm_bias = nnx.Param(forget_one, out_sharding=(None, "mlp"))

    def _convs(self, x: jax.Array) -> jax.Array:
        q, k = x.shape[1], CONV_WIDTH
        for layer in range(CONV_LAYERS):
            kernel = self.conv[layer].astype(self.dtype)  # [k, d, d]
            padded = jnp.pad(x, ((0, 0), (k // 2, k // 2), (0, 0)))
            y = sum(padded[:, j:j + q] @ kernel[j] for j in range(k))
            y = y + self.conv_bias[layer].astype(self.dtype)
            y32 = y.astype(jnp.float32)
            mean = jnp.mean(y32, -1, keepdims=True)
            var = jnp.mean(jnp.square(y32 - mean), -1, keepdims=True)
            y32 = (y32 - mean) * jax.lax.rsqrt(var + 1e-5) * self.norm_scale[layer] + self.norm_bias[layer]
            x = x + jax.nn.leaky_relu(y32, 0.2).astype(self.dtype)
        return x

    def _bilstm(self, x: jax.Array) -> jax.Array:
        b, q, d = x.shape
        h = d // 2
        both = jnp.stack([x, x[:, ::-1]])  # [2, B, Q, d]: the backward direction reads the rows reversed
        w_in = self.lstm_in[...].astype(jnp.float32)
        gates_in = jnp.einsum("nbqd,ndg->qnbg", both.astype(jnp.float32), w_in)
        gates_in = gates_in + self.lstm_bias[...].astype(jnp.float32)[None, :, None]
        rec = self.lstm_rec[...].astype(jnp.float32)

        def cell(carry, g_in):
            hid, c = carry  # [2, B, h]
            g = g_in + jnp.einsum("nbh,nhg->nbg", hid, rec)
            i, f, gg, o = jnp.split(g, 4, -1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(gg)
            hid = jax.nn.sigmoid(o) * jnp.tanh(c)
            return (hid, c), hid

        zeros = jnp.zeros((2, b, h), jnp.float32)
        _, hs = jax.lax.scan(cell, (zeros, zeros), gates_in)  # [Q, 2, B, h]
        fwd, bwd = hs[:, 0], hs[::-1, 1]
        return jnp.concatenate([fwd, bwd], -1).transpose(1, 0, 2).astype(self.dtype)

    def read(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the rows with their context [B, Q, d], the reader's own features [B, Q, width]): the second is
        what a `VAEConfig.context_skip` block also sends straight to its output rows."""
        x = x.astype(self.dtype)
        if not hasattr(self, "widen"):
            y = self._convs(x)
            read = y + self._bilstm(y)
            return read, read
        y = self._convs(x @ self.widen[...].astype(self.dtype))
        read = y + self._bilstm(y)
        return x + read @ self.narrow[...].astype(self.dtype), read

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.read(x)[0]
