"""The LLaMA-family decoder that Empatheia is built on, in `flax.nnx`.

One story, top to bottom: config -> RoPE -> RMSNorm -> attention (GQA, KV cache) -> SwiGLU MLP ->
decoder layer -> model. Parameter names mirror HF's `LlamaForCausalLM` so conversion is a rename and a
transpose, and every parameter carries logical axis names that `empatheia_jax.sharding` maps to the mesh.

Added tokens (`<Aud>`, `<AUD1>`, ...) live in separate `*_extra` parameters so an optimizer can train the
new rows alone while the pretrained table stays bit-identical (NExT-GPT issues #40/#71).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from flax.core import FrozenDict

from empatheia_jax.models import attention_choice
from empatheia_jax.models.bf16_operands import dense_dot_general, einsum_f32
from empatheia_jax.sharding import constrain

# ----------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION_IMPLEMENTATIONS = ("einsum", "auto", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of the backbone; a superset-free mirror of HF's `LlamaConfig` fields we use."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None  # None = "default"; {"rope_type": "llama3", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    extra_vocab: int = 0  # rows appended for Empatheia's added tokens
    dtype: str = "float32"  # compute dtype; parameters stay `param_dtype`
    param_dtype: str = "float32"
    remat: str = "none"  # none | full | dots (save matmul outputs)
    # auto: cuDNN's flash attention for a forward without a KV cache where it compiles (an NVIDIA GPU,
    # bf16/fp16), else our einsum (models/attention_choice.py); einsum: our grouped einsum + float32
    # softmax; xla / cudnn: jax.nn.dot_product_attention's kernel forced
    attention: str = "auto"

    def __post_init__(self):
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, FrozenDict):
            # Hashable, because the config is static metadata of the jitted graph.
            object.__setattr__(self, "rope_scaling", FrozenDict(self.rope_scaling))
        problems = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.extra_vocab < 0:
            problems.append(f"extra_vocab={self.extra_vocab} must be >= 0")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                problems.append(f"{name}={getattr(self, name)!r} not in {sorted(_DTYPES)}")
        if self.remat not in ("none", "full", "dots"):
            problems.append(f"remat={self.remat!r} not in ['dots', 'full', 'none']")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            problems.append(f"attention={self.attention!r} not in {list(ATTENTION_IMPLEMENTATIONS)}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "llama3"):
            problems.append(f"rope_scaling.rope_type={rope_type!r} is not supported (default, llama3)")
        if problems:
            raise ValueError("invalid LlamaConfig: " + "; ".join(problems))

    @property
    def total_vocab(self) -> int:
        return self.vocab_size + self.extra_vocab

    @property
    def compute_dtype(self):
        return _DTYPES[self.dtype]

    def replace(self, **kw) -> LlamaConfig:
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown LlamaConfig keys: {unknown}")
        d = dict(d)
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> LlamaConfig:
        """Reads an HF `config.json` dict (or a `PretrainedConfig`); rejects non-LLaMA architectures."""
        if not isinstance(hf, Mapping):
            hf = hf.to_dict()
        model_type = hf.get("model_type")
        if model_type not in ("llama", "mistral", None):
            raise ValueError(f"config model_type={model_type!r} is not a LLaMA-family decoder")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"HF config is missing required key {key!r}")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("attention_bias/mlp_bias=True is not supported by this backbone")
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling")
        if legacy:
            rope.update(legacy)
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None
        if rope_type != "default":
            rope_scaling = {"rope_type": rope_type}
            for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if k in rope:
                    rope_scaling[k] = rope[k]
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
            **overrides,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` of the same network (without our extra rows, which export folds in)."""
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope_parameters.update(self.rope_scaling)
        eos = self.eos_token_id
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.total_vocab,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
            "pad_token_id": self.pad_token_id,
        }


# ----------------------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------------------


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Inverse frequencies, computed in float32 exactly as transformers does (default and llama3)."""
    dim = cfg.head_dim
    inv = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    inv = inv.astype(np.float32)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", "default") == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates [B, T, heads, head_dim] by position, HF's half-split ("rotate_half") convention."""
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------


_SHAPES_ONLY = contextvars.ContextVar("llama_base_shapes_only", default=False)
_NORMAL = nnx.initializers.normal(0.02)  # every drawn weight: the base ones and the added rows


