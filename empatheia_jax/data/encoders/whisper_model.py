"""Whisper's audio encoder in flax.nnx, loaded from a CTranslate2 model.bin (fp16 -> fp32).

The frozen encoder behind the `whisper_tiny_en` input encoder (`whisper.py`; docs/design.md
"Encoders"). It is OpenAI Whisper's encoder as CTranslate2 runs it: log-mel [B, 3000, n_mels] -> conv1
(kernel 3, padding 1) + GELU -> conv2 (kernel 3, stride 2, padding 1) + GELU -> + the sinusoidal positions
stored in the checkpoint -> pre-LayerNorm transformer layers (self-attention, GELU MLP) -> final LayerNorm
-> [B, 1500, d_model]. GELU is the exact (erf) one, LayerNorm's epsilon 1e-5, as in Whisper.

Why here and not in `models/`: the data layer (the encoders, at shard preparation) runs it, and a layer
never imports the ones above it (docs/design.md "Layers"). It is a module and a forward pass like those in
`models/`, with the same conventions: Flax's own `nnx.Conv` / `nnx.Linear` / `nnx.LayerNorm` /
`nnx.MultiHeadAttention`, every parameter with logical axis names through `nnx.with_partitioning`
(`empatheia_jax.sharding.LOGICAL_RULES`), created inside `nnx.use_eager_sharding(False)`.

Weights: the variables of the file's `encoder/` scope, read by `ct2_model.py`. CTranslate2 fuses
the query/key/value projections into one `[3d, d]` matrix (the key's bias, which Whisper does not have, is
stored as zeros); it is split into the three projections here. The architecture (layers, width, heads,
MLP width, mel bins, positions) is read from the file, so any Whisper size converted by CTranslate2 loads.

`shared_encoder(path)` keeps one loaded model and one jitted forward per file and process: preparing
shards runs the compiled function, not a fresh trace, for every clip.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from empatheia_jax.data.encoders.ct2_model import CT2FormatError, CT2Model, read_ct2_model

N_FRAMES = 3000  # mel frames of Whisper's 30-s window (hop 160 at 16 kHz)
SCOPE = "encoder/"


@dataclasses.dataclass(frozen=True)
class WhisperEncoderConfig:
    n_mels: int = 80
    d_model: int = 384
    num_heads: int = 6
    num_layers: int = 4
    d_mlp: int = 1536
    n_ctx: int = 1500  # encoder positions = N_FRAMES // 2

    @classmethod
    def from_ct2(cls, m: CT2Model) -> WhisperEncoderConfig:
        layers = {int(g) for n in m.variables if (g := _layer_index(n)) is not None}
        if not layers:
            raise CT2FormatError(f"{m.path}: no variable {SCOPE}layer_0/... (not a Whisper encoder)")
        conv1 = m.get(f"{SCOPE}conv1/weight")
        return cls(
            n_mels=int(conv1.shape[1]),
            d_model=int(conv1.shape[0]),
            num_heads=int(m.get(f"{SCOPE}num_heads")),
            num_layers=max(layers) + 1,
            d_mlp=int(m.get(f"{SCOPE}layer_0/ffn/linear_0/weight").shape[0]),
            n_ctx=int(m.get(f"{SCOPE}position_encodings/encodings").shape[0]),
        )


def _layer_index(name: str) -> str | None:
    hit = re.match(rf"{SCOPE}layer_(\d+)/", name)
    return hit.group(1) if hit else None


def _zeros(axes: tuple[str, ...]):
    return nnx.with_partitioning(nnx.initializers.zeros_init(), axes)


def _layer_norm(d: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(d, epsilon=1e-5, scale_init=_zeros(("norm",)), bias_init=_zeros(("norm",)),
                         rngs=rngs)


def _linear(d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, kernel_init=_zeros(axes), bias_init=_zeros(axes[1:]), rngs=rngs)


def _conv(d_in: int, d_out: int, stride: int, rngs: nnx.Rngs) -> nnx.Conv:
    return nnx.Conv(d_in, d_out, kernel_size=(3,), strides=(stride,), padding=[(1, 1)],
                    kernel_init=_zeros(("conv", "features", "embed")), bias_init=_zeros(("embed",)),
                    rngs=rngs)


class EncoderLayer(nnx.Module):
    """Pre-LayerNorm transformer layer: x + attn(LN(x)), then x + fc2(gelu(fc1(LN(x))))."""

    def __init__(self, cfg: WhisperEncoderConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        self.attn_norm = _layer_norm(d, rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.num_heads, in_features=d, qkv_features=d, out_features=d,
            kernel_init=_zeros(("embed", "heads", "head_dim")),
            out_kernel_init=_zeros(("heads", "head_dim", "embed")),
            bias_init=_zeros(("heads", "head_dim")), out_bias_init=_zeros(("embed",)),
            dropout_rate=0.0, decode=False, keep_rngs=False, rngs=rngs)
        self.mlp_norm = _layer_norm(d, rngs)
        self.fc1 = _linear(d, cfg.d_mlp, ("embed", "mlp"), rngs)
        self.fc2 = _linear(cfg.d_mlp, d, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.mlp_norm(x)), approximate=False))


class WhisperEncoder(nnx.Module):
    """log-mel [B, 2 * n_ctx, n_mels] -> hidden states [B, n_ctx, d_model] (module docstring)."""

    def __init__(self, cfg: WhisperEncoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        with nnx.use_eager_sharding(False):
            self.conv1 = _conv(cfg.n_mels, cfg.d_model, 1, rngs)
            self.conv2 = _conv(cfg.d_model, cfg.d_model, 2, rngs)
            self.positions = nnx.Param(jnp.zeros((cfg.n_ctx, cfg.d_model)), out_sharding=("length", "embed"))
            self.layers = nnx.List([EncoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
            self.final_norm = _layer_norm(cfg.d_model, rngs)

    def __call__(self, mel: jax.Array) -> jax.Array:
        x = jax.nn.gelu(self.conv1(mel), approximate=False)
        x = jax.nn.gelu(self.conv2(x), approximate=False)
        x = x + self.positions[...][: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)


def _assign(var: nnx.Variable, value: np.ndarray, path: Path, name: str) -> None:
    if tuple(var.shape) != tuple(value.shape):
        raise CT2FormatError(f"{path}: variable {name!r} gives shape {value.shape}, the encoder needs "
                             f"{tuple(var.shape)}")
    var.value = jnp.asarray(value, jnp.float32)


def load_whisper_encoder(path: str | os.PathLike) -> WhisperEncoder:
    """The Whisper encoder of a CTranslate2 model.bin (`encoder/` variables), fp32."""
    m = read_ct2_model(path, prefix=SCOPE)
    cfg = WhisperEncoderConfig.from_ct2(m)
    if cfg.d_model % cfg.num_heads:
        raise CT2FormatError(f"{m.path}: d_model {cfg.d_model} is not a multiple of {cfg.num_heads} heads")
    model = nnx.eval_shape(lambda: WhisperEncoder(cfg, rngs=nnx.Rngs(0)))
    heads, d = cfg.num_heads, cfg.d_model

    def put(var: nnx.Variable, name: str, fn=lambda a: a) -> None:
        _assign(var, fn(m.get(SCOPE + name)), m.path, SCOPE + name)

    def conv_kernel(w: np.ndarray) -> np.ndarray:  # [out, in, width] -> [width, in, out]
        return w.transpose(2, 1, 0)

    def norm(mod: nnx.LayerNorm, name: str) -> None:
        put(mod.scale, f"{name}/gamma")
        put(mod.bias, f"{name}/beta")

    for conv, name in ((model.conv1, "conv1"), (model.conv2, "conv2")):
        put(conv.kernel, f"{name}/weight", conv_kernel)
        put(conv.bias, f"{name}/bias")
    put(model.positions, "position_encodings/encodings")
    norm(model.final_norm, "layer_norm")
    for i, layer in enumerate(model.layers):
        pre = f"layer_{i}"
        norm(layer.attn_norm, f"{pre}/self_attention/layer_norm")
        qkv_w = m.get(f"{SCOPE}{pre}/self_attention/linear_0/weight")
        qkv_b = m.get(f"{SCOPE}{pre}/self_attention/linear_0/bias")
        if qkv_w.shape != (3 * d, d) or qkv_b.shape != (3 * d,):
            raise CT2FormatError(f"{m.path}: variable {SCOPE}{pre}/self_attention/linear_0 has shapes "
                                 f"{qkv_w.shape}, {qkv_b.shape}; a fused [3d, d] projection was expected")
        for j, proj in enumerate((layer.attn.query, layer.attn.key, layer.attn.value)):
            rows = slice(j * d, (j + 1) * d)
            where = f"{SCOPE}{pre}/self_attention/linear_0"
            _assign(proj.kernel, qkv_w[rows].T.reshape(d, heads, d // heads), m.path, where)
            _assign(proj.bias, qkv_b[rows].reshape(heads, d // heads), m.path, where)
        put(layer.attn.out.kernel, f"{pre}/self_attention/linear_1/weight",
            lambda w: w.T.reshape(heads, -1, d))
        put(layer.attn.out.bias, f"{pre}/self_attention/linear_1/bias")
        norm(layer.mlp_norm, f"{pre}/ffn/layer_norm")
        put(layer.fc1.kernel, f"{pre}/ffn/linear_0/weight", np.transpose)
        put(layer.fc1.bias, f"{pre}/ffn/linear_0/bias")
        put(layer.fc2.kernel, f"{pre}/ffn/linear_1/weight", np.transpose)
        put(layer.fc2.bias, f"{pre}/ffn/linear_1/bias")
    return model


class SharedEncoder:
    """A loaded encoder and its jitted forward: `__call__(mel [B, 3000, n_mels]) -> np.float32 [B, n_ctx, d]`.

    One trace per input shape; the encoders always feed [1, 3000, n_mels], so one per process.
    """

    def __init__(self, path: Path):
        self.path = path
        self.model = load_whisper_encoder(path)
        self.cfg = self.model.cfg
        graphdef, self._state = nnx.split(self.model)
        self._forward = jax.jit(lambda state, mel: nnx.merge(graphdef, state)(mel))

    def __call__(self, mel: np.ndarray) -> np.ndarray:
        mel = np.asarray(mel, np.float32)
        want = (2 * self.cfg.n_ctx, self.cfg.n_mels)
        if mel.ndim != 3 or mel.shape[1:] != want:
            raise ValueError(f"Whisper encoder input must be [B, {want[0]}, {want[1]}]; got {mel.shape}")
        return np.asarray(self._forward(self._state, mel), np.float32)


_SHARED: dict[tuple[str, int, int], SharedEncoder] = {}
_SHARED_LOCK = threading.Lock()


def shared_encoder(path: str | os.PathLike) -> SharedEncoder:
    """The process-wide `SharedEncoder` of a model.bin (reloaded if the file's size or mtime changed)."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise CT2FormatError(f"{p}: cannot read the CTranslate2 model: {e}") from None
    key = (str(p), st.st_size, st.st_mtime_ns)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = SharedEncoder(p)
        return _SHARED[key]


__all__ = ["N_FRAMES", "EncoderLayer", "SharedEncoder", "WhisperEncoder", "WhisperEncoderConfig",
           "load_whisper_encoder", "shared_encoder"]
