"""Training one stage: config -> sharded model and data -> jitted steps -> checkpoints and metrics.

The story of a run (`train(config, workdir)`):

1. `config.validate` rejects bad values before anything is built; `jax.distributed.initialize` runs first
   when configured, so every later call sees all processes.
2. The model is built from the converted backbone (or a random one for tests) by `Empatheia.from_llm`,
   placed on a `data`/`fsdp`/`tensor` mesh by the logical-axis rules (`sharding.shard_model`); the
   optimizer (AdamW, warmup + cosine, global-norm clipping) holds state only for the stage's groups.
3. Each step takes `batch_size / process_count` examples from this process's grain pipeline, assembles
   them into global arrays shaped `[grad_accum, micro_batch, ...]`, and runs ONE jitted program: a
   `lax.scan` over the micro-batches accumulates gradients, each micro-batch's loss normalised by the
   whole step's counts (`objective.loss_counts`) and its VAE noise drawn from per-example keys, so the
   update equals the one of a single big batch. A non-finite loss or gradient norm leaves parameters and
   optimizer state untouched inside the program; the host then applies `train.nan_policy`.
4. Checkpoints (`checkpoint.TrainCheckpointer`, async orbax) hold the parameters the run can change
   (everything but the frozen pretrained backbone, which is re-read from `model.backbone`), the optimizer
   state, the pipeline iterator state and the resolved config. A workdir with checkpoints resumes from
   the latest one; the step key is `fold_in(seed, step)`, so a resumed run is bit-identical to an
   uninterrupted one. SIGTERM (or a preemption notice) saves and returns cleanly.
5. Metrics go to TensorBoard (`WORKDIR/tensorboard`), `WORKDIR/metrics.jsonl` and a tqdm bar.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import SafetensorError
from safetensors.numpy import load_file

from empatheia_jax import sharding
from empatheia_jax.data import target_stats
from empatheia_jax.data.input_pipeline import (
    TOKEN_KEYS,
    InputPipeline,
    make_dataset,
    make_global_batch,
    pack_text_batch,
    pipeline_config_fields,
)
from empatheia_jax.data.shard_format import load_manifest, target_source
from empatheia_jax.generators import registry
from empatheia_jax.models.empatheia import (
    CS_VAES,
    Empatheia,
    EmpatheiaConfig,
)
from empatheia_jax.models.llama import Llama, LlamaConfig, base_shapes_only
from empatheia_jax.models.lora import LoraConfig
from empatheia_jax.models.trainable import groups as all_groups
from empatheia_jax.models.trainable import trainable_filter
from empatheia_jax.train import config as config_lib
from empatheia_jax.train import ema, flat_update, losses, objective, sd_warmup, stages
from empatheia_jax.train.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointError,
    PreemptionWatcher,
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

log = logging.getLogger("empatheia_jax.train.trainer")

# Compiled with flushed denormals on CPU: SiLU of very negative gates feeds denormals into the matmuls
# (see docs/design.md, "CPU speed"); accelerators flush them anyway.
_CPU_COMPILER_OPTIONS = {"xla_cpu_ftz": True}


class NonFiniteLossError(RuntimeError):
    """NaN/inf loss or gradient and the policy says stop (the last good state is checkpointed)."""


@dataclasses.dataclass
class TrainResult:
    status: str  # "completed" | "preempted"
    step: int
    workdir: Path
    metrics: dict[str, float]
    eval_metrics: dict[str, float]
    nonfinite_skipped: int


# ----------------------------------------------------------------------------------------------------------
# Building the model, the optimizer and the data
# ----------------------------------------------------------------------------------------------------------


def initialize_distributed(config: ml_collections.ConfigDict) -> None:
    """`jax.distributed.initialize` when `distributed.initialize` (auto-detection, or the explicit values)."""
    d = config.distributed
    if not d.initialize:
        return
    if d.cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", d.cpu_collectives)
    kwargs: dict[str, Any] = {}
    if d.coordinator_address:
        kwargs = {
            "coordinator_address": d.coordinator_address,
            "num_processes": int(d.num_processes),
            "process_id": int(d.process_id),
        }
    try:
        jax.distributed.initialize(**kwargs)
    except ValueError as e:  # no cluster found and no coordinator given: a config for many hosts on one
        raise config_lib.ConfigError(
            f"config.distributed.initialize=True, but jax.distributed.initialize found no cluster to join "
            f"({e}): on one machine pass --config.distributed.initialize=False, else set "
            "distributed.coordinator_address, num_processes and process_id") from e


def agree_on_length(batch: Mapping[str, np.ndarray], pad_id: int) -> Mapping[str, np.ndarray]:
    """Multi-process: pads this process's batch along the token axis to the longest bucket any process
    picked for this step (each pipeline buckets its own examples, but a global array has one shape; as if
    `collate` had chosen that bucket). A collective: every process calls it for every batch. One process:
    the batch itself."""
    if jax.process_count() == 1:
        return batch
    from jax.experimental import multihost_utils

    length = batch["input_ids"].shape[1]
    target = int(np.max(multihost_utils.process_allgather(np.asarray([length], np.int32))))
    if target == length:
        return batch
    out, extra = dict(batch), target - length
    for k in TOKEN_KEYS:
        fill = pad_id if k in ("input_ids", "target_ids") else 0
        out[k] = np.pad(batch[k], ((0, 0), (0, extra)), constant_values=fill)
    out["positions"][:, length:] = batch["positions"][:, -1:] + np.arange(1, extra + 1, dtype=np.int32)
    return out


def gather_data_state(state: dict) -> dict:
    """The iterator state a checkpoint stores. Multi-process: every process's state, in process order
    (`{"processes": [...]}`), since orbax writes JSON items from process 0 only. A collective."""
    if jax.process_count() == 1:
        return state
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(state).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size], np.int32))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: raw.size] = raw
    every = np.asarray(multihost_utils.process_allgather(buf))
    return {"processes": [json.loads(every[p, : sizes[p]].tobytes()) for p in range(len(sizes))]}


def own_data_state(state: dict) -> dict:
    """This process's iterator state from a checkpoint's (see `gather_data_state`)."""
    if isinstance(state, dict) and "processes" in state:
        states = state["processes"]
        if len(states) != jax.process_count():
            raise ValueError(
                f"the checkpoint holds the data state of {len(states)} processes, this run has "
                f"{jax.process_count()}: resume with the same process count"
            )
        return states[jax.process_index()]
    return state


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


def pipeline_fields(
    config: ml_collections.ConfigDict, stage: stages.Stage, model: Empatheia
) -> dict[str, Any]:
    """`make_dataset` keywords shared by the train and eval pipelines (shapes agree with the model); a
    unit-aligned CS gets the content units of the shards' speech generator."""
    source = target_source(load_manifest(config.data.shards), "speech_content")
    units = registry.units_for(model.config.cs_units, source)
    fields = pipeline_config_fields(
        model.config, stage, {"max_aud": int(config.data.max_aud), "max_vid": int(config.data.max_vid)},
        speech_units=units,
    )
    fields.update(
        # the model's dims: the shards' (checked), or its own on text-only shards under a text template
        feature_dims=(model.config.audio_dim, model.config.video_dim),
        max_len=int(config.data.max_len),
        buckets=config_lib.bucket_lengths(config),
        worker_count=int(config.data.worker_count),
        read_threads=int(config.data.read_threads),
    )
    return fields