@contextlib.contextmanager
def base_shapes_only() -> Iterator[None]:
    """Llamas built inside hold only the shapes of their pretrained weights (embedding, projections, LM
    head) until a checkpoint's values are set into them (`Empatheia.from_llm` -> `copy_backbone`).

    Why: drawing random values only to overwrite them cost a host-sized init (no 7B fits one host) or, built
    in shards under jit, minutes of tracing and compiling. Every rng key is still drawn, so the parameters
    that are initialised (LoRA, added rows, everything around the backbone) get the values they would get
    otherwise. The norms' scales stay real: ones cost nothing and are overwritten all the same.
    """
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def shape_only(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    """An initializer that keeps the shape and draws nothing, for weights whose values come later."""
    del key
    return jax.ShapeDtypeStruct(shape, dtype)


def is_shape_only(var: nnx.Variable) -> bool:
    return isinstance(var.get_value(), jax.ShapeDtypeStruct)


def _base_init(axes: tuple[str | None, ...]):
    init = shape_only if _SHAPES_ONLY.get() else _NORMAL
    return nnx.with_partitioning(init, axes)



def _linear(cfg: LlamaConfig, d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        dtype=cfg.compute_dtype,
        param_dtype=_DTYPES[cfg.param_dtype],
        kernel_init=_base_init(axes),
        dot_general=dense_dot_general,
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """RMSNorm in float32, cast back: what HF's LlamaRMSNorm does."""

    def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * h).astype(x.dtype)


@struct.dataclass
class KVCache:
    """Functional KV cache: per-layer keys/values [B, kv_heads, S, head_dim] filled up to `index`.

    Head-major so the attention matmuls read the cache in place: with [B, S, kv_heads, head_dim] XLA
    transposes the whole cache of every layer at every decode step (measured: the largest non-matmul cost
    of batch-8 decode).

    `valid` marks real (non-padding) key slots, so left-padded prompts need no special casing: the mask is
    `valid & (slot <= query slot)`.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    valid: jax.Array  # [B, S] bool
    index: jax.Array  # int32 scalar: next slot to write

    @classmethod
    def init(cls, cfg: LlamaConfig, batch: int, max_len: int, dtype=None) -> KVCache:
        dtype = dtype or cfg.compute_dtype
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))
        return cls(
            keys=zeros,
            values=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)),
            valid=jnp.zeros((batch, max_len), bool),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


class Attention(nnx.Module):
    """Grouped-query attention; the q/k/v/o projections are plain `nnx.Linear` so LoRA can wrap them."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
        self.implementation = cfg.attention
        self.q_proj = _linear(cfg, d, h * hd, ("embed", "heads"), rngs)
        self.k_proj = _linear(cfg, d, kv * hd, ("embed", "kv_heads"), rngs)
        self.v_proj = _linear(cfg, d, kv * hd, ("embed", "kv_heads"), rngs)
        self.o_proj = _linear(cfg, h * hd, d, ("heads", "embed"), rngs)

    def __call__(self, x, positions, inv_freq, mask, kv: tuple[jax.Array, jax.Array] | None, index):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq).transpose(0, 2, 1, 3)  # [B, kv_heads, T, head_dim]
        v = v.transpose(0, 2, 1, 3)
        if kv is not None:  # write this step's keys/values at `index`, attend over the whole cache
            k = jax.lax.dynamic_update_slice(kv[0], k.astype(kv[0].dtype), (0, 0, index, 0))
            v = jax.lax.dynamic_update_slice(kv[1], v.astype(kv[1].dtype), (0, 0, index, 0))
            new_kv = (k, v)
        else:
            new_kv = None
        cached, implementation = kv is not None, self.implementation
        if implementation == "auto":
            shape = attention_choice.Shape(t, k.shape[2], self.num_heads, self.num_kv_heads, self.head_dim,
                                           jnp.dtype(q.dtype).name)
            implementation = attention_choice.choose(shape, cached=cached).kernel
        if implementation != "einsum":
            # token-major K/V [B, S, kv_heads, head_dim] as dot_product_attention wants them (GQA native)
            out = attention_choice.dot_product_attention(
                q, k.transpose(0, 2, 1, 3).astype(q.dtype), v.transpose(0, 2, 1, 3).astype(q.dtype), mask,
                index, cached=cached, implementation=implementation)
            out = out.reshape(b, t, self.num_heads * self.head_dim).astype(x.dtype)
            return self.o_proj(out), new_kv
        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(b, t, self.num_kv_heads, groups, self.head_dim)
        scores = einsum_f32("btkgd,bksd->bkgts", q, k.astype(q.dtype))
        scores = scores * (self.head_dim**-0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = (einsum_f32 if v.dtype == jnp.float32 else jnp.einsum)("bkgts,bksd->btkgd", probs, v)
        out = out.reshape(b, t, self.num_heads * self.head_dim).astype(x.dtype)
        return self.o_proj(out), new_kv


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, d, f, ("embed", "mlp"), rngs)
        self.up_proj = _linear(cfg, d, f, ("embed", "mlp"), rngs)
        self.down_proj = _linear(cfg, f, d, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        pdt = _DTYPES[cfg.param_dtype]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, inv_freq, mask, kv, index):
        h, new_kv = self.self_attn(self.input_layernorm(x), positions, inv_freq, mask, kv, index)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_kv


