"""Where a run's model and its starting state come from: the shards' manifest, the checks the data must pass
before anything is built, the model on its mesh, the optimizer, and the parameters of `init_from`.

A run builds its model from the converted backbone (or a random one, for tests and tiny configs) and the
shapes its shards declare, so that the model and the data cannot disagree; everything that can disagree is
checked here, before a step compiles. A stage that follows another starts from that stage's parameters
(`init_from`: a training checkpoint or a PEFT export); a checkpoint holds only what some stage may train
(`saved_state`), and a resume checks that its model computes what the run's does (`function_of`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError
from safetensors.numpy import load_file

from empatheia_jax import sharding
from empatheia_jax.data import target_stats
from empatheia_jax.data.shard_format import load_manifest
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.models.empatheia_config import CS_VAES, EmpatheiaConfig
from empatheia_jax.models.llama import Llama, LlamaConfig, base_shapes_only
from empatheia_jax.models.lora import LoraConfig
from empatheia_jax.models.trainable import groups as all_groups
from empatheia_jax.models.trainable import trainable_filter
from empatheia_jax.train import config as config_lib
from empatheia_jax.train import ema, flat_update, stages
from empatheia_jax.train.checkpoint import (
    CheckpointError,
    TrainCheckpointer,
    checkpoints_of,
    read_meta,
    resolve_checkpoint,
    weights_item,
)
from empatheia_jax.weights.checkpoint_io import load_checkpoint, load_tokenizer
from empatheia_jax.weights.export_empatheia import (
    ADAPTER_FILE,
    HEADS_FILE,
    is_export,
    load_head_tensors,
    read_export_meta,
)
from empatheia_jax.weights.export_hf import ExportError, load_peft_tensors

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------------
# The manifest and the checks on it
# ----------------------------------------------------------------------------------------------------------

def model_manifest(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The manifest a run's model is built from: `config.data.shards`'.

    Text-only shards (`data.prepare --text-only`, e.g. EmpatheticDialogues for stage coe) carry no
    features, so a model built from them would have no media input to hand to the later stages. Such a
    run takes its feature dims, encoder and generator-target dims from `config.data.features_like` (the
    shards whose media the later stages read, e.g. the AvaMERG sample's): the model is then the one those
    stages build, and `init_from` chains into them.
    """
    manifest = load_manifest(config.data.shards)
    if manifest.get("media") != "none":
        return manifest
    like = str(config.data.get("features_like", "") or "")
    if not like:
        raise config_lib.ConfigError(
            f"data.shards={config.data.shards} is text-only (prepared with --text-only): set "
            "data.features_like to the shards whose features and targets the model is built for (e.g. the "
            "AvaMERG sample's), so that its later stages can follow"
        )
    ref = load_manifest(like)
    if ref.get("media") == "none":
        raise config_lib.ConfigError(f"data.features_like={like} is text-only too: it has no features")
    targets = {**(manifest.get("targets") or {}), "kinds": (ref.get("targets") or {}).get("kinds", {})}
    return {**manifest, "features": ref["features"], "encoder": ref.get("encoder"), "targets": targets}


def check_splits(config: ml_collections.ConfigDict, manifest: Mapping[str, Any]) -> None:
    """Both splits a run reads must be in its shards before a step is spent: a missing eval split would
    otherwise surface at the first evaluation, after the training work before it."""
    have = sorted(manifest.get("splits", {}))
    keys = ("train_split", "eval_split")
    bad = [f"data.{k}={config.data[k]!r}" for k in keys if config.data[k] not in have]
    if bad:
        raise config_lib.ConfigError(
            f"{', '.join(bad)}: no such split in {config.data.shards}/manifest.json (it has {have})"
        )


def check_unused_dims(config: ml_collections.ConfigDict) -> None:
    """A model whose video rows are 0 beyond `cv_dims` (the dims its face generator reads) must train on
    targets that are 0 there too, or it would be taught what it cannot say: checked on the train split's
    rows (`target_stats`) before anything is built."""
    used = config.model.empatheia.get("cv_dims", 0)
    if not used or config.ablations.no_cs:
        return
    shards, split = config.data.shards, config.data.train_split
    mean = target_stats.row_mean(shards, split, "video_content")
    if mean is None:  # text-only shards: no video targets to hold to it
        return
    var = target_stats.row_variance(shards, split, "video_content")
    moving = np.flatnonzero((np.abs(mean[used:]) > 0) | (var[used:] > 0)) + used
    if moving.size:
        raise config_lib.ConfigError(
            f"config.model.empatheia.cv_dims={used}: the video_content targets of {shards} split {split!r} "
            f"are not 0 in dims {moving[:8].tolist()}{' ...' if moving.size > 8 else ''} (set cv_dims to "
            "the dims the face generator reads, or 0 for every dim)")


# ----------------------------------------------------------------------------------------------------------
# The model and its optimizer
# ----------------------------------------------------------------------------------------------------------