def make_train_pipeline(
    config: ml_collections.ConfigDict, stage: stages.Stage, model: Empatheia, tokenizer: Any
) -> InputPipeline:
    return make_dataset(
        config.data.shards,
        config.data.train_split,
        stage.template_stage,
        tokenizer,
        batch_size=config.train.batch_size // jax.process_count(),
        seed=config.seed,
        shuffle=True,
        window_batches=int(config.data.window_batches),
        **pipeline_fields(config, stage, model),
    )


def make_eval_pipeline(
    config: ml_collections.ConfigDict,
    stage: stages.Stage,
    model: Empatheia,
    tokenizer: Any,
    split: str | None = None,
) -> InputPipeline:
    micro = config.train.batch_size // config.train.grad_accum
    return make_dataset(
        config.data.shards,
        split or config.data.eval_split,
        stage.template_stage,
        tokenizer,
        batch_size=max(micro // jax.process_count(), 1),
        seed=config.seed,
        shuffle=False,
        num_epochs=1,
        window_batches=1,
        **pipeline_fields(config, stage, model),
    )


def step_batch(batch: Mapping[str, np.ndarray], mesh: Mesh, grad_accum: int) -> dict[str, jax.Array]:
    """This process's examples -> global arrays `[grad_accum, micro_batch, ...]`, micro-batch axis sharded."""
    local = {k: v.reshape((grad_accum, v.shape[0] // grad_accum) + v.shape[1:]) for k, v in batch.items()}
    return make_global_batch(local, NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"))), batch_axis=1)


# ----------------------------------------------------------------------------------------------------------
# The jitted step and eval
# ----------------------------------------------------------------------------------------------------------


def example_keys(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """One key per example: `fold_in(key, row)` with row the example's index in the flattened step batch."""
    n = math.prod(shape)
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n)).reshape(shape)


CONTENT_KINDS = ("speech_content", "video_content")


def loss_weights(config: ml_collections.ConfigDict) -> losses.LossWeights:
    """The run's `LossWeights`: config.loss's alpha, beta and kl, and with `loss.ccl_scale = "balanced"` the
    content loss's per-dimension weights from the spread of the train split's targets
    (`target_stats.row_variance`, `losses.balanced_dim_weights`); "none" is eq 9's plain sum."""
    loss = dict(config.loss)
    scale = loss.pop("ccl_scale", "none")
    dims = []
    if scale == "balanced":
        for kind in CONTENT_KINDS:
            var = target_stats.row_variance(config.data.shards, config.data.train_split, kind)
            if var is not None:
                dims.append((kind, tuple(float(w) for w in losses.balanced_dim_weights(var))))
    return losses.LossWeights(**loss, ccl_dims=tuple(dims))


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


def make_step(stage: stages.Stage, weights: losses.LossWeights) -> stages.TrainStep:
    """`step(graphs, params, frozen, opt_state, batch [A, m, ...], key) -> (params, opt_state, metrics)`.

    Micro-batch losses are normalised by the counts of the whole step, so the summed gradients (and the
    summed metrics) are those of one batch of A*m examples. The update is skipped in-program (params and
    optimizer state returned unchanged) when the loss or gradient norm is not finite; `nonfinite` reports it.
    """
    loss_fn = objective.make_loss_fn(stage, weights)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(graphs: stages.StepGraphs, params, frozen, opt_state, batch, key):
        accum, micro = batch["input_ids"].shape[:2]
        flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)
        counts = objective.loss_counts(nnx.merge(graphs.model, params, frozen).config, flat)
        keys = example_keys(key, (accum, micro))

        def micro_step(acc, xs):
            # One barrier over the weights AND this micro-batch: its outputs depend on the loop, so XLA
            # cannot treat the weights as loop-invariant; otherwise its loop-invariant code motion hoists
            # every layer's FSDP all-gather (and dtype cast) out of the micro-batch loop and keeps all of
            # them alive for the whole step (docs/design.md, "Hoisted weight gathers").
            p, f, (mb, k) = jax.lax.optimization_barrier((params, frozen, xs))
            (_, metrics), grads = grad_fn(p, graphs.model, f, mb, k, counts=counts)
            return jax.tree.map(jnp.add, acc, grads), metrics

        # The gradients are summed in the carry (they have the parameters' structure, so their zeros need no
        # trace); the metrics come out per micro-batch and are summed after, in order, to the same values:
        # starting the carry from their zeros instead would trace the whole forward and backward once more
        # only for their shapes (the tiny overall step's trace: 6.0 s with it, 4.8 s without).
        grads, per_micro = jax.lax.scan(micro_step, jax.tree.map(jnp.zeros_like, params), (batch, keys))
        metrics = jax.tree.map(lambda m: functools.reduce(jnp.add, list(m)), per_micro)

        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(metrics["total"]) & jnp.isfinite(grad_norm)
        new_params, new_opt_state = stages.apply_update(graphs, params, frozen, opt_state, grads)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
        metrics = dict(metrics, grad_norm=grad_norm, nonfinite=(~ok).astype(jnp.float32))
        return keep(new_params, params), keep(new_opt_state, opt_state), metrics

    return step


def jit_step(
    stage: stages.Stage,
    weights: losses.LossWeights,
    params: nnx.State,
    opt_state: nnx.State,
    *,
    compiler_options: Mapping[str, Any] | None = None,
) -> stages.TrainStep:
    """`make_step` under jit: graphs static, params/opt_state donated and kept on their shardings."""
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    options = dict(_CPU_COMPILER_OPTIONS) if jax.default_backend() == "cpu" else {}
    options = {**options, **(compiler_options or {})} or None
    return jax.jit(
        make_step(stage, weights),
        static_argnums=0,
        donate_argnums=(1, 3),
        out_shardings=(shardings(params), shardings(opt_state), None),
        compiler_options=options,
    )


def make_eval_step(stage: stages.Stage, weights: losses.LossWeights):
    """`eval_step(graphdef, params, frozen, batch, counts) -> metrics` (deterministic: z = mu)."""

    @jax.jit
    def counts_of(graphdef, params, frozen, batch):
        return objective.loss_counts(nnx.merge(graphdef, params, frozen).config, batch)

    def eval_step(graphdef, params, frozen, batch, counts):
        model = nnx.merge(graphdef, params, frozen)
        outputs = objective.forward(model, batch, stage, train=False)
        return objective.stage_loss(model, batch, outputs, stage, weights, counts=counts)[1]

    return counts_of, jax.jit(eval_step, static_argnums=0)


def eval_batches(
    config: ml_collections.ConfigDict,
    stage: stages.Stage,
    model: Empatheia,
    tokenizer: Any,
    mesh: Mesh,
    *,
    split: str | None = None,
    max_batches: int = 0,
) -> Iterator[dict[str, jax.Array]]:
    """One unshuffled pass over a split as global model batches (0 = every batch). Multi-process: a
    collective per batch (`agree_on_length`)."""
    pipe = make_eval_pipeline(config, stage, model, tokenizer, split)
    for i, b in enumerate(pipe):
        if max_batches and i >= max_batches:
            break
        b = agree_on_length(b, pipe.pad_id)
        yield make_global_batch(b, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))


def prepare_sd(
    config: ml_collections.ConfigDict,
    stage: stages.Stage,
    model: Empatheia,
    tokenizer: Any,
    mesh: Mesh,
    schedule: config_lib.Schedule,
    *,
    writer: MetricsWriter | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> bool:
    """Before a stage that trains the SD takes its first step (a fresh workdir; never on resume).

    1. Caches the SD inputs and targets of `train.calibration_batches` unshuffled train batches under this
       stage's template, from one frozen forward each (`collect_sd_inputs`).
    2. Standardises the SD inputs from them (`calibrate_sd_inputs`). This happens at every stage that trains
       the SD, not once: each stage's template moves the common mode of the signal states, and the SD reads
       them relative to it (re-estimating normalisation statistics on the new input distribution, as
       AdaBN does; docs/design.md, "SD input standardisation").
    3. Trains the SD alone on the cache for `schedule.<stage>.sd_warmup_steps` (`warmup_sd`).

    Returns False when a preemption was requested during the warm-up (nothing is saved: a restart redoes
    all of this deterministically). A no-op returning True when the stage does not train the SD.
    """
    if "sd" not in stage.trainable_groups or not model.config.has_sd:
        return True
    batches = eval_batches(config, stage, model, tokenizer, mesh, split=config.data.train_split,
                           max_batches=int(config.train.calibration_batches))
    with jax.set_mesh(mesh):
        inputs = sd_warmup.collect_sd_inputs(model, batches)
        n = sd_warmup.calibrate_sd_inputs(model, inputs)
    sharding.shard_model(model.style_dis, mesh)
    log.info("SD inputs standardised from %d train examples (%s template)", n, stage.template_stage)
    done = not schedule.sd_warmup_steps or warmup_sd(config, stage, model, inputs, schedule, mesh,
                                                     writer=writer, stop_requested=stop_requested)
    # The forward and warm-up programs are not used again: free them before the train step compiles, so
    # the two never sit in memory together (peak RSS of the demo's sac stage).
    del inputs
    jax.clear_caches()
    return done


def warmup_sd(
    config: ml_collections.ConfigDict,
    stage: stages.Stage,
    model: Empatheia,
    inputs: Mapping[str, jax.Array],
    schedule: config_lib.Schedule,
    mesh: Mesh,
    *,
    writer: MetricsWriter | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> bool:
    """Trains the SD alone on cached inputs (`collect_sd_inputs`) before the stage's joint steps.

    Why: the SD needs a few hundred steps before its classifiers move (design.md "SD input standardisation"),
    and a stage step also runs the LLM forward and, for the projections and signal rows, its backward. On
    cached signal states an SD step costs a small fraction of that. This is the head warm-up of
    linear-probe-then-fine-tune (Kumar et al. 2022): the stage's joint steps then start from a trained head
    instead of a random one. Objective: `sd_head_loss` (the stage's L_sal + L_cls + kl·KL_sd). Optimizer:
    `make_tx` over `sd_warmup_steps` at `sd_warmup_lr`, its own state (the stage's optimizer starts fresh).
    Batches: `train.sd_warmup_batch_size` examples drawn without replacement, epoch by epoch, from a
    permutation seeded by `seed`; latent noise from per-example keys. Deterministic; a non-finite update is
    skipped and counted. Returns False if a preemption was requested (polled every `log_every` steps).
    """
    steps = int(schedule.sd_warmup_steps)
    n = int(inputs["r_s"].shape[0])
    size = min(int(config.train.sd_warmup_batch_size), n)
    step_fn, params, opt_state, lr_schedule = _sd_warmup_program(config, stage, model, inputs, schedule, mesh)
    rng = np.random.default_rng([config.seed, 0x5D])
    perm, cursor = rng.permutation(n), 0
    key = jax.random.fold_in(jax.random.key(config.seed), 0x5D)
    window: dict[str, float] = {}
    skipped = 0
    completed = True
    from tqdm import tqdm

    lead = jax.process_index() == 0
    with jax.set_mesh(mesh):
        for i in tqdm(range(steps), desc=f"SD warm-up ({stage.name})", unit="step", disable=not lead):
            if cursor + size > n:
                perm, cursor = rng.permutation(n), 0
            idx = jnp.asarray(perm[cursor:cursor + size], jnp.int32)
            cursor += size
            params, opt_state, metrics = step_fn(params, opt_state, idx, jax.random.fold_in(key, i))
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            skipped += int(metrics.pop("nonfinite"))
            for k, v in metrics.items():
                window[k] = window.get(k, 0.0) + v
            if (i + 1) % config.train.log_every == 0 or i + 1 == steps:
                n_win = (i % config.train.log_every) + 1
                out = {f"sd_warmup/{k}": v / n_win for k, v in window.items()}
                out["sd_warmup/lr"] = float(lr_schedule(i))
                out["sd_warmup/nonfinite_skipped"] = skipped
                if writer is not None:
                    writer.write(i + 1, out)
                window = {}
                if stop_requested():
                    completed = i + 1 == steps
                    break
    nnx.update(model.style_dis, params)
    if skipped:
        log.warning("SD warm-up: %d of %d updates skipped (non-finite loss or gradient)", skipped, steps)
    return completed


def _sd_warmup_program(
    config: ml_collections.ConfigDict,
    stage: stages.Stage,
    model: Empatheia,
    inputs: Mapping[str, jax.Array],
    schedule: config_lib.Schedule,
    mesh: Mesh,
) -> tuple[Callable, nnx.State, Any, optax.Schedule]:
    """(step, SD params, optimizer state, lr schedule) of `warmup_sd`.

    The warm-up gets an optimizer of its own (`make_tx` over its steps at its lr) so the stage's optimizer
    starts fresh after it. Like the stage step, it leaves params and optimizer state untouched when the loss
    or gradient norm is not finite (and reports `nonfinite`), so one bad batch cannot wreck the warm-up.
    """
    steps = int(schedule.sd_warmup_steps)
    weights = loss_weights(config)
    warm = config_lib.Schedule(steps=steps, lr=schedule.sd_warmup_lr,
                               warmup_steps=min(schedule.warmup_steps, steps))
    graphdef, params, rest = nnx.split(model.style_dis, nnx.Param, ...)
    tx, lr_schedule = make_tx(config, warm, params)
    with jax.set_mesh(mesh):
        opt_state = tx.init(params)

    def step(params, opt_state, idx, key):
        batch = jax.tree.map(lambda x: x[idx], inputs)

        def loss_fn(p):
            sd = nnx.merge(graphdef, p, rest)
            return objective.sd_head_loss(sd, batch, stage, weights, rng=example_keys(key, idx.shape))

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(metrics["total"]) & jnp.isfinite(grad_norm)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        return keep(new_params, params), keep(new_opt_state, opt_state), {
            **metrics, "grad_norm": grad_norm, "nonfinite": (~ok).astype(jnp.float32)}

    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    step_fn = jax.jit(step, donate_argnums=(0, 1), out_shardings=(shardings(params), None, None))
    return step_fn, params, opt_state, lr_schedule


def evaluate_loss(
    config: ml_collections.ConfigDict,
    stage: stages.Stage,
    model: Empatheia,
    tokenizer: Any,
    mesh: Mesh,
    *,
    split: str | None = None,
    max_batches: int = 0,
) -> dict[str, float]:
    """Teacher-forced loss terms of `stage` over an eval split, normalised over the whole split.

    Two passes over the (small) split: the counts first, so every batch's sums share one denominator and
    the result is the split's exact mean, not a mean of batch means.
    """
    weights = loss_weights(config)
    graphdef, params, frozen = nnx.split(model, trainable_filter(stage.trainable_groups), ...)
    counts_of, eval_step = make_eval_step(stage, weights)

    def batches() -> Iterator[dict[str, jax.Array]]:
        return eval_batches(config, stage, model, tokenizer, mesh, split=split, max_batches=max_batches)

    total = None
    for b in batches():
        c = counts_of(graphdef, params, frozen, b)
        total = c if total is None else jax.tree.map(jnp.add, total, c)
    if total is None:
        return {}
    sums = None
    for b in batches():
        m = eval_step(graphdef, params, frozen, b, total)
        sums = m if sums is None else jax.tree.map(jnp.add, sums, m)
    return {k: float(v) for k, v in jax.device_get(sums).items()}


# ----------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------

# Dense bf16 peak FLOP/s per chip, for MFU on accelerators (CPU runs report no MFU).
_PEAK_FLOPS = {
    "h100": 989e12,
    "h200": 989e12,
    "a100": 312e12,
    "v4": 275e12,
    "v5e": 197e12,
    "v5 lite": 197e12,
    "v5p": 459e12,
    "v6": 918e12,
}


def flops_per_token(model: Empatheia, seq_len: int, n_trainable: int) -> float:
    """Training FLOPs per token: 4N (forward + input gradients through the frozen backbone: LoRA training
    computes no frozen weight gradients) + 2 N_trainable (weight gradients) + 12 L T H d_head (attention
    scores and mixing, forward and backward; causal masking not discounted). N excludes the embedding."""
    cfg = model.config.llm
    params = nnx.state(model.llm, nnx.Param)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    n -= (cfg.vocab_size + cfg.extra_vocab) * cfg.hidden_size  # embedding lookup is not a matmul
    if cfg.tie_word_embeddings:
        n += (cfg.vocab_size + cfg.extra_vocab) * cfg.hidden_size  # ... but the tied lm_head is
    attn = 12 * cfg.num_hidden_layers * seq_len * cfg.num_attention_heads * cfg.head_dim
    return 4.0 * n + 2.0 * n_trainable + attn


def peak_flops() -> float | None:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None
    kind = dev.device_kind.lower()
    return next((v for k, v in _PEAK_FLOPS.items() if k in kind), None)


def _summary_writer_class() -> type:
    """tensorboardX's SummaryWriter, imported without importing torch when nothing has yet.

    tensorboardX's writer module imports torch only to accept torch tensors as values (`numpy_compatible`),
    and falls back to numpy when the import fails; we log floats. Importing torch is ~1.9 s of every
    training command (its largest import). A None in sys.modules makes that one `import torch` fail; it is
    removed again at once, so a later import of torch (an encoder, a converter) works as usual.
    """
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """TensorBoard + metrics.jsonl on process 0 (other processes write nothing)."""

    def __init__(self, workdir: Path, enabled: bool):
        self.enabled = enabled
        if enabled:
            self.tb = _summary_writer_class()(str(workdir / "tensorboard"))
            self.jsonl = (workdir / "metrics.jsonl").open("a")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        for k, v in metrics.items():
            self.tb.add_scalar(k, v, step)
        self.jsonl.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if self.enabled:
            self.tb.close()
            self.jsonl.close()


# ----------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------


def _check_same(what: str, saved: Any, current: Any, where: Path) -> None:
    if saved != current:
        keys = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        raise ValueError(
            f"{where} holds a checkpoint of a different {what} (differs in {keys}); "
            "use a new workdir per stage and the same model config for every stage"
        )


def _function_of(model_config: Mapping[str, Any] | EmpatheiaConfig) -> dict[str, Any]:
    """What a checkpoint's model must agree on with the run's: its config with the defaults of fields added
    since it was saved, less the fields that say how a step is computed (`EmpatheiaConfig.function_dict`)."""
    if isinstance(model_config, Mapping):  # (a reloaded module makes another EmpatheiaConfig class)
        model_config = EmpatheiaConfig.from_dict(model_config)
    return model_config.function_dict()


def train(config: ml_collections.ConfigDict, workdir: str | Path) -> TrainResult:
    """Trains `config.stage` in `workdir` (resuming from its latest checkpoint when there is one).

    Read top to bottom, one helper per phase: build, restore, prepare the SD, loop, final evaluation.
    """
    run = _build_run(config, Path(workdir))
    start, nonfinite_skipped, resuming = _restore(run)
    writer = MetricsWriter(run.workdir, run.lead)
    watcher = PreemptionWatcher()  # from here on, so that a SIGTERM during the SD warm-up is clean too
    if not _prepare(run, resuming, writer, watcher):
        return TrainResult("preempted", 0, run.workdir, {}, {}, 0)

    p = _start_steps(run, start, nonfinite_skipped)
    trace = (run.workdir / "data_trace.jsonl").open("a") if config.train.trace_data and run.lead else None
    from tqdm import tqdm

    bar = tqdm(total=run.schedule.steps, initial=start, disable=not run.lead, desc=f"train {run.stage.name}",
               unit="step")
    window = _Window(start=time.perf_counter())
    with watcher:
        try:
            _loop(run, p, window, writer, watcher, bar, trace)
            eval_metrics = _final_eval(run, p, writer)
            run.ckpt.wait_until_finished()
        finally:
            bar.close()
            writer.close()
            if trace is not None:
                trace.close()
            run.ckpt.close()
    stages.merge_after_step(run.model, run.optimizer, p.params, p.opt_state)
    return TrainResult(p.status, p.done, run.workdir, p.last_metrics, eval_metrics, p.nonfinite_skipped)


@dataclasses.dataclass
class _Run:
    """What a run builds before its first step: one object the steps of `train` share, so that each step's
    helper takes the run instead of a dozen arguments."""

    config: ml_collections.ConfigDict
    stage: stages.Stage
    schedule: config_lib.Schedule
    workdir: Path
    lead: bool  # process 0: the one that writes config.json, metrics and the data trace
    mesh: Mesh
    model: Empatheia
    tokenizer: Any
    optimizer: nnx.Optimizer
    lr_schedule: optax.Schedule
    include_backbone: bool  # a random backbone is saved with the run; a converted one is re-read
    meta: dict[str, Any]
    ckpt: TrainCheckpointer
    pipeline: InputPipeline
    data_iter: Any


@dataclasses.dataclass
class _Progress:
    """The loop's state. The step's arrays live here, not in the model, between steps (the step donates
    them); `_save` and the evaluations merge them back first."""

    graphs: stages.StepGraphs
    params: nnx.State
    frozen: nnx.State
    opt_state: nnx.State
    step_fn: stages.TrainStep
    key: jax.Array
    n_trainable: int
    peak: float | None
    start: int
    done: int
    nonfinite_skipped: int
    consecutive_bad: int = 0
    status: str = "completed"
    last_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # the step batch shapes run so far: a new one (a bucket length not seen yet) compiles the step again
    shapes: set[tuple[int, ...]] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Window:
    """Metrics summed since the last log line, and the throughput sample (steps, tokens, since when, less
    the seconds of the steps that compiled: `excluded`)."""

    start: float
    sums: dict[str, float] = dataclasses.field(default_factory=dict)
    steps: int = 0
    tokens: int = 0
    excluded: float = 0.0

    def reset(self) -> None:
        self.sums, self.steps, self.tokens, self.start = {}, 0, 0, time.perf_counter()
        self.excluded = 0.0


def check_packing(config: ml_collections.ConfigDict, stage: stages.Stage) -> None:
    """data.pack_len > 0 packs text rows, whose batches keep only the token keys: a stage whose losses
    read a head (cs, sd: per-example targets and labels) cannot be packed, nor can several processes
    (their row counts would differ)."""
    if not config.data.get("pack_len", 0):
        return
    if stage.heads:
        raise config_lib.ConfigError(
            f"data.pack_len={config.data.pack_len}: stage {stage.name!r} reads per-example targets "
            f"(heads {sorted(stage.heads)}); packing is for the text stages (coe, pipeline)")
    if jax.process_count() > 1:
        raise config_lib.ConfigError(f"data.pack_len={config.data.pack_len}: packing runs on one process")


def pack_for_step(config: ml_collections.ConfigDict, batch: Mapping[str, np.ndarray], pad_id: int,
                  mesh: Mesh) -> Mapping[str, np.ndarray]:
    """The step batch packed into rows of data.pack_len (a multiple of grad_accum x the data-parallel
    devices, so `step_batch` splits it); unchanged when pack_len is 0."""
    if not config.data.get("pack_len", 0):
        return batch
    multiple = int(config.train.grad_accum) * int(mesh.shape["data"] * mesh.shape["fsdp"])
    return pack_text_batch(batch, int(config.data.pack_len), pad_id=pad_id, row_multiple=multiple)


def _build_run(config: ml_collections.ConfigDict, workdir: Path) -> _Run:
    """Everything that can fail on a bad config or missing data fails here, before a step is compiled."""
    initialize_distributed(config)
    config_lib.validate(config)
    if config_lib.set_matmul_precision(config) == "bfloat16" and config_lib.cpu_lacks_bf16_dots():
        log.warning("model.matmul_precision=bfloat16 on a CPU without AVX512-BF16 or AMX: its bf16 dots are "
                    "slower than float32 ones here; --config.model.matmul_precision=float32 trains faster on "
                    "this machine (docs/benchmarks.md \"The trainer on a CPU without BF16\")")
    stage = config_lib.resolve_stage(config)
    check_packing(config, stage)
    schedule = config_lib.stage_schedule(config)
    manifest = model_manifest(config)
    check_splits(config, manifest)
    check_unused_dims(config)
    lead = jax.process_index() == 0
    if lead:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(json.dumps(config_lib.to_json(config), indent=1))

    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    model, tokenizer = build_model(config, manifest, mesh)
    tx, lr_schedule = make_tx(config, schedule, stages.trainable_state(model, stage))
    with jax.set_mesh(mesh):
        optimizer = stages.make_optimizer(model, stage, tx)
    meta = _checkpoint_meta(config, stage, model, manifest)
    ckpt = TrainCheckpointer(
        workdir / CHECKPOINT_DIR,
        keep=config.checkpoint.keep,
        keep_best=config.checkpoint.keep_best,
        best_metric=config.checkpoint.best_metric,
        best_mode=config.checkpoint.best_mode,
        async_save=config.checkpoint.async_save,
    )
    pipeline = make_train_pipeline(config, stage, model, tokenizer)
    return _Run(
        config=config, stage=stage, schedule=schedule, workdir=workdir, lead=lead, mesh=mesh, model=model,
        tokenizer=tokenizer, optimizer=optimizer, lr_schedule=lr_schedule,
        include_backbone=not config.model.backbone, meta=meta, ckpt=ckpt, pipeline=pipeline,
        data_iter=iter(pipeline),
    )


def _checkpoint_meta(
    config: ml_collections.ConfigDict, stage: stages.Stage, model: Empatheia, manifest: Mapping[str, Any]
) -> dict[str, Any]:
    """What eval, chat and export need to rebuild the model from a checkpoint alone, and what a resume
    checks it agrees with."""
    return {
        "stage": stage.to_dict(),
        "config": config_lib.to_json(config),
        "model_config": model.config.to_dict(),
        # absolute, so that eval/chat/export find it from any directory (the config keeps what was given)
        "backbone": str(Path(config.model.backbone).resolve()) if config.model.backbone else "",
        "include_backbone": not config.model.backbone,
        "encoder": manifest.get("encoder"),
        # {kind: {source, dim, ...}} of the shards' generator targets: the bridge to a generator needs the
        # source (Kokoro features drive Kokoro; stand-ins drive nothing).
        "targets": (manifest.get("targets") or {}).get("kinds", {}),
        # the checkpoints' `ema` item holds the weights to use (optim.ema_decay > 0): serve/load.py, init_from
        "ema": config.optim.get("ema_decay", 0.0) > 0,
    }


def _restore(run: _Run) -> tuple[int, int, bool]:
    """(first step, non-finite steps skipped so far, resuming). A workdir's own checkpoint wins over
    `init_from`: a preempted run must go on from where it stopped, not start over from the previous
    stage."""
    config, model, workdir = run.config, run.model, run.workdir
    if run.ckpt.latest_step() is not None:
        restored = run.ckpt.restore(params=saved_state(model, run.include_backbone),
                                    opt_state=nnx.state(run.optimizer))
        _check_same("stage", restored.meta["stage"], run.meta["stage"], workdir)
        _check_same("model", _function_of(restored.meta["model_config"]), _function_of(model.config), workdir)
        nnx.update(model, restored.params)
        nnx.update(run.optimizer, restored.opt_state)
        run.data_iter.set_state(own_data_state(restored.data_state))
        start, nonfinite_skipped = restored.step, int(restored.meta.get("nonfinite_skipped", 0))
        # A resume must be told apart from a restart (both end bit-identical): say where it starts.
        log.info("resuming from step %d (workdir %s)", start, workdir)
        return start, nonfinite_skipped, True
    if config.init_from:
        _init_from(run)
    return 0, 0, False


# The fields of the Content Synchronizer's design. A stage that trains the CS may start from a run whose CS
# was built otherwise (e.g. the coe stage of a run before `cs_units`): the CS heads that differ start fresh.
CS_DESIGN_FIELDS = frozenset({"cs_units", "cv_units", "cs_conv", "cs_unit_context", "cs_context_width",
                              "cs_context_skip", "cv_dims", *CS_VAES})


def _init_from(run: _Run) -> None:
    """Every saved parameter from `init_from` (a training checkpoint, or a PEFT export such as the committed
    reference model), whose model must be the run's, except that a stage training the CS ("cs" group)
    accepts a source differing only in `CS_DESIGN_FIELDS`: the CS blocks whose config differs keep their
    fresh init (said in the log) and everything else is the source's. That is exact for a source stage that
    never trained those blocks (coe), and a warm start otherwise."""
    config, model = run.config, run.model
    from_export = is_export(config.init_from)
    if from_export:
        where, step, source_config, source_params = _export_params(Path(config.init_from), run)
    else:
        src_dir, step = resolve_checkpoint(checkpoints_of(config.init_from))
        source_meta = read_meta(src_dir, step)[1]
        where, source_config = src_dir, source_meta["model_config"]
    source, current = _function_of(source_config), _function_of(model.config)
    differ = {k for k in set(source) | set(current) if source.get(k) != current.get(k)}
    if differ and ("cs" not in run.stage.trainable_groups or not differ <= CS_DESIGN_FIELDS):
        _check_same("model", source, current, Path(config.init_from))  # raises, naming the fields
    if not from_export:
        # the source's own (abstract) model is the restore target when its CS blocks have other shapes
        target = model if not differ else nnx.eval_shape(
            lambda: Empatheia(EmpatheiaConfig.from_dict(source_config), rngs=nnx.Rngs(0)))
        with TrainCheckpointer(where, create=False, async_save=False) as src:
            source_params = src.restore(step, params=saved_state(target, run.include_backbone),
                                        item=weights_item(source_meta)).params
        if not differ:
            nnx.update(model, source_params)
            log.info("initialised from %s step %d", where, step)
            return
    fresh = [name for name in CS_VAES if source[name] != current[name]]
    prefixes = [("content_sync", name.removeprefix("cs_")) for name in fresh]
    stored = {tuple(map(str, p)): v for p, v in nnx.to_flat_state(source_params)}
    kept = {}
    for path, var in nnx.to_flat_state(saved_state(model, run.include_backbone)):
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


def _export_params(path: Path, run: _Run) -> tuple[Path, int, dict[str, Any], nnx.State]:
    """(where, step, model config, the trained parameters) of a PEFT export, for `_init_from`: the export's
    model is built on the host with the files' LoRA and heads (its random backbone is never used: a stage
    that starts from an export keeps its backbone frozen). A merged export has the LoRA folded into the
    kernels and cannot be split back, so it is refused, as is a run that trains the backbone."""
    meta = read_export_meta(path)
    if meta["mode"] != "peft":
        raise CheckpointError(f"--init_from {path}: a {meta['mode']} export has the LoRA merged into the "
                              "backbone; export with --mode peft to start a stage from it")
    if run.include_backbone:
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


def _prepare(run: _Run, resuming: bool, writer: MetricsWriter, watcher: PreemptionWatcher) -> bool:
    """`prepare_sd` on a fresh workdir (a resumed run restored its calibrated SD). False when a preemption
    came during it: the run then ends before step 0, with nothing to save (a restart redoes it all). On
    that path and on an exception, the writer, the checkpointer and the signal handlers are released here,
    since the loop that would release them never starts."""
    try:
        prepared = resuming or prepare_sd(run.config, run.stage, run.model, run.tokenizer, run.mesh,
                                          run.schedule, writer=writer,
                                          stop_requested=lambda: watcher.requested(None))
    except BaseException:
        watcher.restore_handlers()
        writer.close()
        run.ckpt.close()
        raise
    if not prepared:
        watcher.restore_handlers()
        writer.close()
        run.ckpt.close()
        log.warning("preemption requested during the SD warm-up: exiting before step 0, nothing to save")
    return prepared


def _start_steps(run: _Run, start: int, nonfinite_skipped: int) -> _Progress:
    """Splits the model into the arrays the jitted step takes, and builds that step (compiled at its first
    call). Only now: the restore and the SD preparation both change the model."""
    weights = loss_weights(run.config)
    graphs, params, frozen, opt_state = stages.split_for_step(run.model, run.optimizer, run.stage)
    step_fn = jit_step(run.stage, weights, params, opt_state)
    n_trainable = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    peak = peak_flops()
    return _Progress(
        graphs=graphs, params=params, frozen=frozen, opt_state=opt_state, step_fn=step_fn,
        key=jax.random.key(run.config.seed), n_trainable=n_trainable, peak=peak, start=start, done=start,
        nonfinite_skipped=nonfinite_skipped,
    )


def _loop(
    run: _Run, p: _Progress, window: _Window, writer: MetricsWriter, watcher: PreemptionWatcher, bar: Any,
    trace: Any,
) -> None:
    """The steps from `p.start` to the schedule's end, or to a preemption (`p.status`)."""
    for step in range(p.start, run.schedule.steps):
        host_batch, metrics = _run_step(run, p, window, step, trace)
        _apply_nan_policy(run, p, step, host_batch, metrics)
        for k, v in metrics.items():
            window.sums[k] = window.sums.get(k, 0.0) + v
        p.last_metrics = metrics
        p.done = step + 1
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['total']:.4f}")
        _log_window(run, p, window, writer, host_batch)
        if _eval_save_or_stop(run, p, writer, watcher):
            break


def _run_step(
    run: _Run, p: _Progress, window: _Window, step: int, trace: Any
) -> tuple[Mapping[str, np.ndarray], dict[str, float]]:
    """(host batch, metrics) of one step. The step key is `fold_in(seed, step)`, so a resumed run draws
    the same noise as an uninterrupted one."""
    profile = tuple(run.config.train.profile_steps)
    if profile and step == profile[0]:
        jax.profiler.start_trace(str(run.workdir / "profile"))
    host_batch = agree_on_length(next(run.data_iter), run.pipeline.pad_id)
    if trace is not None:
        trace.write(json.dumps({"step": step, "record_index": host_batch["record_index"].tolist()}) + "\n")
        trace.flush()
    host_batch = pack_for_step(run.config, host_batch, run.pipeline.pad_id, run.mesh)
    batch = step_batch(host_batch, run.mesh, run.config.train.grad_accum)
    shape = tuple(host_batch["input_ids"].shape)
    new_shape = shape not in p.shapes
    p.shapes.add(shape)
    t0 = time.perf_counter()
    with jax.set_mesh(run.mesh):  # traced for the mesh: activations keep the batch layout
        p.params, p.opt_state, metrics = p.step_fn(
            p.graphs, p.params, p.frozen, p.opt_state, batch, jax.random.fold_in(p.key, step)
        )
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if profile and step + 1 == profile[1]:
        jax.profiler.stop_trace()
    if new_shape:
        # the run's first step, and a batch length first seen later (data.bucket_step's buckets), compiled
        # the step or read it from the persistent cache: compile time, not a throughput sample
        metrics["compile_s"] = time.perf_counter() - t0
        if step == p.start:
            window.start = time.perf_counter()  # nor is the time before the first step
        else:
            window.excluded += metrics["compile_s"]
    else:
        window.steps += 1
        window.tokens += int(host_batch["attention_mask"].sum()) * jax.process_count()
    return host_batch, metrics


def _apply_nan_policy(
    run: _Run, p: _Progress, step: int, host_batch: Mapping[str, np.ndarray], metrics: Mapping[str, float]
) -> None:
    """The program already skipped a non-finite update; the host decides whether the run goes on. A stop
    checkpoints first, so the last good state survives the error."""
    if not metrics["nonfinite"]:
        p.consecutive_bad = 0
        return
    config = run.config
    p.consecutive_bad += 1
    p.nonfinite_skipped += 1
    where = f"step {step} (records {host_batch['record_index'].tolist()})"
    if config.train.nan_policy == "stop" or p.consecutive_bad >= config.train.max_consecutive_nonfinite:
        _save(run, p, step + 1, force=True)
        run.ckpt.wait_until_finished()
        raise NonFiniteLossError(
            f"non-finite loss/gradient at {where}: loss={metrics['total']}, "
            f"grad_norm={metrics['grad_norm']}; the update was not applied and the last good "
            f"state is checkpointed at step {step + 1} in {run.ckpt.directory}"
        )
    log.warning("non-finite loss at %s: update skipped (%d so far)", where, p.nonfinite_skipped)


def _log_window(
    run: _Run, p: _Progress, window: _Window, writer: MetricsWriter, host_batch: Mapping[str, np.ndarray]
) -> None:
    """Every `log_every` steps and at the end: the window's mean metrics, lr and throughput (MFU where the
    chip's peak is known)."""
    done, log_every = p.done, run.config.train.log_every
    if not (done % log_every == 0 or done == run.schedule.steps):
        return
    n = max(done - max(p.start, done - log_every), 1)
    out = {f"train/{k}": v / n for k, v in window.sums.items() if k not in ("compile_s", "nonfinite")}
    out["train/nonfinite_skipped"] = p.nonfinite_skipped
    out["train/lr"] = float(run.lr_schedule(done - 1))
    if "compile_s" in window.sums:
        out["perf/compile_s"] = window.sums["compile_s"]
    if window.steps:
        dt = time.perf_counter() - window.start - window.excluded
        out["perf/step_time_s"] = dt / window.steps
        out["perf/tokens_per_s"] = window.tokens / dt
        if p.peak and run.stage.reads_llm:  # the FLOPs counted are the backbone's
            seq = host_batch["input_ids"].shape[1]
            achieved = out["perf/tokens_per_s"] * flops_per_token(run.model, seq, p.n_trainable)
            out["perf/mfu"] = achieved / (p.peak * jax.device_count())
    writer.write(done, out)
    window.reset()


def _eval_save_or_stop(run: _Run, p: _Progress, writer: MetricsWriter, watcher: PreemptionWatcher) -> bool:
    """After a step: the periodic evaluation and checkpoint, then the preemption poll (every step, as a
    collective must be). True when the run must stop, its step saved."""
    config, done = run.config, p.done
    eval_now = config.train.eval_every and done % config.train.eval_every == 0 and done < run.schedule.steps
    eval_metrics = None
    if eval_now:
        eval_metrics = _evaluate(run, p)
        writer.write(done, eval_metrics)
    if done % config.checkpoint.every == 0 and done < run.schedule.steps:
        _save(run, p, done, eval_metrics)
    if watcher.requested(done):
        _save(run, p, done, force=True)
        p.status = "preempted"
        log.warning("preemption requested: checkpointed step %d in %s, exiting", done, run.ckpt.directory)
        return True
    return False


def _final_eval(run: _Run, p: _Progress, writer: MetricsWriter) -> dict[str, float]:
    """The completed run's evaluation, saved with its last step ({} when preempted)."""
    steps = run.schedule.steps
    eval_metrics: dict[str, float] = {}
    # Run again once complete (a launcher re-runs every stage), a stage trains nothing and reports the final
    # evaluation saved with its last step instead of evaluating the same weights again.
    recorded = run.ckpt.saved_metrics(p.start) if p.start == steps else {}
    recorded = {k: v for k, v in recorded.items() if k.startswith("eval/")}
    if p.status == "completed" and recorded:
        eval_metrics = recorded
        log.info("already complete at step %d: its final evaluation is the one saved then", p.start)
    elif p.status == "completed":
        eval_metrics = _evaluate(run, p)
        writer.write(steps, eval_metrics)
        if run.ckpt.latest_step() != steps:
            _save(run, p, steps, eval_metrics or None, force=True)
    return eval_metrics


def _evaluate(run: _Run, p: _Progress) -> dict[str, float]:
    """`evaluate_loss` of the weights the run publishes: the current ones (merged back from the step's
    arrays first), or their EMA when the run keeps one (swapped in for the evaluation, then back)."""
    stages.merge_after_step(run.model, run.optimizer, p.params, p.opt_state)
    config = run.config
    live = None
    if run.meta["ema"]:
        live = nnx.state(run.model)
        nnx.update(run.model, ema.averaged(nnx.state(run.model), run.optimizer))
    try:
        metrics = evaluate_loss(config, run.stage, run.model, run.tokenizer, run.mesh,
                                max_batches=config.train.eval_batches)
    finally:
        if live is not None:
            nnx.update(run.model, live)
    return {f"eval/{k}": v for k, v in metrics.items()}


def _save(run: _Run, p: _Progress, step: int, metrics: Mapping[str, float] | None = None,
          force: bool = False) -> None:
    """Checkpoints the current state, the data iterator's position with it (what a bit-identical resume
    needs)."""
    stages.merge_after_step(run.model, run.optimizer, p.params, p.opt_state)
    params = saved_state(run.model, run.include_backbone)
    # save() returns once orbax holds host copies, so the next (donating) step cannot corrupt it.
    run.ckpt.save(
        step,
        params=params,
        ema=ema.averaged(params, run.optimizer) if run.meta["ema"] else None,
        opt_state=nnx.state(run.optimizer),
        data_state=gather_data_state(run.data_iter.get_state()),
        meta={**run.meta, "nonfinite_skipped": p.nonfinite_skipped},
        metrics=metrics,
        force=force,
    )


# ----------------------------------------------------------------------------------------------------------
# Loading a trained model (eval, chat)
# ----------------------------------------------------------------------------------------------------------


__all__ = [
    "NonFiniteLossError",
    "TrainResult",
    "build_model",
    "evaluate_loss",
    "jit_step",
    "make_step",
    "make_tx",
    "saved_state",
    "step_batch",
    "train",
]