# hidden states [B, T, D]: split over the batch only (the embed axis of the weights is FSDP's, not theirs)
_HIDDEN = ("batch", "length", None)

_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


# ----------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------


def _project(h: jax.Array, spec: str, w: jax.Array, extra: jax.Array | None) -> jax.Array:
    """Hidden states [B, T, d] -> float32 logits [B, T, V (+ added)] with `Llama._head`'s weights."""
    out = einsum_f32(spec, h, w)
    if extra is not None:
        out = jnp.concatenate([out, einsum_f32(spec, h, extra)], axis=-1)
    return constrain(out, ("batch", "length", "vocab"))


def _attention_mask(
    attention_mask: jax.Array, cache: KVCache | None, segment_ids: jax.Array | None
) -> tuple[jax.Array, jax.Array, Any]:
    """(mask [B, T, S] of the keys each query attends to, key validity [B, S], the cache slot of the first
    query): causal over the T tokens without a cache, over the cache's slots with one; packed rows
    (`segment_ids`, no cache) only within a query's own segment."""
    t = attention_mask.shape[1]
    if cache is None:
        index = 0
        key_valid = attention_mask
        query_slot = jnp.arange(t)
        key_slot = jnp.arange(t)
    else:
        index = cache.index
        key_valid = jax.lax.dynamic_update_slice(cache.valid, attention_mask, (0, index))
        query_slot = index + jnp.arange(t)
        key_slot = jnp.arange(cache.max_len)
    mask = key_valid[:, None, :] & (key_slot[None, None, :] <= query_slot[None, :, None])
    if segment_ids is not None:
        if cache is not None:
            raise ValueError("segment_ids (packed rows) are for a forward without a KV cache")
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask, key_valid, index


def _call_layer(layer: DecoderLayer, remat: str, *args: Any) -> tuple[jax.Array, Any]:
    """One decoder layer, rematerialised per `LlamaConfig.remat`."""
    if remat == "none":
        return layer(*args)
    # A pure function of the layer's state: nnx.remat(layer) writes the layer's Variables back from inside
    # the checkpoint trace, which fails under jax.grad (TraceContextError).
    layer_def, layer_state = nnx.split(layer)
    fn = jax.checkpoint(lambda st, *a, _d=layer_def: nnx.merge(_d, st)(*a), policy=_REMAT_POLICIES[remat])
    return fn(layer_state, *args)