def model_config_overrides(config: ml_collections.ConfigDict, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """EmpatheiaConfig fields of this run: config.model.empatheia + feature/target shapes + ablations."""
    feats, kinds = manifest["features"], manifest.get("targets", {}).get("kinds", {})
    ab = config.ablations
    over = dict(config.model.empatheia)
    over.update(
        audio_dim=int(feats["audio_dim"]),
        video_dim=int(feats["video_dim"]),
        k=int(feats.get("k", 1)),
        max_speech_len=int(config.data.max_speech_len),
        max_video_len=int(config.data.max_video_len),
        lora=LoraConfig(
            rank=int(config.model.lora.rank),
            alpha=float(config.model.lora.alpha),
            targets=tuple(config.model.lora.targets),
        ),
        use_coe=not ab.no_coe,
        media_input=not ab.no_media,
        use_cs=not ab.no_cs,
        use_sd=not ab.no_sd,
        pipeline_baseline=config.stage == stages.PIPELINE_BASELINE.name,
    )
    for key, kind in (
        ("speech_content_dim", "speech_content"),
        ("video_content_dim", "video_content"),
        ("style_dim", "speech_style"),
    ):
        if kind in kinds:
            over[key] = int(kinds[kind]["dim"])
    return over


def build_model(
    config: ml_collections.ConfigDict, manifest: Mapping[str, Any], mesh: Mesh | None = None
) -> tuple[Empatheia, Any]:
    """(model, tokenizer): the backbone (converted or random) wrapped by `Empatheia.from_llm`, on `mesh`.

    A converted backbone on a mesh of more than one device is restored straight into its shards
    (`checkpoint_io.load_checkpoint(mesh=)`) and `from_llm` builds only the small rest on the host
    (`llama.base_shapes_only`): no host holds the whole model, as a 7B run needs. A random backbone (tests,
    tiny configs) is built on the host and then placed.
    """
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.backbone)
    llm_fields = dict(config.model.llm)
    in_shards = mesh if mesh is not None and mesh.size > 1 and config.model.backbone else None
    if config.model.backbone:
        llm, _ = load_checkpoint(config.model.backbone, mesh=in_shards)
        llm_over = llm_fields
    else:
        if not llm_fields.get("vocab_size"):
            llm_fields["vocab_size"] = len(tokenizer)
        llm = Llama(LlamaConfig(**llm_fields), rngs=nnx.Rngs(config.seed))
        llm_over = {}
    over = model_config_overrides(config, manifest)
    model = Empatheia.from_llm(llm, tokenizer, {**over, "llm": llm_over}, rngs=nnx.Rngs(config.seed + 1),
                               mesh=in_shards)
    if mesh is not None and in_shards is None:
        sharding.shard_model(model, mesh)
    return model, tokenizer


def saved_state(model: Empatheia, include_backbone: bool) -> nnx.State:
    """What a checkpoint holds: every parameter some stage may train, plus the backbone when it is random."""
    return nnx.state(model, nnx.Param if include_backbone else trainable_filter(all_groups()))


