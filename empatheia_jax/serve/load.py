"""A trained Empatheia, loaded for serving: from a training run (its orbax checkpoints) or from an export.

`load_trained` is the public API (`empatheia_jax.load_trained`); serving imports this module, not the
training loop. `export_trained` writes a run as an export (`weights.export_empatheia`), which
`load_trained` reads back to the same model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from safetensors import SafetensorError
from safetensors.numpy import load_file

from empatheia_jax.data.templates import extend_tokenizer
from empatheia_jax.models.empatheia import Empatheia, copy_backbone
from empatheia_jax.models.empatheia_config import EmpatheiaConfig
from empatheia_jax.models.llama import Llama, base_shapes_only
from empatheia_jax.models.lora import lora_layers
from empatheia_jax.train import config as config_lib
from empatheia_jax.train.checkpoint import (
    CheckpointError,
    TrainCheckpointer,
    checkpoints_of,
    read_meta,
    resolve_checkpoint,
    weights_item,
)
from empatheia_jax.train.init import build_model, model_manifest, saved_state
from empatheia_jax.weights.checkpoint_io import load_checkpoint, load_tokenizer
from empatheia_jax.weights.export_empatheia import (
    ADAPTER_FILE,
    EXPORT_CONFIG,
    HEADS_FILE,
    HF_VOCAB_TABLES,
    MODES,
    export_model,
    is_export,
    load_head_tensors,
    read_export_meta,
)
from empatheia_jax.weights.export_hf import (
    ExportError,
    check_out_dir,
    load_peft_tensors,
    store_dtype,
)
from empatheia_jax.weights.hf_names import ConversionError, check_config_matches, load_hf_tensors


def untrained_model(config: ml_collections.ConfigDict, meta: Mapping[str, Any]) -> Empatheia:
    """The run's model before its first step: its backbone (the converted folder, or the random one rebuilt
    from the run's seed and shards), fresh heads, LoRA B = 0. Shared by training checkpoints and exports."""
    if not meta["backbone"]:
        return build_model(config, model_manifest(config))[0]
    with base_shapes_only():  # the converted backbone's values are copied in below
        model = Empatheia(EmpatheiaConfig.from_dict(meta["model_config"]), rngs=nnx.Rngs(config.seed + 1))
    llm, _ = load_checkpoint(meta["backbone"])
    copy_backbone(llm, model.llm)
    return model


def load_trained(
    path: str | Path, *, step: int | None = None, restore: bool = True, backbone: str | Path | None = None
) -> tuple[Empatheia, Any, ml_collections.ConfigDict, dict[str, Any]]:
    """(model, tokenizer, config, meta) from a training workdir, its checkpoints folder, one step folder, or
    an export folder (`empatheia_jax.weights.export_empatheia`, recognised by its `empatheia_config.json`).

    A run that kept a parameter EMA gives the averaged weights (`weights_item`).
    restore=False gives the run's model untrained (same config and backbone, fresh heads, LoRA B = 0): the
    "untrained" column of `empatheia eval`. `backbone` replaces the converted-backbone folder the run or
    export recorded (it moved, or the export came from another machine: the committed reference model).
    """
    from empatheia_jax.serve.load import load_exported

    if is_export(path):
        loaded = load_exported(path, step=step, restore=restore, backbone=backbone)
        config_lib.set_matmul_precision(loaded[2])  # the run's numerics, as it trained
        return loaded
    directory, found = resolve_checkpoint(checkpoints_of(path))
    step = found if step is None else step
    _, meta = read_meta(directory, step)
    if backbone is not None:
        if not meta["backbone"]:
            raise CheckpointError(f"{directory}: the run trained a random backbone; backbone= has nothing to "
                                  "replace")
        meta["backbone"] = str(backbone)
    config = ml_collections.ConfigDict(meta["config"])
    config_lib.set_matmul_precision(config)
    cfg = EmpatheiaConfig.from_dict(meta["model_config"])
    for what, folder in (("backbone", meta["backbone"]), ("tokenizer", config.model.tokenizer)):
        if folder and not Path(folder).is_dir():  # else transformers would look it up as a Hub model id
            raise CheckpointError(f"{directory}: the run's {what} folder {folder} does not exist (a relative "
                                  "path is read from the current directory: run from the directory training "
                                  "ran in, or put the folder there)")
    tokenizer = load_tokenizer(config.model.tokenizer or meta["backbone"])
    extend_tokenizer(tokenizer, cfg.n_signal)
    if not restore:
        return untrained_model(config, meta), tokenizer, config, meta
    if meta["backbone"]:
        model = untrained_model(config, meta)
    else:  # every parameter is in the checkpoint
        model = Empatheia(cfg, rngs=nnx.Rngs(config.seed + 1))
    with TrainCheckpointer(directory, create=False, async_save=False) as ckpt:
        restored = ckpt.restore(step, params=saved_state(model, meta["include_backbone"]),
                                item=weights_item(meta))
    nnx.update(model, restored.params)
    return model, tokenizer, config, meta