class Llama(nnx.Module):
    """LLaMA decoder with an LM head. `model(input_ids)` gives float32 logits [B, T, V + extra_vocab]."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        # Placement comes from the logical-axis rules at jit time (sharding.py), never eagerly here.
        with nnx.use_eager_sharding(False):
            self._build(cfg, rngs)

    def _build(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.config = cfg
        pdt = _DTYPES[cfg.param_dtype]
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=cfg.compute_dtype,
            param_dtype=pdt,
            embedding_init=_base_init(("vocab", "embed")),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), rngs)
        if cfg.extra_vocab:
            self.embed_extra = nnx.Param(
                _NORMAL(rngs.params(), (cfg.extra_vocab, cfg.hidden_size), pdt), out_sharding=(None, "embed")
            )
            if not cfg.tie_word_embeddings:
                self.lm_head_extra = nnx.Param(
                    _NORMAL(rngs.params(), (cfg.hidden_size, cfg.extra_vocab), pdt),
                    out_sharding=("embed", None),
                )

    # -- pieces, so Empatheia can splice embeddings and read hidden states --------------------------------

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """Token embeddings [B, T, D]; ids >= vocab_size index the added-token rows."""
        cfg = self.config
        base = self.embed_tokens(jnp.clip(input_ids, 0, cfg.vocab_size - 1))
        if not cfg.extra_vocab:
            return base
        extra_ids = jnp.clip(input_ids - cfg.vocab_size, 0, cfg.extra_vocab - 1)
        extra = jnp.take(self.embed_extra[...], extra_ids, axis=0).astype(base.dtype)
        return jnp.where((input_ids >= cfg.vocab_size)[..., None], extra, base)

    def decode(
        self,
        x: jax.Array,
        *,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Runs the layers over embeddings x [B, T, D]; returns final-normed hidden states and the cache.

        attention_mask [B, T] marks real tokens (1) vs padding (0). Without a cache the attention is causal
        over the given T tokens; with one, the new tokens are written at `cache.index`. segment_ids [B, T]
        (packed rows, no cache): a query attends only to keys of its own segment, so the turns packed
        into one row never see each other (their positions restart per turn: the caller's `positions`).
        """
        cfg = self.config
        b, t, _ = x.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), bool)
        attention_mask = attention_mask.astype(bool)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask, key_valid, index = _attention_mask(attention_mask, cache, segment_ids)
        inv_freq = jnp.asarray(rope_inv_freq(cfg))  # a compile-time constant
        # activations split over the batch like the inputs (a no-op off a multi-device mesh)
        x = constrain(x.astype(cfg.compute_dtype), _HIDDEN)
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.keys[i], cache.values[i])
            x, new_kv = _call_layer(layer, cfg.remat, x, positions, inv_freq, mask, kv, index)
            x = constrain(x, _HIDDEN)
            if new_kv is not None:
                new_keys.append(new_kv[0])
                new_values.append(new_kv[1])
        hidden = self.norm(x)
        if cache is not None:
            cache = KVCache(tuple(new_keys), tuple(new_values), key_valid, cache.index + t)
        return hidden, cache

    def _head(self) -> tuple[str, jax.Array, jax.Array | None]:
        """The output projection in the compute dtype: (einsum, pretrained table, added rows or None)."""
        cfg = self.config
        if cfg.tie_word_embeddings:
            spec, w = "btd,vd->btv", self.embed_tokens.embedding[...]
            we = self.embed_extra[...] if cfg.extra_vocab else None
        else:
            spec, w = "btd,dv->btv", self.lm_head.kernel[...]
            we = self.lm_head_extra[...] if cfg.extra_vocab else None
        dt = cfg.compute_dtype
        return spec, w.astype(dt), None if we is None else we.astype(dt)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits over the full (original + added) vocabulary."""
        return _project(hidden.astype(self.config.compute_dtype), *self._head())

    def token_nll(self, hidden: jax.Array, target_ids: jax.Array, *, chunk: int = 0) -> jax.Array:
        """-log p(target_ids[b, t] | position t) for every position: float32 [B, T].

        chunk > 0 projects `chunk` positions at a time and recomputes each chunk's logits in the backward
        pass (`jax.checkpoint` inside `lax.map`), so the [B, T, V] float32 logits, their softmax and their
        gradient never exist whole: the largest tensors of a small model's step (SmolLM2: 49k vocabulary),
        for the price of one more output projection. chunk = 0 (or >= T) computes them whole.
        target_ids must be valid ids everywhere (masked positions: any valid id, e.g. 0).
        """
        return _token_nll(self._head(), hidden.astype(self.config.compute_dtype), target_ids, chunk)

    def target_nll(
        self, hidden: jax.Array, target_ids: jax.Array, mask: jax.Array, *, max_targets: int, chunk: int = 0
    ) -> jax.Array:
        """-log p(target_ids) at the positions where `mask` is set, 0 elsewhere: float32 [B, T].

        Projects only the masked positions: their hidden states are gathered (flat over the batch, in
        order) into a static [max_targets, d] buffer, which goes through `token_nll` (chunked when chunk >
        0), and the values are scattered back. A batch with more than `max_targets` masked positions takes
        the whole projection instead (`lax.cond`, one branch runs), so the result never drops a token: in
        both branches it is what `token_nll` gives at the masked positions.
        """
        b, t, _ = hidden.shape
        mask = mask.astype(bool)
        ids = jnp.where(mask, target_ids, 0)  # unmasked ids may be out of range (padding)
        hidden = hidden.astype(self.config.compute_dtype)
        spec, w, extra = self._head()  # the weights go in as operands: both branches are pure functions
        k = int(max_targets)
        if k <= 0 or k >= b * t:
            return jnp.where(mask, _token_nll((spec, w, extra), hidden, ids, chunk), 0.0)

        def gathered(h, w, extra):
            return gather_target_nll((spec, w, extra), h, ids, mask, k, chunk=chunk)

        # rematerialised: under autodiff a cond's branches hand back the union of their residuals, so the
        # gathered branch (the one that runs) would fill the whole branch's [B, T, V] softmax with zeros
        # every step (0.14 s of a 5 s SmolLM2 step on the CPU); this way it saves only its inputs
        @jax.checkpoint
        def whole(h, w, extra):
            return jnp.where(mask, _token_nll((spec, w, extra), h, ids, chunk), 0.0)

        return jax.lax.cond(jnp.sum(mask) <= k, gathered, whole, hidden, w, extra)

    def __call__(
        self,
        input_ids: jax.Array,
        *,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        cache: KVCache | None = None,
    ):
        """Logits [B, T, V] (float32); with a cache, returns (logits, updated cache)."""
        hidden, new_cache = self.decode(
            self.embed(input_ids), positions=positions, attention_mask=attention_mask, cache=cache
        )
        logits = self.logits(hidden)
        return logits if cache is None else (logits, new_cache)


def _token_nll(head: tuple, hidden: jax.Array, target_ids: jax.Array, chunk: int) -> jax.Array:
    """`Llama.token_nll` on the head `Llama._head()` gave (hidden already in the compute dtype)."""
    b, t, _ = hidden.shape
    if chunk <= 0 or chunk >= t:
        return optax.softmax_cross_entropy_with_integer_labels(_project(hidden, *head), target_ids)
    pad = -t % chunk
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    ids = jnp.pad(target_ids, ((0, 0), (0, pad)))
    n = (t + pad) // chunk

    @jax.checkpoint
    def one(xs: tuple[jax.Array, jax.Array]) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(_project(xs[0], *head), xs[1])

    by_chunk = (h.reshape(b, n, chunk, -1).swapaxes(0, 1), ids.reshape(b, n, chunk).swapaxes(0, 1))
    return jax.lax.map(one, by_chunk).swapaxes(0, 1).reshape(b, t + pad)[:, :t]


def gather_target_nll(
    head: tuple, hidden: jax.Array, ids: jax.Array, mask: jax.Array, k: int, *, chunk: int = 0
) -> jax.Array:
    """`Llama.target_nll`'s gathered branch without its overflow check (head = `Llama._head()`): the
    first `k` masked positions (row-major) are projected, any further ones score 0, i.e. are DROPPED.
    Exact only when sum(mask) <= k; `target_nll` checks that and falls back to the whole projection."""
    b, t, d = hidden.shape
    flat_mask = mask.reshape(-1)
    (idx,) = jnp.nonzero(flat_mask, size=k, fill_value=0)
    valid = jnp.arange(k) < jnp.sum(flat_mask)
    h = jnp.take(hidden.reshape(b * t, d), idx, axis=0)[None]  # [1, k, d]
    nll = _token_nll(head, h, jnp.take(ids.reshape(-1), idx)[None], chunk)[0]
    out = jnp.zeros((b * t,), jnp.float32).at[idx].add(jnp.where(valid, nll, 0.0))
    return out.reshape(b, t)


def init_added_rows(model: Llama) -> None:
    """Sets every added-token row to the mean of the pretrained rows (DESIGN §2); a no-op while the
    pretrained rows are only shapes (`base_shapes_only`: `copy_backbone` calls it again once they arrive)."""
    cfg = model.config
    if not cfg.extra_vocab or is_shape_only(model.embed_tokens.embedding):
        return
    emb = model.embed_tokens.embedding[...]
    model.embed_extra[...] = jnp.broadcast_to(emb.mean(0, keepdims=True), model.embed_extra.shape).astype(
        emb.dtype
    )
    if not cfg.tie_word_embeddings:
        head = model.lm_head.kernel[...]
        model.lm_head_extra[...] = jnp.broadcast_to(
            head.mean(1, keepdims=True), model.lm_head_extra.shape
        ).astype(head.dtype)
