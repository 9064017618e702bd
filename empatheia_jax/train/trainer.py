"""Training one stage: config -> sharded model and data -> jitted steps -> checkpoints and metrics.

The story of a run (`train(config, workdir)`), one named helper per step, the pieces in their own modules:

1. `_build_run`: `config.validate` rejects bad values before anything is built; `jax.distributed.initialize`
   runs first when configured, so every later call sees all processes (`distributed`). The model is built
   from the converted backbone (or a random one for tests) by `Empatheia.from_llm`, placed on a
   `data`/`fsdp`/`tensor` mesh by the logical-axis rules (`sharding.shard_model`); the optimizer (AdamW,
   warmup + cosine, global-norm clipping) holds state only for the stage's groups (`init`).
2. `_restore`: a workdir with checkpoints resumes from the latest one, else the run starts from `init_from`
   (`init.init_from`). Checkpoints (`checkpoint.TrainCheckpointer`, async orbax) hold the parameters the
   run can change (everything but the frozen pretrained backbone, which is re-read from `model.backbone`),
   the optimizer state, the pipeline iterator state and the resolved config.
3. `_prepare`: a fresh stage that trains the SD standardises its inputs and warms it up (`sd_warmup`).
4. `_loop`, one `_run_step` each: `batch_size / process_count` examples from this process's grain pipeline,
   assembled into global arrays `[grad_accum, micro_batch, ...]` (`pipelines`), run by ONE jitted program
   that accumulates the micro-batches' gradients into the update of a single big batch (`step`). A
   non-finite loss or gradient norm leaves parameters and optimizer state untouched inside the program;
   the host then applies `train.nan_policy` (`_apply_nan_policy`). The step key is `fold_in(seed, step)`,
   so a resumed run is bit-identical to an uninterrupted one. Every step may log (`_log_window`), evaluate,
   save and stop (`_eval_save_or_stop`); SIGTERM (or a preemption notice) saves and returns cleanly.
5. `_final_eval`: the completed run's evaluation, saved with its last step. Metrics go to TensorBoard
   (`WORKDIR/tensorboard`), `WORKDIR/metrics.jsonl` and a tqdm bar (`metrics`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from empatheia_jax import sharding
from empatheia_jax.data.input_pipeline import InputPipeline
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.train import config as config_lib
from empatheia_jax.train import distributed, ema, init, pipelines, sd_warmup, stages
from empatheia_jax.train import step as step_lib
from empatheia_jax.train.checkpoint import CHECKPOINT_DIR, PreemptionWatcher, TrainCheckpointer
from empatheia_jax.train.metrics import MetricsWriter, Window, flops_per_token, peak_flops

log = logging.getLogger("empatheia_jax.train.trainer")

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
    window = Window(start=time.perf_counter())
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


def _build_run(config: ml_collections.ConfigDict, workdir: Path) -> _Run:
    """Everything that can fail on a bad config or missing data fails here, before a step is compiled."""
    distributed.initialize_distributed(config)
    config_lib.validate(config)
    if config_lib.set_matmul_precision(config) == "bfloat16" and config_lib.cpu_lacks_bf16_dots():
        log.warning("model.matmul_precision=bfloat16 on a CPU without AVX512-BF16 or AMX: its bf16 dots are "
                    "slower than float32 ones here; --config.model.matmul_precision=float32 trains faster on "
                    "this machine (docs/benchmarks.md \"The trainer on a CPU without BF16\")")
    stage = config_lib.resolve_stage(config)
    pipelines.check_packing(config, stage)
    schedule = config_lib.stage_schedule(config)
    manifest = init.model_manifest(config)
    init.check_splits(config, manifest)
    init.check_unused_dims(config)
    lead = jax.process_index() == 0
    if lead:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(json.dumps(config_lib.to_json(config), indent=1))

    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    model, tokenizer = init.build_model(config, manifest, mesh)
    tx, lr_schedule = init.make_tx(config, schedule, stages.trainable_state(model, stage))
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
    pipeline = pipelines.make_train_pipeline(config, stage, model, tokenizer)
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
        restored = run.ckpt.restore(params=init.saved_state(model, run.include_backbone),
                                    opt_state=nnx.state(run.optimizer))
        init.check_same("stage", restored.meta["stage"], run.meta["stage"], workdir)
        saved_model = init.function_of(restored.meta["model_config"])
        init.check_same("model", saved_model, init.function_of(model.config), workdir)
        nnx.update(model, restored.params)
        nnx.update(run.optimizer, restored.opt_state)
        run.data_iter.set_state(distributed.own_data_state(restored.data_state))
        start, nonfinite_skipped = restored.step, int(restored.meta.get("nonfinite_skipped", 0))
        # A resume must be told apart from a restart (both end bit-identical): say where it starts.
        log.info("resuming from step %d (workdir %s)", start, workdir)
        return start, nonfinite_skipped, True
    if config.init_from:
        init.init_from(config, run.stage, model, run.include_backbone)
    return 0, 0, False


def _prepare(run: _Run, resuming: bool, writer: MetricsWriter, watcher: PreemptionWatcher) -> bool:
    """`prepare_sd` on a fresh workdir (a resumed run restored its calibrated SD). False when a preemption
    came during it: the run then ends before step 0, with nothing to save (a restart redoes it all). On
    that path and on an exception, the writer, the checkpointer and the signal handlers are released here,
    since the loop that would release them never starts."""
    try:
        prepared = resuming or sd_warmup.prepare_sd(run.config, run.stage, run.model, run.tokenizer, run.mesh,
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
    weights = step_lib.loss_weights(run.config)
    graphs, params, frozen, opt_state = stages.split_for_step(run.model, run.optimizer, run.stage)
    step_fn = step_lib.jit_step(run.stage, weights, params, opt_state)
    n_trainable = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    peak = peak_flops()
    return _Progress(
        graphs=graphs, params=params, frozen=frozen, opt_state=opt_state, step_fn=step_fn,
        key=jax.random.key(run.config.seed), n_trainable=n_trainable, peak=peak, start=start, done=start,
        nonfinite_skipped=nonfinite_skipped,
    )


# ----------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------


def _loop(
    run: _Run, p: _Progress, window: Window, writer: MetricsWriter, watcher: PreemptionWatcher, bar: Any,
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
    run: _Run, p: _Progress, window: Window, step: int, trace: Any
) -> tuple[Mapping[str, np.ndarray], dict[str, float]]:
    """(host batch, metrics) of one step. The step key is `fold_in(seed, step)`, so a resumed run draws
    the same noise as an uninterrupted one."""
    profile = tuple(run.config.train.profile_steps)
    if profile and step == profile[0]:
        jax.profiler.start_trace(str(run.workdir / "profile"))
    host_batch = distributed.agree_on_length(next(run.data_iter), run.pipeline.pad_id)
    if trace is not None:
        trace.write(json.dumps({"step": step, "record_index": host_batch["record_index"].tolist()}) + "\n")
        trace.flush()
    host_batch = pipelines.pack_for_step(run.config, host_batch, run.pipeline.pad_id, run.mesh)
    batch = pipelines.step_batch(host_batch, run.mesh, run.config.train.grad_accum)
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
    run: _Run, p: _Progress, window: Window, writer: MetricsWriter, host_batch: Mapping[str, np.ndarray]
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
        metrics = step_lib.evaluate_loss(config, run.stage, run.model, run.tokenizer, run.mesh,
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
    params = init.saved_state(run.model, run.include_backbone)
    # save() returns once orbax holds host copies, so the next (donating) step cannot corrupt it.
    run.ckpt.save(
        step,
        params=params,
        ema=ema.averaged(params, run.optimizer) if run.meta["ema"] else None,
        opt_state=nnx.state(run.optimizer),
        data_state=distributed.gather_data_state(run.data_iter.get_state()),
        meta={**run.meta, "nonfinite_skipped": p.nonfinite_skipped},
        metrics=metrics,
        force=force,
    )


__all__ = ["NonFiniteLossError", "TrainResult", "train"]
