"""Exports a trained Empatheia (a training workdir / checkpoint) as one self-describing folder; loads it.

    export_trained(ckpt, out, *, step=None, mode="peft", overwrite=False, dtype="float32") -> out
    load_exported(out) -> (model, tokenizer, config, meta)      # = trainer.load_trained(out)

Why a folder of its own: a training checkpoint holds only what the run could change (the frozen backbone is
re-read from `model.backbone`) in orbax's layout, which nothing outside this project reads. The export is
the hand-over format: the backbone part in HF's own formats (so `peft` / `transformers` load it without
this code) and the rest (input projections, CS, SD) as plain safetensors, plus everything needed to rebuild
the exact model.

OUT/ (written under OUT.tmp-* and renamed onto OUT when complete; `empatheia_config.json` is written last):

    empatheia_config.json       format, format_version, mode, step, model_config (EmpatheiaConfig.to_dict()),
                                config (the run's resolved config), stage, encoder (the shards' encoder
                                entry), targets (the shards' target kinds and sources), backbone (the
                                converted backbone folder, absolute), backbone_source (that folder's HF
                                source), include_backbone, nonfinite_skipped, exported_from
    heads.safetensors           every parameter outside the backbone, in the stored dtype (float32 unless
                                `dtype=` says bfloat16/float16), named by its nnx state path
                                ("aud_proj.kernel", "content_sync.speech...", "style_dis.speech_in.shift")
    tokenizer*                  the run's tokenizer, extended with <Aud>/<Vid>/<AUDi>/<VIDi>
    mode "peft":
      adapter_config.json       PEFT LoraConfig; trainable_token_indices = the added token ids
      adapter_model.safetensors LoRA A/B + the added embedding / lm_head rows (PEFT's trainable_tokens_delta)
    mode "merged":
      config.json               HF LlamaConfig with the extended vocab_size
      model*.safetensors        LoRA folded into the kernels, added rows appended to the vocab tables
      model.safetensors.index.json   always written, so heads.safetensors is never taken for a model shard

PEFT needs the base resized first: `base.resize_token_embeddings(len(tokenizer))`, then
`PeftModel.from_pretrained(base, OUT)`; the added rows it loads are the trained rows themselves. A PEFT
export is refused for a run whose backbone was random (nothing to apply it to) and for a merged export as
source (its kernels are no longer the converted backbone's).

Loading a "peft" export reads the base from `meta["backbone"]` (a converted folder, `backbone=` overrides
it when the folder moved); a "merged" export is self-contained and loads with LoRA B = 0 (A as initialised):
the adapter lives in the kernels. The model is built as `trainer.load_trained` builds it (for "peft" the
run's `untrained_model`: base backbone, fresh heads), then every parameter outside the base is set from a
file whose names and shapes are checked against the model first, so none is left at its initial value.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.weights.checkpoint_io import CheckpointError, read_config, read_json
from empatheia_jax.weights.export_hf import (
    SAFETENSORS_METADATA,
    AtomicDir,
    ExportError,
    checked_lora_config,
    store_dtype,
    write_merged,
    write_peft,
)

EXPORT_CONFIG = "empatheia_config.json"
HEADS_FILE = "heads.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
FORMAT = "empatheia_jax.export"
FORMAT_VERSION = 1
MODES = ("peft", "merged")
_EXPORT_KEYS = ("format", "format_version", "mode", "backbone_source", "exported_from", "stored_dtype")
RUN_KEYS = ("step", "model_config", "config", "stage", "encoder", "backbone", "include_backbone")
HF_VOCAB_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def is_export(path: str | os.PathLike) -> bool:
    """True for a folder written by `export_trained` (it holds empatheia_config.json)."""
    return (Path(path) / EXPORT_CONFIG).is_file()


def read_export_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The export's empatheia_config.json, checked (format, version, mode, keys); errors name the file."""
    path = Path(path)
    file = path / EXPORT_CONFIG
    if ".tmp-" in path.name:
        raise CheckpointError(f"{path} is the temporary folder of an interrupted (or running) export")
    meta = read_json(file, CheckpointError, f"{path} is not an Empatheia export folder")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format={meta.get('format') if isinstance(meta, dict) else None!r}, "
                              f"expected {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format_version={meta.get('format_version')!r}, this code reads "
                              f"{FORMAT_VERSION}")
    if meta.get("mode") not in MODES:
        raise CheckpointError(f"{file}: mode={meta.get('mode')!r} is not one of {MODES}")
    missing = [k for k in RUN_KEYS if k not in meta]
    if missing:
        raise CheckpointError(f"{file} lacks {missing}")
    return meta


