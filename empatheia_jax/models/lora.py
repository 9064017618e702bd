"""LoRA on the backbone, built on Flax's own `nnx.LoRA` / `nnx.LoRAParam`.

`nnx.LoRA` computes `x @ A @ B` with no alpha/r scaling, while PEFT computes `(alpha/r) * x @ A @ B`. To
keep PEFT's parameterisation (so an exported adapter is the same numbers, and learning rates transfer)
`LoRALinear` is `nnx.LoRALinear` plus that one scale. It stays an `nnx.Linear` subclass, so the base
`kernel` keeps its path and HF conversion is unaffected by whether LoRA is applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from empatheia_jax.models.llama import Llama, shape_only

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ATTENTION_TARGETS

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"lora rank={self.rank} must be positive")
        unknown = sorted(set(self.targets) - set(ATTENTION_TARGETS + MLP_TARGETS))
        if unknown:
            raise ValueError(f"unknown LoRA targets {unknown}; choose from {ATTENTION_TARGETS + MLP_TARGETS}")
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: dict) -> LoraConfig:
        return cls(rank=int(d["rank"]), alpha=float(d["alpha"]), targets=tuple(d["targets"]))


class LoRALinear(nnx.LoRALinear):
    """`nnx.LoRALinear` with PEFT's alpha/r scale and merge/unmerge."""

    def __init__(self, *args, lora_scale: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora_scale = lora_scale
        self.merged = False

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        y = nnx.Linear.__call__(self, x, out_sharding=out_sharding)
        if self.merged:
            return y
        return y + (self.lora_scale * self.lora(x)).astype(y.dtype)

    def delta(self) -> jax.Array:
        """The dense update this adapter adds to the kernel: scale * A @ B, [in, out]."""
        return self.lora_scale * (self.lora.lora_a[...] @ self.lora.lora_b[...])

    def merge(self) -> None:
        if not self.merged:
            self.kernel[...] = (self.kernel[...] + self.delta()).astype(self.kernel.dtype)
            self.merged = True

    def unmerge(self) -> None:
        if self.merged:
            self.kernel[...] = (self.kernel[...] - self.delta()).astype(self.kernel.dtype)
            self.merged = False


def _target_modules(model: Llama, targets: Sequence[str]):
    for i, layer in enumerate(model.layers):
        for name in targets:
            parent = layer.self_attn if name in ATTENTION_TARGETS else layer.mlp
            yield i, parent, name


def apply_lora(model: Llama, cfg: LoraConfig, *, rngs: nnx.Rngs) -> Llama:
    """Replaces each target `nnx.Linear` with a `LoRALinear` holding the same kernel (B starts at zero)."""
    with nnx.use_eager_sharding(False):
        for _, parent, name in _target_modules(model, cfg.targets):
            base: nnx.Linear = getattr(parent, name)
            if isinstance(base, LoRALinear):
                raise ValueError(f"LoRA is already applied to {name}")
            axes = base.kernel.get_metadata().get("out_sharding") or (None, None)
            wrapped = LoRALinear(
                base.in_features,
                base.out_features,
                lora_rank=cfg.rank,
                lora_scale=cfg.scale,
                use_bias=False,
                dtype=base.dtype,
                param_dtype=base.param_dtype,
                lora_dtype=base.dtype,
                kernel_init=nnx.with_partitioning(shape_only, axes),  # the base kernel, set below
                dot_general=base.dot_general,  # the base's precision rule (llama._dense_dot_general)
                a_metadata={"out_sharding": (axes[0], "lora_rank")},
                b_metadata={"out_sharding": ("lora_rank", axes[1])},
                rngs=rngs,
            )
            wrapped.kernel.set_value(base.kernel.get_value())
            setattr(parent, name, wrapped)
    return model


def lora_layers(model: nnx.Module) -> list[LoRALinear]:
    return [m for _, m in model.iter_modules() if isinstance(m, LoRALinear)]


def merge_lora(model: nnx.Module) -> None:
    for m in lora_layers(model):
        m.merge()


def unmerge_lora(model: nnx.Module) -> None:
    for m in lora_layers(model):
        m.unmerge()


def lora_state(model: nnx.Module) -> nnx.State:
    return nnx.state(model, nnx.LoRAParam)


def set_lora_b(model: nnx.Module, key: jax.Array, std: float = 0.02) -> None:
    """Random non-zero B (tests and exports need an adapter that actually changes the output)."""
    for i, m in enumerate(lora_layers(model)):
        b = m.lora.lora_b
        b[...] = std * jax.random.normal(jax.random.fold_in(key, i), b.shape, jnp.float32).astype(b.dtype)


def lora_config_of(model: nnx.Module) -> LoraConfig | None:
    """The LoraConfig that `apply_lora` was called with, read back from the model (None without LoRA).

    Exports use it so a checkpoint's adapter is described by what the model holds, not by a config that
    might have drifted from it.
    """
    layers = [(path, m) for path, m in model.iter_modules() if isinstance(m, LoRALinear)]
    if not layers:
        return None
    ranks = {m.lora.lora_a.shape[1] for _, m in layers}
    scales = {float(m.lora_scale) for _, m in layers}
    if len(ranks) != 1 or len(scales) != 1:
        raise ValueError(f"LoRA layers disagree: ranks={sorted(ranks)} scales={sorted(scales)}")
    rank, scale = ranks.pop(), scales.pop()
    present = {str(path[-1]) for path, _ in layers}
    targets = tuple(t for t in ATTENTION_TARGETS + MLP_TARGETS if t in present)
    return LoraConfig(rank=rank, alpha=scale * rank, targets=targets)