def export_trained(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    mode: str = "peft",
    overwrite: bool = False,
    dtype: str = "float32",
    max_len: int | None = None,
) -> Path:
    """Exports a training workdir, its checkpoints folder, one step folder or another export folder.

    mode "peft": PEFT adapter (LoRA + added rows) over the converted backbone; "merged": a full HF
    checkpoint. Both add heads.safetensors, empatheia_config.json and the tokenizer (module docstring).
    `max_len` is the prompt budget the export serves at (its `config.data.max_len`, which eval and chat read;
    default the run's): a run that retrained the CS alone keeps the text model of the export it chained
    from, and serving at that export's budget keeps its measured text figures true (`model_card
    --text_from`). The run's own budget is kept as `trained_max_len`.
    Errors a caller can cause are raised before anything is loaded or written.
    """
    if mode not in MODES:
        raise ExportError(f"mode={mode!r} is not one of {MODES}")
    store_dtype(dtype)
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 16):
        raise ExportError(f"max_len={max_len!r} must be an int >= 16 (the prompt budget in tokens)")
    src, out = Path(ckpt), Path(out)
    if not src.exists():
        raise CheckpointError(f"no trained checkpoint at {src}: pass a training workdir, its checkpoints "
                              "folder, one step folder in it, or an export folder")
    if _is_within(src, out):
        raise ExportError(f"out={out} would replace the checkpoint {src} that is being exported")
    check_out_dir(out, overwrite)
    from empatheia_jax.serve.load import load_trained

    model, tokenizer, _, meta = load_trained(src, step=step)
    if not is_export(src):
        meta = {**meta, "exported_from": str(src.absolute())}
    trained = int(meta["config"]["data"]["max_len"])
    if max_len is not None and max_len != trained:
        config = {**meta["config"], "data": {**meta["config"]["data"], "max_len": max_len}}
        meta = {**meta, "config": config, "trained_max_len": meta.get("trained_max_len", trained)}
    return export_model(model, tokenizer, meta, out, mode=mode, overwrite=overwrite, dtype=dtype)