# ----------------------------------------------------------------------------------------------------------
# Heads: every parameter outside the backbone, by nnx state path
# ----------------------------------------------------------------------------------------------------------


def _head_variables(model: Empatheia) -> dict[str, nnx.Variable]:
    return {
        ".".join(map(str, path)): var
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if path[0] != "llm"
    }


def head_tensors(model: Empatheia, dtype: str = "float32") -> dict[str, np.ndarray]:
    """{state path: array} of the projections, CS and SD, stored as `dtype` (export_hf.STORE_DTYPES)."""
    np_dtype = store_dtype(dtype)
    variables = _head_variables(model)
    return {k: np.ascontiguousarray(np.asarray(v[...], np.float32).astype(np_dtype))
            for k, v in variables.items()}


def load_head_tensors(model: Empatheia, tensors: dict[str, np.ndarray], where: str) -> None:
    """Sets every head parameter from `tensors`; the name sets and shapes must match exactly."""
    variables = _head_variables(model)
    missing, unexpected = sorted(set(variables) - set(tensors)), sorted(set(tensors) - set(variables))
    if missing or unexpected:
        raise CheckpointError(f"{where} does not fit the model config: missing {missing[:5]} "
                              f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})")
    for name, var in variables.items():
        if tuple(tensors[name].shape) != tuple(var.shape):
            raise CheckpointError(f"{where}: {name!r} has shape {tuple(tensors[name].shape)}, the model "
                                  f"config implies {tuple(var.shape)}")
        var[...] = jnp.asarray(tensors[name], var.dtype)


# ----------------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------------


def _backbone_source(backbone: str) -> str | None:
    """The HF source recorded by the converter, the adapter's `base_model_name_or_path` (None if unknown)."""
    try:
        return read_config(backbone)[2].get("source") or None
    except CheckpointError:
        return None


def export_model(
    model: Empatheia,
    tokenizer: Any,
    meta: dict[str, Any],
    out: str | os.PathLike,
    *,
    mode: str = "peft",
    overwrite: bool = False,
    dtype: str = "float32",
) -> Path:
    """Writes the export folder of an in-memory model (`export_trained` after loading, or a notebook);
    `tokenizer`/`meta` are `trainer.load_trained`'s. See the module docstring for the layout. `dtype` is
    the stored dtype of every written weight (loading casts back to the model's)."""
    if mode not in MODES:
        raise ExportError(f"mode={mode!r} is not one of {MODES}")
    store_dtype(dtype)
    if tokenizer is None:
        raise ExportError("no tokenizer: the export must carry the tokenizer with the added tokens")
    out = Path(out)
    backbone = str(meta.get("backbone") or "")
    if mode == "peft":
        if not backbone:
            raise ExportError("the run trained on a random backbone (model.backbone=''): a PEFT adapter has "
                              "no base to apply to; use mode='merged'")
        if meta.get("mode") == "merged":
            raise ExportError("the source is a merged export: its kernels hold the LoRA update, so they are "
                              "no longer the converted backbone's and an adapter over that base would be "
                              "wrong; use mode='merged'")
    if backbone and Path(backbone).exists():
        backbone = str(Path(backbone).absolute())
    record = {k: v for k, v in meta.items() if k not in _EXPORT_KEYS}
    record.update(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        mode=mode,
        model_config=model.config.to_dict(),
        backbone=backbone,
        backbone_source=_backbone_source(backbone) if backbone else None,
        exported_from=str(meta.get("exported_from") or ""),
        stored_dtype=dtype,
    )
    missing = [k for k in RUN_KEYS if k not in record]
    if missing:
        raise ExportError(f"meta lacks {missing}: pass the meta dict of trainer.load_trained")
    llm = model.llm
    with AtomicDir(out, overwrite) as tmp:
        if mode == "peft":
            write_peft(llm, checked_lora_config(llm, model.config.lora), tmp, record["backbone_source"],
                       tokenizer, dtype=dtype)
        else:
            write_merged(llm, tokenizer, tmp, dtype=dtype, always_index=True)  # both save the tokenizer
        save_file(head_tensors(model, dtype), str(tmp / HEADS_FILE), metadata=SAFETENSORS_METADATA)
        # Last: a folder holding empatheia_config.json has every other file.
        (tmp / EXPORT_CONFIG).write_text(json.dumps(record, indent=1) + "\n")
    return out


# ----------------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------------


__all__ = [
    "EXPORT_CONFIG",
    "FORMAT_VERSION",
    "HEADS_FILE",
    "MODES",
    "export_model",
    "head_tensors",
]
