"""Resolving and validating a run's ml-collections config before anything is built or compiled.

A bad value must fail in the first second with a message naming the key (`config.optim.lr=-1: ...`), not
twenty minutes later inside XLA or after the first checkpoint. `validate` collects every problem it can
see and raises one `ConfigError` listing them all; `resolve_stage` / `stage_schedule` are the single place
that turns `stage`, `ablations` and `schedule` into what the trainer runs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_collections

from empatheia_jax.models.llama import _DTYPES, ATTENTION_IMPLEMENTATIONS
from empatheia_jax.train.stages import STAGES, Stage, StageSkipped, apply_ablations, get_stage

NAN_POLICIES = ("skip", "stop")
REMAT_POLICIES = ("none", "full", "dots")
# model.matmul_precision: names jax_default_matmul_precision takes; "default" = the platform's fast default.
MATMUL_PRECISIONS = ("float32", "tensorfloat32", "bfloat16", "default")
CCL_SCALES = ("none", "balanced")  # loss.ccl_scale: eq 9, or each content dimension an equal share


class ConfigError(ValueError):
    """An invalid run config; the message lists every offending key with its value."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    steps: int
    lr: float
    warmup_steps: int
    sd_warmup_steps: int = 0  # SD-only steps on cached signal states before step 0 (sd_warmup.warmup_sd)
    sd_warmup_lr: float = 0.0  # resolved: schedule.<stage>.sd_warmup_lr, or the stage's lr when that is 0


def resolve_stage(config: ml_collections.ConfigDict) -> Stage:
    """The stage this run trains: `config.stage` under `config.ablations` (raises StageSkipped/ValueError)."""
    return apply_ablations(get_stage(config.stage), **dict(config.ablations))


def stage_schedule(config: ml_collections.ConfigDict) -> Schedule:
    """Steps, peak lr, warmup and SD warm-up of the current stage (`schedule.<stage>`, falling back to
    `optim`)."""
    s = config.schedule[config.stage]
    lr = float(s.lr) if s.lr > 0 else float(config.optim.lr)
    warmup = int(s.warmup_steps) if s.warmup_steps >= 0 else int(config.optim.warmup_steps)
    sd_lr = float(s.get("sd_warmup_lr", 0.0))
    return Schedule(steps=int(s.steps), lr=lr, warmup_steps=warmup,
                    sd_warmup_steps=int(s.get("sd_warmup_steps", 0)), sd_warmup_lr=sd_lr if sd_lr > 0 else lr)


