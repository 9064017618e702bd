"""Exports a trained model back to HuggingFace: a PEFT LoRA adapter, or a merged full checkpoint.

    python -m converters.export_hf --ckpt DIR --out OUT --peft    # adapter_config.json + adapter_model.*
    python -m converters.export_hf --ckpt DIR --out OUT --merged  # config.json + model*.safetensors + tok.

Both write plain safetensors with numpy (no torch needed to export) under PEFT's / transformers' own key
names, into a temporary folder that is renamed onto OUT only when complete.

Added-token rows (`extra_vocab > 0`) in a PEFT adapter use PEFT's `trainable_token_indices` (the rows are
stored as `...embed_tokens.token_adapter.trainable_tokens_delta`, and for untied models also
`...lm_head.token_adapter.trainable_tokens_delta`). PEFT stores those as the full values of the rows (it
index-copies them into the table), so the base only needs enough rows: load with

    base = AutoModelForCausalLM.from_pretrained(BASE); base.resize_token_embeddings(len(tokenizer))
    model = PeftModel.from_pretrained(base, OUT)        # tokenizer saved in OUT carries the added tokens

A PEFT adapter never carries the base weights: it assumes only LoRA (and the added rows) changed since
conversion, which is what every training stage guarantees. Use `--merged` when anything else trained.

A trained Empatheia (backbone + projections + CS/SD heads) is exported by
`empatheia_jax.weights.export_empatheia`,
which writes these same files beside its heads through `write_peft` / `write_merged`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from empatheia_jax.models.llama import Llama, LlamaConfig
from empatheia_jax.models.lora import ATTENTION_TARGETS, LoraConfig, LoRALinear, lora_config_of
from empatheia_jax.weights.hf_names import hf_tensors, param_names

PEFT_PREFIX = "base_model.model."
SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses safetensors files without a known format
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' own default shard size
# Stored dtypes. bfloat16 halves a file at no cost to a model trained in float32 or bfloat16 (SmolLM2 ships
# in it); float16 has the range problems bf16 avoids. safetensors.numpy reads and writes ml_dtypes.bfloat16.
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
STORE_DTYPES = tuple(_NP_DTYPES)


class ExportError(ValueError):
    """A checkpoint that cannot be exported in the requested format; the message says what to do instead."""


# ----------------------------------------------------------------------------------------------------------
# Atomic output folder
# ----------------------------------------------------------------------------------------------------------


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuses to replace a non-empty OUT unless asked; callers with expensive loading call it up front."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ExportError(f"{out} exists and is not empty (pass overwrite=True / --overwrite)")


class AtomicDir:
    """Writes into `OUT.tmp-*` beside OUT and renames it onto OUT on success; removes it on failure."""

    def __init__(self, out_dir: str | os.PathLike, overwrite: bool):
        self.out = Path(out_dir)
        self.overwrite = overwrite

    def __enter__(self) -> Path:
        check_out_dir(self.out, self.overwrite)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.out.name}.tmp-", dir=self.out.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = None
        if self.out.exists():
            old = self.out.with_name(f"{self.out.name}.old-{os.getpid()}")
            self.out.rename(old)
        self.tmp.rename(self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# PEFT adapter
# ----------------------------------------------------------------------------------------------------------


def _parent_name(target: str) -> str:
    return "self_attn" if target in ATTENTION_TARGETS else "mlp"


def peft_adapter_config(
    lora_cfg: LoraConfig, base_model_name_or_path: str | None, trainable_token_indices: Any = None
) -> dict[str, Any]:
    """`adapter_config.json` for peft 0.21's LoraConfig; fields peft does not find take its defaults."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": lora_cfg.rank,
        "lora_alpha": lora_cfg.alpha,
        "target_modules": list(lora_cfg.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "trainable_token_indices": trainable_token_indices,
    }