def _load_merged_backbone(llm: Llama, folder: Path) -> None:
    """Fills `llm`'s base parameters and `*_extra` rows (not its LoRA) from a merged HF folder."""
    from empatheia_jax.weights.hf_to_flax import (
        _open_safetensors,  # reads torch dtypes too; torch is a converter dep
    )

    cfg = llm.config
    hf_file = folder / "config.json"
    try:
        check_config_matches(cfg.replace(vocab_size=cfg.total_vocab, extra_vocab=0),
                             json.loads(hf_file.read_text()))
    except (OSError, json.JSONDecodeError, ValueError) as e:
        raise CheckpointError(f"{hf_file} does not describe the exported model: {e}") from e
    added: dict[str, np.ndarray] = {}

    def get_tensor(name: str) -> np.ndarray:
        value = get(name)
        if name in HF_VOCAB_TABLES:  # [total_vocab, d]: base rows, then the added ones
            added[name] = value[cfg.vocab_size:]
            value = value[: cfg.vocab_size]
        return value

    try:
        with _open_safetensors(folder) as (get, available):
            load_hf_tensors(llm, get_tensor, available)
    except ConversionError as e:
        raise CheckpointError(f"merged weights in {folder}: {e}") from e
    if cfg.extra_vocab:
        llm.embed_extra[...] = jnp.asarray(added["model.embed_tokens.weight"], llm.embed_extra.dtype)
        if not cfg.tie_word_embeddings:
            llm.lm_head_extra[...] = jnp.asarray(added["lm_head.weight"].T, llm.lm_head_extra.dtype)


def load_exported(
    path: str | os.PathLike,
    *,
    step: int | None = None,
    restore: bool = True,
    backbone: str | os.PathLike | None = None,
) -> tuple[Empatheia, Any, ml_collections.ConfigDict, dict[str, Any]]:
    """(model, tokenizer, config, meta) from an export folder: `trainer.load_trained`'s contract.

    `step`, when given, must be the exported step (an export holds one). `restore=False` gives the run's
    untrained model (`trainer.untrained_model`). `backbone` replaces the recorded converted-backbone folder
    (a "peft" export needs it) when it has moved.
    """
    from empatheia_jax.serve.load import untrained_model

    path = Path(path)
    meta = read_export_meta(path)
    if step is not None and int(step) != int(meta["step"]):
        raise CheckpointError(f"{path} exports step {meta['step']}, not step {step}")
    if backbone is not None:
        meta["backbone"] = str(backbone)
    config = ml_collections.ConfigDict(meta["config"])
    cfg = EmpatheiaConfig.from_dict(meta["model_config"])
    tokenizer = load_tokenizer(path)
    ids = extend_tokenizer(tokenizer, cfg.n_signal)
    if tuple(sorted(ids.values())) != tuple(cfg.added_ids) or len(tokenizer) > cfg.llm.total_vocab:
        raise CheckpointError(f"the tokenizer in {path} does not match {path / EXPORT_CONFIG}: added token "
                              f"ids {sorted(ids.values())} vs {list(cfg.added_ids)}")
    if not restore:
        return untrained_model(config, meta), tokenizer, config, meta
    if meta["mode"] == "peft":
        if not meta["backbone"]:
            raise CheckpointError(f"{path / EXPORT_CONFIG} names no backbone for its PEFT adapter")
        try:  # the run's own construction: base backbone, then every other parameter from the files
            model = untrained_model(config, meta)
        except ValueError as e:  # CheckpointError (missing folder) included: it names the folder
            raise CheckpointError(f"the backbone {meta['backbone']} of the PEFT export {path} cannot be "
                                  f"used (pass backbone= when it moved): {e}") from e
        adapter = path / ADAPTER_FILE
        try:
            load_peft_tensors(model.llm, cfg.lora, load_file(str(adapter)), str(adapter))
        except (OSError, SafetensorError, ExportError) as e:
            raise CheckpointError(f"cannot load the adapter {adapter}: {e}") from e
    else:
        model = Empatheia(cfg, rngs=nnx.Rngs(config.seed + 1))
        _load_merged_backbone(model.llm, path)
        for layer in lora_layers(model.llm):  # the update is in the kernels: a zero adapter on top
            layer.lora.lora_b[...] = jnp.zeros_like(layer.lora.lora_b[...])
    try:
        heads = load_file(str(path / HEADS_FILE))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read {path / HEADS_FILE}: {e}") from e
    load_head_tensors(model, heads, str(path / HEADS_FILE))
    return model, tokenizer, config, meta


def _is_within(inner: Path, outer: Path) -> bool:
    inner, outer = inner.resolve(), outer.resolve()
    return inner == outer or outer in inner.parents