def to_json(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The resolved config as plain JSON (tuples become lists), for checkpoints and logs."""
    return json.loads(config.to_json())


def validate(
    config: ml_collections.ConfigDict,
    *,
    device_count: int | None = None,
    process_count: int | None = None,
    check_paths: bool = True,
) -> None:
    """Raises ConfigError listing every bad value. Device/process counts default to jax's (when known).

    Every section is checked even after a problem, so one run of a bad config names all its problems; the
    sections run in a fixed order, so the message lists them in it.
    """
    problems: list[str] = []

    def bad(key: str, value: Any, why: str) -> None:
        problems.append(f"config.{key}={value!r}: {why}")

    _validate_stage(config, bad)
    _validate_optim(config, bad)
    _validate_train(config, bad)
    process_count = _validate_mesh(config, bad, device_count, process_count)
    _validate_processes(config, bad, process_count)
    _validate_model(config, bad)
    _validate_content_sync(config, bad)
    _validate_loss_chunks(config, bad)
    _validate_sequence(config, bad)
    _validate_checkpoint(config, bad)
    if check_paths:
        _validate_paths(config, bad)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


# `bad(key, value, why)`: records one problem of `validate`'s (its sections below all report through it).
_Bad = Callable[[str, Any, str], None]


def _validate_stage(config: ml_collections.ConfigDict, bad: _Bad) -> None:
    """The stage, its ablations and its schedule entry."""
    try:
        resolve_stage(config)
    except StageSkipped as e:
        bad("stage", config.stage, f"nothing to train under the ablations ({e})")
    except ValueError as e:
        bad("stage", config.stage, str(e))
    for name, value in config.ablations.items():
        if not isinstance(value, bool):
            bad(f"ablations.{name}", value, "must be True or False")
    if config.stage in config.schedule:
        sched = stage_schedule(config)
        if sched.steps < 1:
            bad(f"schedule.{config.stage}.steps", sched.steps, "must be >= 1")
        if not 0 <= sched.warmup_steps <= max(sched.steps, 0):
            bad(
                f"schedule.{config.stage}.warmup_steps (or optim.warmup_steps)",
                sched.warmup_steps,
                f"must be in [0, steps={sched.steps}]",
            )
    elif isinstance(config.stage, str):
        bad("schedule", sorted(config.schedule), f"has no entry for stage {config.stage!r}")


def _validate_optim(config: ml_collections.ConfigDict, bad: _Bad) -> None:
    """The optimizer, every stage's learning rates and the loss weights."""
    o = config.optim
    if not o.lr > 0:
        bad("optim.lr", o.lr, "must be > 0")
    for name in config.schedule:
        for key, what in (("lr", "optim.lr"), ("sd_warmup_lr", "the stage's lr")):
            if config.schedule[name].get(key, 0.0) < 0:
                bad(f"schedule.{name}.{key}", config.schedule[name][key], f"must be >= 0 (0 = {what})")
        if config.schedule[name].get("sd_warmup_steps", 0) < 0:
            bad(f"schedule.{name}.sd_warmup_steps", config.schedule[name].sd_warmup_steps, "must be >= 0")
    if o.weight_decay < 0:
        bad("optim.weight_decay", o.weight_decay, "must be >= 0")
    if o.clip_norm < 0:
        bad("optim.clip_norm", o.clip_norm, "must be >= 0 (0 = no clipping)")
    for name in ("b1", "b2"):
        if not 0 <= o[name] < 1:
            bad(f"optim.{name}", o[name], "must be in [0, 1)")
    if not o.eps > 0:
        bad("optim.eps", o.eps, "must be > 0")
    if not 0 <= o.end_lr_ratio <= 1:
        bad("optim.end_lr_ratio", o.end_lr_ratio, "must be in [0, 1]")
    if not 0 <= o.get("ema_decay", 0.0) < 1:
        bad("optim.ema_decay", o.ema_decay, "must be in [0, 1) (0 = no EMA)")
    for name in ("alpha", "beta", "kl"):
        if config.loss[name] < 0:
            bad(f"loss.{name}", config.loss[name], "must be >= 0")
    if config.loss.get("ccl_scale", "none") not in CCL_SCALES:
        bad("loss.ccl_scale", config.loss.ccl_scale, f"must be one of {CCL_SCALES}")


def _validate_train(config: ml_collections.ConfigDict, bad: _Bad) -> None:
    """The batch, the NaN policy and the loop's intervals."""
    t = config.train
    if t.batch_size < 1:
        bad("train.batch_size", t.batch_size, "must be >= 1")
    if t.grad_accum < 1:
        bad("train.grad_accum", t.grad_accum, "must be >= 1")
    elif t.batch_size % t.grad_accum:
        bad("train.batch_size", t.batch_size, f"must be a multiple of train.grad_accum={t.grad_accum}")
    if t.nan_policy not in NAN_POLICIES:
        bad("train.nan_policy", t.nan_policy, f"must be one of {NAN_POLICIES}")
    if t.max_consecutive_nonfinite < 1:
        bad("train.max_consecutive_nonfinite", t.max_consecutive_nonfinite, "must be >= 1")
    for name in ("log_every", "calibration_batches", "sd_warmup_batch_size"):
        if t[name] < 1:
            bad(f"train.{name}", t[name], "must be >= 1")
    for name in ("eval_every", "eval_batches"):
        if t[name] < 0:
            bad(f"train.{name}", t[name], "must be >= 0")
    if len(tuple(t.profile_steps)) not in (0, 2) or (
        t.profile_steps and not 0 <= t.profile_steps[0] < t.profile_steps[1]
    ):
        bad("train.profile_steps", t.profile_steps, "must be () or (start, stop) with 0 <= start < stop")


def _validate_mesh(
    config: ml_collections.ConfigDict, bad: _Bad, device_count: int | None, process_count: int | None
) -> int | None:
    """The mesh against the devices, and the micro-batch against the data x fsdp shards. Returns the process
    count the batch must split over: jax's when the devices were asked of it too (only for a well-formed
    mesh), else the given one."""
    t = config.train
    sizes = {k: config.mesh[k] for k in ("data", "fsdp", "tensor")}
    if any(v == 0 or v < -1 for v in sizes.values()) or sum(v == -1 for v in sizes.values()) > 1:
        bad("mesh", sizes, "sizes must be positive, with at most one -1 (= the remaining devices)")
        return process_count
    if device_count is None:
        import jax

        device_count = jax.device_count()
        process_count = jax.process_count() if process_count is None else process_count
    known = 1
    for v in sizes.values():
        known *= v if v != -1 else 1
    if device_count % known or (-1 not in sizes.values() and known != device_count):
        bad("mesh", sizes, f"does not divide the {device_count} devices")
        return process_count
    resolved = {k: (v if v != -1 else device_count // known) for k, v in sizes.items()}
    shards = resolved["data"] * resolved["fsdp"]
    micro = t.batch_size // max(t.grad_accum, 1)
    if t.batch_size >= 1 and t.grad_accum >= 1 and micro % shards:
        bad(
            "train.batch_size",
            t.batch_size,
            f"the micro-batch batch_size/grad_accum={micro} must be a multiple of the data x fsdp "
            f"mesh size {shards} (mesh {resolved})",
        )
    return process_count


def _validate_processes(config: ml_collections.ConfigDict, bad: _Bad, process_count: int | None) -> None:
    """Each process feeds its own slice of every micro-batch."""
    t = config.train
    if (
        process_count
        and t.batch_size >= 1
        and t.grad_accum >= 1
        and (t.batch_size // t.grad_accum) % process_count
    ):
        bad(
            "train.batch_size",
            t.batch_size,
            f"the micro-batch must split evenly over {process_count} processes",
        )


def _validate_model(config: ml_collections.ConfigDict, bad: _Bad) -> None:
    """The model's dtypes, precision, remat, attention, LoRA rank and signal tokens."""
    for name in ("dtype", "param_dtype"):
        if name in config.model.llm and config.model.llm[name] not in _DTYPES:
            bad(f"model.llm.{name}", config.model.llm[name], f"must be one of {sorted(_DTYPES)}")
    precision = config.model.get("matmul_precision", "float32")
    if precision not in MATMUL_PRECISIONS:
        bad("model.matmul_precision", precision, f"must be one of {MATMUL_PRECISIONS}")
    if "remat" in config.model.llm and config.model.llm.remat not in REMAT_POLICIES:
        bad("model.llm.remat", config.model.llm.remat, f"must be one of {REMAT_POLICIES}")
    attention = config.model.llm.get("attention", "auto")
    if attention not in ATTENTION_IMPLEMENTATIONS:
        bad("model.llm.attention", attention, f"must be one of {ATTENTION_IMPLEMENTATIONS}")
    if config.model.lora.rank < 1:
        bad("model.lora.rank", config.model.lora.rank, "must be >= 1")
    if config.model.empatheia.n_signal < 1:
        bad("model.empatheia.n_signal", config.model.empatheia.n_signal, "must be >= 1")


def _validate_content_sync(config: ml_collections.ConfigDict, bad: _Bad) -> None:
    """The Content Synchronizer's unit tables, row convolution and unit reader, and a stage that trains it
    from its units alone."""
    for key, what in (("cs_units", "the CS speech block's unit table; 0 = no alignment"),
                      ("cv_units", "the CS video block's unit table; 0 = no alignment"),
                      ("cv_dims", "the video content dims the face generator reads; 0 = all"),
                      ("cs_context_width", "the speech block's unit reader width; 0 = vae_d_model")):
        units = config.model.empatheia.get(key, 0)
        if not isinstance(units, int) or isinstance(units, bool) or units < 0:
            bad(f"model.empatheia.{key}", units, f"must be an int >= 0 ({what})")
    cs_conv = config.model.empatheia.get("cs_conv", 0)
    odd_or_zero = isinstance(cs_conv, int) and cs_conv >= 0 and (cs_conv == 0 or cs_conv % 2 == 1)
    if isinstance(cs_conv, bool) or not odd_or_zero:
        bad("model.empatheia.cs_conv", cs_conv,
            "must be 0 (none) or a positive odd int (the CS's row convolution width)")
    unit_context = config.model.empatheia.get("cs_unit_context", False)
    if not isinstance(unit_context, bool):
        bad("model.empatheia.cs_unit_context", unit_context, "must be True or False")
    elif unit_context and not (config.model.empatheia.get("cs_units", 0)
                               or config.model.empatheia.get("cv_units", 0)):
        bad("model.empatheia.cs_unit_context", unit_context,
            "reads content units: set model.empatheia.cs_units and/or cv_units")
    skip = config.model.empatheia.get("cs_context_skip", False)
    if not isinstance(skip, bool):
        bad("model.empatheia.cs_context_skip", skip, "must be True or False")
    elif skip and not (unit_context is True and config.model.empatheia.get("cs_units", 0)):
        bad("model.empatheia.cs_context_skip", skip, "sends the speech block's unit reader to its rows: set "
            "model.empatheia.cs_units and cs_unit_context=True")
    if config.stage in STAGES and not STAGES[config.stage].reads_llm:
        units = {k: config.model.empatheia.get(k, 0) for k in ("cs_units", "cv_units")}
        if not all(units.values()):
            bad("stage", config.stage, "trains the CS from its units alone, so both of its blocks must be "
                f"unit-aligned: set model.empatheia.cs_units and cv_units (got {units})")


def _validate_loss_chunks(config: ml_collections.ConfigDict, bad: _Bad) -> None:
    """How the text loss projects its positions: chunked, and only the loss positions."""
    ce_chunk = config.model.empatheia.get("ce_chunk", 0)
    if not isinstance(ce_chunk, int) or ce_chunk < 0:
        bad("model.empatheia.ce_chunk", ce_chunk, "must be an int >= 0 (positions a chunk; 0 = all at once)")
    ce_targets = config.model.empatheia.get("ce_targets", 0)
    if not isinstance(ce_targets, int) or isinstance(ce_targets, bool) or ce_targets < 0:
        bad("model.empatheia.ce_targets", ce_targets,
            "must be an int >= 0 (loss positions per row projected at once; 0 = every position)")


def _validate_sequence(config: ml_collections.ConfigDict, bad: _Bad) -> None:
    """The sequence length the model is fed, its buckets and packed rows."""
    if config.data.max_len < 16:
        bad("data.max_len", config.data.max_len, "must be >= 16")
    step = config.data.get("bucket_step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= config.data.max_len:
        bad("data.bucket_step", step,
            f"must be an int in [0, data.max_len={config.data.max_len}] (0 = power-of-two buckets)")
    pack_len = config.data.get("pack_len", 0)
    if not isinstance(pack_len, int) or isinstance(pack_len, bool) or pack_len < 0:
        bad("data.pack_len", pack_len, "must be an int >= 0 (packed row length; 0 = no packing)")
    elif pack_len and pack_len < config.data.max_len:
        bad("data.pack_len", pack_len,
            f"must be 0 or >= data.max_len={config.data.max_len} (every example must fit a row)")


def bucket_lengths(config: ml_collections.ConfigDict) -> tuple[int, ...] | None:
    """The padded lengths of `data.bucket_step` (every multiple up to max_len), None for the pipeline's
    default (powers of two from 128)."""
    step, max_len = int(config.data.get("bucket_step", 0)), int(config.data.max_len)
    return None if step == 0 else (*range(step, max_len, step), max_len)


def _validate_checkpoint(config: ml_collections.ConfigDict, bad: _Bad) -> None:
    """Checkpoint intervals and retention; a best metric the stage's evaluation actually reports."""
    c = config.checkpoint
    if c.every < 1:
        bad("checkpoint.every", c.every, "must be >= 1")
    if c.keep < 1:
        bad("checkpoint.keep", c.keep, "must be >= 1")
    if c.best_mode not in ("min", "max"):
        bad("checkpoint.best_mode", c.best_mode, "must be 'min' or 'max'")
    if c.keep_best:
        choices = best_metric_choices(config)
        if choices and c.best_metric not in choices:
            bad("checkpoint.best_metric", c.best_metric, f"the stage's evaluation reports no such metric, so "
                f"no step would ever rank best; one of {choices}")


def _validate_paths(config: ml_collections.ConfigDict, bad: _Bad) -> None:
    """The shards, backbone, tokenizer and init_from exist (skipped by `check_paths=False`, for configs
    checked away from their data)."""
    shards = Path(config.data.shards) if config.data.shards else None
    if shards is None:
        bad("data.shards", config.data.shards, "must name a data.prepare output folder")
    elif not (shards / "manifest.json").is_file():
        bad(
            "data.shards", config.data.shards, "has no manifest.json (not a finished data.prepare folder)"
        )
    if config.model.backbone:
        if not (Path(config.model.backbone) / "COMPLETE").is_file():
            bad(
                "model.backbone",
                config.model.backbone,
                "is not a complete converted checkpoint (run empatheia_jax.weights.hf_to_flax)",
            )
    elif not config.model.tokenizer:
        bad(
            "model.tokenizer",
            config.model.tokenizer,
            "a random backbone (model.backbone='') needs a tokenizer",
        )
    if config.model.tokenizer and not Path(config.model.tokenizer).exists():
        bad("model.tokenizer", config.model.tokenizer, "does not exist")
    if config.init_from and not Path(config.init_from).exists():
        bad("init_from", config.init_from, "does not exist")


def best_metric_choices(config: ml_collections.ConfigDict) -> list[str]:
    """The eval metrics `checkpoint.best_metric` can name for the config's stage: the total, each loss term
    the stage counts, and the groups (ccl, sal, cls, sac) whose terms all count. [] if the stage is invalid
    (reported on its own)."""
    from empatheia_jax.train import losses

    try:
        terms = set(resolve_stage(config).loss_terms)
    except (ValueError, StageSkipped):
        return []
    names = {losses.TOTAL, *terms}
    groups = {losses.CCL: losses.CCL_TERMS, losses.SAL: losses.SAL_TERMS, losses.CLS: losses.CLS_TERMS,
              losses.SAC: (*losses.SAL_TERMS, *losses.CLS_TERMS)}
    names |= {name for name, members in groups.items() if terms >= set(members)}
    return sorted(f"eval/{n}" for n in names)


def set_matmul_precision(config: ml_collections.ConfigDict) -> str:
    """Sets the run's float32 dot precision process-wide and returns it.

    Process-wide rather than per dot, because a run's model, loss and generation must all compute the same
    function, as it did in training (docs/design.md "Matmul precision"). Configs from before the key
    existed mean "float32".
    """
    import jax

    precision = config.model.get("matmul_precision", "float32")
    if precision not in MATMUL_PRECISIONS:
        raise ConfigError(f"config.model.matmul_precision={precision!r}: must be one of {MATMUL_PRECISIONS}")
    jax.config.update("jax_default_matmul_precision", None if precision == "default" else precision)
    return precision


def cpu_lacks_bf16_dots(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True where XLA:CPU runs here on an x86 CPU whose flags name neither AVX512-BF16 nor AMX-BF16: there
    bfloat16 dot operands cost more than float32 ones (the ED coe step at 0.82x on a Zen 3, docs/benchmarks.md
    "The trainer on a CPU without BF16"), so `model.matmul_precision=bfloat16` is worth a warning. False when
    it cannot tell (another backend, another architecture, no /proc)."""
    import jax

    if jax.default_backend() != "cpu":
        return False
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    lines = [line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")]
    return bool(lines) and "avx2" in lines[0] and not {"avx512_bf16", "amx_bf16"} & set(lines[0])


__all__ = [
    "MATMUL_PRECISIONS",
    "cpu_lacks_bf16_dots",
    "NAN_POLICIES",
    "ConfigError",
    "best_metric_choices",
    "Schedule",
    "resolve_stage",
    "set_matmul_precision",
    "stage_schedule",
    "to_json",
    "validate",
]