def peft_variables(model: Llama, lora_cfg: LoraConfig) -> Iterator[tuple[str, nnx.Variable, bool]]:
    """(PEFT key, our variable, transposed?) for every adapter tensor.

    The one table between PEFT's names and ours: `peft_tensors` (export) and `load_peft_tensors` (import)
    both read it, so the two directions cannot drift apart.
    """
    for i, layer in enumerate(model.layers):
        for target in lora_cfg.targets:
            parent = _parent_name(target)
            module = getattr(getattr(layer, parent), target)
            if not isinstance(module, LoRALinear):
                raise ExportError(f"layers[{i}].{parent}.{target} has no LoRA although the config targets it")
            key = f"{PEFT_PREFIX}model.layers.{i}.{parent}.{target}"
            yield f"{key}.lora_A.weight", module.lora.lora_a, True  # ours [in, r], PEFT [r, in]
            yield f"{key}.lora_B.weight", module.lora.lora_b, True  # ours [r, out], PEFT [out, r]
    cfg = model.config
    if cfg.extra_vocab:
        delta = "token_adapter.trainable_tokens_delta"
        yield f"{PEFT_PREFIX}model.embed_tokens.{delta}", model.embed_extra, False  # [extra, d] both
        if not cfg.tie_word_embeddings:
            yield f"{PEFT_PREFIX}lm_head.{delta}", model.lm_head_extra, True  # ours [d, extra]


