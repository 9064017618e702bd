"""The one table between HF `LlamaForCausalLM` tensor names and our `Llama` parameters.

Both directions (HF -> Flax in `hf_to_flax`, Flax -> HF in `export_hf`) read this table, so a rename happens
in exactly one place. HF Linear weights are [out, in]; ours are [in, out], hence `transpose`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from empatheia_jax.models.llama import Llama, LlamaConfig


@dataclass(frozen=True)
class ParamName:
    hf: str  # e.g. "model.layers.3.self_attn.q_proj.weight"
    path: tuple[str | int, ...]  # attribute path inside Llama, ending at the nnx.Param
    transpose: bool


def param_names(cfg: LlamaConfig) -> list[ParamName]:
    """Every pretrained tensor of the checkpoint, in HF order. Added-token rows are not HF tensors."""
    names = [ParamName("model.embed_tokens.weight", ("embed_tokens", "embedding"), False)]
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for p in "qkvo":
            names.append(ParamName(f"{pre}self_attn.{p}_proj.weight", ("layers", i, "self_attn", f"{p}_proj",
                                                                         "kernel"), True))
        for p in ("gate", "up", "down"):
            names.append(ParamName(f"{pre}mlp.{p}_proj.weight", ("layers", i, "mlp", f"{p}_proj", "kernel"),
                                   True))
        for p in ("input_layernorm", "post_attention_layernorm"):
            names.append(ParamName(f"{pre}{p}.weight", ("layers", i, p, "scale"), False))
    names.append(ParamName("model.norm.weight", ("norm", "scale"), False))
    if not cfg.tie_word_embeddings:
        names.append(ParamName("lm_head.weight", ("lm_head", "kernel"), True))
    return names


# Tensors a HF checkpoint may hold that carry no weights we need.
IGNORED_HF_TENSORS = ("rotary_emb.inv_freq",)


def variable(model: Llama, path: tuple[str | int, ...]):
    """The nnx.Param at `path` (a ParamName.path) of a model, concrete or abstract."""
    obj = model
    for p in path:
        obj = obj[p] if isinstance(p, int) else getattr(obj, p)
    return obj


class ConversionError(ValueError):
    """A checkpoint that does not fit the config: names the tensor and what was wrong."""


def _check_names(cfg: LlamaConfig, available: Iterable[str]) -> list[ParamName]:
    names = param_names(cfg)
    available = set(available)
    missing = [n.hf for n in names if n.hf not in available]
    if missing:
        raise ConversionError(f"checkpoint is missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    expected = {n.hf for n in names}
    unexpected = sorted(
        k for k in available if k not in expected and not k.endswith(IGNORED_HF_TENSORS)
        and not (cfg.tie_word_embeddings and k == "lm_head.weight")
    )
    if unexpected:
        raise ConversionError(f"checkpoint has tensors this config does not expect: {unexpected[:5]}")
    return names


def _check_shape(name: ParamName, hf_shape: tuple[int, ...], ours: tuple[int, ...]) -> None:
    """`hf_shape` as the checkpoint stores it ([out, in] for a Linear), `ours` as our parameter is."""
    want = ours[::-1] if name.transpose else ours
    if tuple(hf_shape) != tuple(want):
        raise ConversionError(f"tensor {name.hf!r} has shape {tuple(hf_shape)}, config expects {tuple(want)}")


def check_hf_tensors(model: Llama, shapes: Mapping[str, tuple[int, ...]]) -> list[ParamName]:
    """Every error `load_hf_tensors` can raise, from the tensor names and shapes alone (`model` may be
    abstract), so a streaming converter fails before it writes anything. Returns the tensors to copy."""
    names = _check_names(model.config, shapes)
    for name in names:
        _check_shape(name, tuple(shapes[name.hf]), tuple(variable(model, name.path).shape))
    return names


def load_hf_tensors(
    model: Llama,
    get_tensor: Callable[[str], np.ndarray],
    available: set[str],
    *,
    progress: Callable[[Iterator], Iterator] = iter,
) -> None:
    """Copies HF tensors into `model` one at a time (streaming: only one tensor is materialised at once).

    Raises ConversionError naming the first missing tensor, every unexpected one, or a shape mismatch.
    """
    for name in progress(_check_names(model.config, available)):
        value = np.asarray(get_tensor(name.hf))
        var = variable(model, name.path)
        _check_shape(name, value.shape, var.shape)
        if name.transpose:
            value = value.T
        var[...] = jnp.asarray(value, dtype=var.dtype)


def hf_tensors(model: Llama) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (HF name, array) for the whole model with added-token rows folded into the vocab tables."""
    cfg = model.config
    for name in param_names(cfg):
        value = np.asarray(variable(model, name.path)[...])
        if name.path[0] == "embed_tokens" and cfg.extra_vocab:
            value = np.concatenate([value, np.asarray(model.embed_extra[...])], axis=0)
        if name.path[0] == "lm_head" and cfg.extra_vocab:
            value = np.concatenate([value, np.asarray(model.lm_head_extra[...])], axis=1)
        yield name.hf, (value.T if name.transpose else value)


def check_config_matches(cfg: LlamaConfig, hf_config: Mapping) -> None:
    """Rejects a config.json whose shapes disagree with ours (e.g. a checkpoint from another model)."""
    theirs = LlamaConfig.from_hf(hf_config)
    diffs = [
        f"{f}: ours={getattr(cfg, f)!r} checkpoint={getattr(theirs, f)!r}"
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
        if getattr(cfg, f) != getattr(theirs, f)
    ]
    if diffs:
        raise ConversionError("config mismatch: " + "; ".join(diffs))
