"""The Style Disentangler's start: its inputs standardised from data, then a warm-up on cached signal states.

The SD reads the LLM's hidden states at the signal tokens, whose scale is set by the backbone, not by the
SD's initialisation (docs/design.md "SD input standardisation"). Before a stage that trains the SD takes
its first step (`prepare_sd`), one frozen forward per batch collects those states (`collect_sd_inputs`),
`calibrate_sd_inputs` sets the SD's input affines from them, and `warmup_sd` trains the SD alone on the
cache, so that the stage's joint steps start from a trained head instead of a random one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from empatheia_jax import sharding
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.train import config as config_lib
from empatheia_jax.train import objective, stages
from empatheia_jax.train.init import make_tx
from empatheia_jax.train.metrics import MetricsWriter
from empatheia_jax.train.pipelines import eval_batches
from empatheia_jax.train.step import example_keys, loss_weights

log = logging.getLogger(__name__)


def sd_inputs_calibrated(model: Empatheia) -> bool:
    """False while the SD input affines are still the identity they start as."""
    sd = model.style_dis
    return not (sd.speech_in.is_identity() and sd.video_in.is_identity())


SD_INPUT_KEYS = ("r_s", "r_s_mask", "r_v", "r_v_mask")


SD_TARGET_KEYS = ("speech_style", "video_style", "style_mask", "emotion", "age", "gender", "timbre")


def collect_sd_inputs(model: Empatheia, batches: Iterable[Mapping[str, jax.Array]]) -> dict[str, jax.Array]:
    """The SD's inputs (`SD_INPUT_KEYS`, from one frozen forward per batch) and targets (`SD_TARGET_KEYS`,
    those the batches hold), concatenated over the examples of `batches`.

    A few MB per thousand examples (n_signal x d per modality). It feeds `calibrate_sd_inputs` and the SD
    warm-up (`sd_head_loss`). Under a mesh the batches are global arrays and so are the results.
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def signal_states(state, batch):
        out = nnx.merge(graphdef, state)(batch, train=False, heads=frozenset())
        return {k: out[k] for k in SD_INPUT_KEYS}

    got = [{**signal_states(state, b), **{k: b[k] for k in SD_TARGET_KEYS if k in b}} for b in batches]
    if not got:
        raise ValueError("collect_sd_inputs: no batches")
    return {k: jnp.concatenate([g[k] for g in got]) for k in got[0]}


def calibrate_sd_inputs(model: Empatheia, inputs: Mapping[str, jax.Array]) -> int:
    """Sets the SD input affines from `collect_sd_inputs` output; returns the number of examples used.

    shift = the mean of r^m at each signal position over the examples where the signal token is present;
    scale = 1 / the per-dimension std over those examples, averaged over the positions (docs/design.md,
    "SD input standardisation"). Two-pass mean/variance: the spread of the states is ~1e-2 of their mean,
    where the one-pass E[r^2] - E[r]^2 loses most of its digits in float32. Deterministic given the inputs;
    under a mesh the sums are global reductions and every process sets the same values.
    """
    n_examples = 0
    for key, norm in (("r_s", model.style_dis.speech_in), ("r_v", model.style_dis.video_in)):
        r = inputs[key].astype(jnp.float32)  # [N, n_signal, d]
        w = inputs[f"{key}_mask"].astype(jnp.float32)[..., None]
        n = jnp.sum(w, 0)  # [n_signal, 1]
        seen = n > 0
        if not bool(jnp.any(seen)):
            raise ValueError(f"calibrate_sd_inputs: no example has a {key} signal token")
        mean = jnp.sum(r * w, 0) / jnp.maximum(n, 1.0)
        std = jnp.sqrt(jnp.sum(jnp.square(r - mean) * w, 0) / jnp.maximum(n, 1.0))
        std_d = jnp.sum(jnp.where(seen, std, 0.0), 0) / jnp.sum(seen)
        floor = 1e-3 * jnp.max(std_d) + 1e-12  # a constant dimension must not be blown up
        norm.shift[...] = jnp.where(seen, mean, 0.0).astype(norm.shift.dtype)
        norm.scale[...] = (1.0 / jnp.maximum(std_d, floor)).astype(norm.scale.dtype)
        n_examples = max(n_examples, int(jnp.max(n)))
    return n_examples


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
        inputs = collect_sd_inputs(model, batches)
        n = calibrate_sd_inputs(model, inputs)
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
    steps, log_every = int(schedule.sd_warmup_steps), config.train.log_every
    step_fn, params, opt_state, lr_schedule = _sd_warmup_program(config, stage, model, inputs, schedule, mesh)
    indices = _batch_indices(config.seed, int(inputs["r_s"].shape[0]), int(config.train.sd_warmup_batch_size))
    key = jax.random.fold_in(jax.random.key(config.seed), 0x5D)
    window: dict[str, float] = {}
    skipped = 0
    completed = True
    from tqdm import tqdm

    lead = jax.process_index() == 0
    with jax.set_mesh(mesh):
        for i in tqdm(range(steps), desc=f"SD warm-up ({stage.name})", unit="step", disable=not lead):
            params, opt_state, metrics = step_fn(params, opt_state, next(indices), jax.random.fold_in(key, i))
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            skipped += int(metrics.pop("nonfinite"))
            for k, v in metrics.items():
                window[k] = window.get(k, 0.0) + v
            if (i + 1) % log_every == 0 or i + 1 == steps:
                _write_window(writer, i, window, lr_schedule, skipped, log_every)
                window = {}
                if stop_requested():
                    completed = i + 1 == steps
                    break
    nnx.update(model.style_dis, params)
    if skipped:
        log.warning("SD warm-up: %d of %d updates skipped (non-finite loss or gradient)", skipped, steps)
    return completed


def _batch_indices(seed: int, n: int, batch_size: int) -> Iterator[jax.Array]:
    """The warm-up's batches as indices into the cache: `min(batch_size, n)` examples drawn without
    replacement, epoch by epoch, from a permutation seeded by `seed` (endless)."""
    size = min(batch_size, n)
    rng = np.random.default_rng([seed, 0x5D])
    perm, cursor = rng.permutation(n), 0
    while True:
        if cursor + size > n:
            perm, cursor = rng.permutation(n), 0
        idx = jnp.asarray(perm[cursor:cursor + size], jnp.int32)
        cursor += size
        yield idx


def _write_window(
    writer: MetricsWriter | None, i: int, window: Mapping[str, float], lr_schedule: optax.Schedule,
    skipped: int, log_every: int,
) -> None:
    """The mean metrics of the warm-up steps since the last log line (step `i` ends the window), with the lr
    and the count of skipped updates, under `sd_warmup/`."""
    n_win = (i % log_every) + 1
    out = {f"sd_warmup/{k}": v / n_win for k, v in window.items()}
    out["sd_warmup/lr"] = float(lr_schedule(i))
    out["sd_warmup/nonfinite_skipped"] = skipped
    if writer is not None:
        writer.write(i + 1, out)


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