def peft_tensors(model: Llama, lora_cfg: LoraConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(PEFT key, array) for every adapter tensor: lora_A.weight [r, in], lora_B.weight [out, r]."""
    for key, var, transpose in peft_variables(model, lora_cfg):
        value = np.asarray(var[...], np.float32)
        yield key, (value.T if transpose else value)


def load_peft_tensors(
    model: Llama, lora_cfg: LoraConfig, tensors: Mapping[str, np.ndarray], where: str = "adapter"
) -> None:
    """Writes an adapter's tensors (PEFT names and layouts) into `model`'s LoRA and added-row parameters.

    Every key the model expects must be there and nothing else, with the right shape: a partial load
    would leave parameters silently at their previous values.
    """
    table = list(peft_variables(model, lora_cfg))
    expected = {key for key, _, _ in table}
    missing = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ExportError(f"{where} does not fit the model: missing {missing[:5]} ({len(missing)}), "
                          f"unexpected {unexpected[:5]} ({len(unexpected)})")
    for key, var, transpose in table:
        stored = np.asarray(tensors[key])
        value = stored.T if transpose else stored
        if value.shape != var.shape:
            raise ExportError(f"{where}: tensor {key!r} has shape {stored.shape}, the model expects "
                              f"{var.shape[::-1] if transpose else var.shape}")
        var[...] = jnp.asarray(value, var.dtype)


def peft_token_indices(cfg: LlamaConfig) -> Any:
    """PEFT's `trainable_token_indices` for the added rows (None without any): a list for tied embeddings,
    one list per table otherwise."""
    if not cfg.extra_vocab:
        return None
    rows = list(range(cfg.vocab_size, cfg.total_vocab))
    return rows if cfg.tie_word_embeddings else {"embed_tokens": rows, "lm_head": rows}


def checked_lora_config(model: Llama, lora_cfg: LoraConfig | None) -> LoraConfig:
    """The adapter config to export: `lora_cfg` (or the model's own when None), refused when they differ."""
    found = lora_config_of(model)
    if found is None:
        raise ExportError("the model has no LoRA adapter to export as PEFT; "
                          "use --merged for a full checkpoint")
    lora_cfg = lora_cfg or found
    ours = (found.rank, found.scale, set(found.targets))
    if (lora_cfg.rank, lora_cfg.scale, set(lora_cfg.targets)) != ours:
        raise ExportError(f"lora config {lora_cfg} does not match the model's adapter {found}")
    return lora_cfg


def store_dtype(dtype: str) -> Any:
    """The numpy dtype a file is stored in, by name (`STORE_DTYPES`); an unknown name is an ExportError."""
    if dtype not in _NP_DTYPES:
        raise ExportError(f"dtype={dtype!r} not in {list(_NP_DTYPES)}")
    return _NP_DTYPES[dtype]


def write_peft(
    model: Llama,
    lora_cfg: LoraConfig,
    out: Path,
    base_model_name_or_path: str | None,
    tokenizer: Any = None,
    dtype: str = "float32",
) -> None:
    """Writes the adapter files into an existing (temporary) folder; `export_peft` and the Empatheia export
    wrap it in their own atomic folder."""
    np_dtype = store_dtype(dtype)
    # Contiguous copies: safetensors.numpy writes the raw buffer and ignores the strides of a transpose.
    tensors = {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in peft_tensors(model, lora_cfg)}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata=SAFETENSORS_METADATA)
    adapter_cfg = peft_adapter_config(lora_cfg, base_model_name_or_path, peft_token_indices(model.config))
    (out / "adapter_config.json").write_text(json.dumps(adapter_cfg, indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, out, model.config)


def export_peft(
    model: Llama,
    lora_cfg: LoraConfig | None,
    out_dir: str | os.PathLike,
    base_model_name_or_path: str | None = None,
    *,
    tokenizer: Any = None,
    overwrite: bool = False,
) -> Path:
    """Writes a PEFT LoRA adapter that `peft.PeftModel.from_pretrained(base, out_dir)` loads.

    `lora_cfg=None` reads the config back from the model. Added-token rows go into
    `trainable_token_indices` (see the module docstring for how to load them); the tokenizer, when given,
    is saved beside the adapter because its added tokens are part of what the adapter means.
    """
    lora_cfg = checked_lora_config(model, lora_cfg)
    with AtomicDir(out_dir, overwrite) as tmp:
        write_peft(model, lora_cfg, tmp, base_model_name_or_path, tokenizer)
    return Path(out_dir)


# ----------------------------------------------------------------------------------------------------------
# Merged full checkpoint
# ----------------------------------------------------------------------------------------------------------


def merged_hf_tensors(model: Llama) -> Iterator[tuple[str, np.ndarray]]:
    """HF (name, array) with every un-merged LoRA delta added to its kernel; the model is not modified.

    Streaming one tensor at a time keeps peak memory at one extra kernel, not a second copy of the model.
    """
    lora_by_hf = {}
    for name in param_names(model.config):
        if name.path[-1] == "kernel" and name.path[0] == "layers":
            _, i, parent, target, _ = name.path
            module = getattr(getattr(model.layers[i], parent), target)
            if isinstance(module, LoRALinear) and not module.merged:
                lora_by_hf[name.hf] = module
    for hf_name, value in hf_tensors(model):
        module = lora_by_hf.get(hf_name)
        if module is not None:  # value is the HF [out, in] layout of our [in, out] kernel
            delta = np.asarray(module.delta(), np.float32).T
            value = (value.astype(np.float32) + delta).astype(value.dtype)
        yield hf_name, value


def save_tokenizer(tokenizer: Any, out: Path, cfg: LlamaConfig) -> None:
    """`save_pretrained` into `out`, refusing a tokenizer with more tokens than the model has rows."""
    if len(tokenizer) > cfg.total_vocab:
        raise ExportError(
            f"tokenizer has {len(tokenizer)} tokens but the model only {cfg.total_vocab} rows; "
            "the checkpoint's tokenizer and weights do not belong together"
        )
    tokenizer.save_pretrained(str(out))


def write_sharded(
    tensors: Iterator[tuple[str, np.ndarray]], out: Path, max_shard_bytes: int, *, always_index: bool = False
) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when larger than one shard.

    `always_index` writes the index for a single shard too: a folder holding other safetensors files
    (the Empatheia export's heads) then still says which files are the model's.
    """
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    total = 0
    parts: list[Path] = []

    def flush() -> None:
        part = out / f"part-{len(parts):05d}.safetensors"
        save_file(shards[-1], str(part), metadata=SAFETENSORS_METADATA)
        parts.append(part)
        shards[-1] = {}

    weight_map: dict[str, int] = {}
    for name, value in tensors:
        nbytes = value.nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shards[-1][name] = np.ascontiguousarray(value)
        weight_map[name] = len(parts)
        size += nbytes
        total += nbytes
    flush()
    n = len(parts)
    if n == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for part, name in zip(parts, names, strict=True):
        part.rename(out / name)
    if n > 1 or always_index:
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: names[v] for k, v in weight_map.items()}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_merged(
    model: Llama,
    tokenizer: Any,
    out: Path,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    always_index: bool = False,
) -> None:
    """Writes the merged HF checkpoint files into an existing (temporary) folder (see `export_merged`)."""
    np_dtype = store_dtype(dtype)
    hf_config = model.config.to_hf()
    hf_config["dtype"] = dtype
    tensors = ((k, v.astype(np_dtype)) for k, v in merged_hf_tensors(model))
    write_sharded(tensors, out, max_shard_bytes, always_index=always_index)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, out, model.config)


def export_merged(
    model: Llama,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Writes a full HF checkpoint (LoRA merged, added rows folded into the vocab) for `from_pretrained`.

    Tied models write no `lm_head.weight` (transformers re-ties it from `tie_word_embeddings`).
    """
    store_dtype(dtype)  # before the output folder is touched
    with AtomicDir(out_dir, overwrite) as tmp:
        write_merged(model, tokenizer, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return Path(out_dir)


# ----------------------------------------------------------------------------------------------------------