def make_tx(
    config: ml_collections.ConfigDict, schedule: config_lib.Schedule, params: Any = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW, linear warmup then cosine decay, global-norm clipping; no decay on vectors (norms, biases);
    with optim.ema_decay > 0 the parameter EMA last (train/ema.py). Given the parameters it will train and
    every one replicated, the update runs on one vector (train/flat_update.py), the state still per leaf."""
    o = config.optim
    decay_steps = max(schedule.steps, schedule.warmup_steps + 1)
    lr = optax.warmup_cosine_decay_schedule(
        0.0, schedule.lr, schedule.warmup_steps, decay_steps, end_value=schedule.lr * o.end_lr_ratio
    )

    def make(weight_decay: Any, mask: Callable) -> optax.GradientTransformation:
        adamw = optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=weight_decay, mask=mask)
        tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw) if o.clip_norm > 0 else adamw
        if o.get("ema_decay", 0.0) > 0:
            tx = optax.chain(tx, ema.ema_params(o.ema_decay))
        return tx

    if params is not None and flat_update.replicated(params):
        return flat_update.on_one_vector(make, o.weight_decay), lr
    return make(o.weight_decay, flat_update.decays), lr


# ----------------------------------------------------------------------------------------------------------
# The starting parameters of `init_from`, and what a checkpoint's model must agree on
# ----------------------------------------------------------------------------------------------------------


def check_same(what: str, saved: Any, current: Any, where: Path) -> None:
    """Raises, naming the keys that differ, when a checkpoint's `what` (stage, model) is not the run's."""
    if saved != current:
        keys = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        raise ValueError(
            f"{where} holds a checkpoint of a different {what} (differs in {keys}); "
            "use a new workdir per stage and the same model config for every stage"
        )


def function_of(model_config: Mapping[str, Any] | EmpatheiaConfig) -> dict[str, Any]:
    """What a checkpoint's model must agree on with the run's: its config with the defaults of fields added
    since it was saved, less the fields that say how a step is computed (`EmpatheiaConfig.function_dict`)."""
    if isinstance(model_config, Mapping):  # (a reloaded module makes another EmpatheiaConfig class)
        model_config = EmpatheiaConfig.from_dict(model_config)
    return model_config.function_dict()


# The fields of the Content Synchronizer's design. A stage that trains the CS may start from a run whose CS
# was built otherwise (e.g. the coe stage of a run before `cs_units`): the CS heads that differ start fresh.
CS_DESIGN_FIELDS = frozenset({"cs_units", "cv_units", "cs_conv", "cs_unit_context", "cs_context_width",
                              "cs_context_skip", "cv_dims", *CS_VAES})


def init_from(
    config: ml_collections.ConfigDict, stage: stages.Stage, model: Empatheia, include_backbone: bool
) -> None:
    """Every saved parameter from `config.init_from` (a training checkpoint, or a PEFT export such as the
    committed reference model), whose model must be the run's, except that a stage training the CS ("cs"
    group) accepts a source differing only in `CS_DESIGN_FIELDS`: the CS blocks whose config differs keep
    their fresh init (said in the log) and everything else is the source's. That is exact for a source
    stage that never trained those blocks (coe), and a warm start otherwise."""
    from_export = is_export(config.init_from)
    if from_export:
        where, step, source_config, source_params = _export_params(Path(config.init_from), include_backbone)
    else:
        src_dir, step = resolve_checkpoint(checkpoints_of(config.init_from))
        source_meta = read_meta(src_dir, step)[1]
        where, source_config = src_dir, source_meta["model_config"]
    source, current = function_of(source_config), function_of(model.config)
    differ = {k for k in set(source) | set(current) if source.get(k) != current.get(k)}
    if differ and ("cs" not in stage.trainable_groups or not differ <= CS_DESIGN_FIELDS):
        check_same("model", source, current, Path(config.init_from))  # raises, naming the fields
    if not from_export:
        # the source's own (abstract) model is the restore target when its CS blocks have other shapes
        target = model if not differ else nnx.eval_shape(
            lambda: Empatheia(EmpatheiaConfig.from_dict(source_config), rngs=nnx.Rngs(0)))
        with TrainCheckpointer(where, create=False, async_save=False) as src:
            source_params = src.restore(step, params=saved_state(target, include_backbone),
                                        item=weights_item(source_meta)).params
        if not differ:
            nnx.update(model, source_params)
            log.info("initialised from %s step %d", where, step)
            return
    fresh = [name for name in CS_VAES if source[name] != current[name]]
    prefixes = [("content_sync", name.removeprefix("cs_")) for name in fresh]
    stored = {tuple(map(str, p)): v for p, v in nnx.to_flat_state(source_params)}
    kept = {}
    for path, var in nnx.to_flat_state(saved_state(model, include_backbone)):
        key = tuple(map(str, path))
        if any(key[:2] == prefix for prefix in prefixes):
            continue
        if key not in stored or tuple(stored[key].shape) != tuple(var.shape):
            raise CheckpointError(f"--init_from {where}: parameter {'/'.join(key)} has no counterpart of "
                                  f"shape {tuple(var.shape)} in the source")
        kept[path] = jax.device_put(stored[key][...], var[...].sharding)  # onto the run's mesh
    nnx.update(model, nnx.from_flat_state(kept))
    if fresh:
        log.info("initialised from %s step %d; the CS blocks %s start fresh (their design differs: %s)",
                 where, step, ", ".join(fresh), ", ".join(sorted(differ)))
    else:
        log.info("initialised from %s step %d", where, step)


def _export_params(path: Path, include_backbone: bool) -> tuple[Path, int, dict[str, Any], nnx.State]:
    """(where, step, model config, the trained parameters) of a PEFT export, for `init_from`: the export's
    model is built on the host with the files' LoRA and heads (its random backbone is never used: a stage
    that starts from an export keeps its backbone frozen). A merged export has the LoRA folded into the
    kernels and cannot be split back, so it is refused, as is a run that trains the backbone."""
    meta = read_export_meta(path)
    if meta["mode"] != "peft":
        raise CheckpointError(f"--init_from {path}: a {meta['mode']} export has the LoRA merged into the "
                              "backbone; export with --mode peft to start a stage from it")
    if include_backbone:
        raise CheckpointError(f"--init_from {path}: an export holds no backbone, and this run trains it")
    with base_shapes_only():  # only the adapter and the heads are read from it
        source = Empatheia(EmpatheiaConfig.from_dict(meta["model_config"]), rngs=nnx.Rngs(0))
    for name, fill in ((ADAPTER_FILE, lambda t, w: load_peft_tensors(source.llm, source.config.lora, t, w)),
                       (HEADS_FILE, lambda t, w: load_head_tensors(source, t, w))):
        try:
            fill(load_file(str(path / name)), str(path / name))
        except (OSError, SafetensorError, ExportError) as e:
            raise CheckpointError(f"--init_from {path}: cannot load {name}: {e}") from e
    return path, int(meta["step"]), meta["model_config"], saved_state(source, include_backbone=False)
