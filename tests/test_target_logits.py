"""Target-only logits (`model.empatheia.ce_targets`, `Llama.target_nll`): the token losses project only the
positions they read, and their value and gradients equal the whole-logits ones; a batch with more loss
positions than the static bound falls back to the whole projection instead of dropping tokens."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from empatheia_jax.models import trainable
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.models.empatheia_config import EmpatheiaConfig
from empatheia_jax.models.llama import gather_target_nll
from empatheia_jax.models.lora import set_lora_b
from empatheia_jax.train import objective, stages
from tests.helpers import FAST, jaxpr_eqns
from tests.test_empatheia import CFG, make_batch


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _build(cfg: EmpatheiaConfig, seed: int = 3) -> Empatheia:
    model = Empatheia(cfg, rngs=nnx.Rngs(seed))
    set_lora_b(model.llm, jax.random.key(seed + 100), std=0.05)
    return model


@functools.partial(jax.jit, static_argnames=("graphdef", "stage_name"), compiler_options=FAST)
def _loss_and_grads(graphdef, params, frozen, batch, rng, *, stage_name):
    loss_fn = objective.make_loss_fn(stages.STAGES[stage_name])
    return jax.value_and_grad(loss_fn, has_aux=True)(params, graphdef, frozen, batch, rng)


def _run(cfg: EmpatheiaConfig, batch, stage_name: str):
    stage = stages.STAGES[stage_name]
    model = _build(cfg)
    graphdef, params, frozen = nnx.split(model, trainable.trainable_filter(stage.trainable_groups), ...)
    rng = jax.random.split(jax.random.key(1), batch["input_ids"].shape[0])
    (total, metrics), grads = _loss_and_grads(graphdef, params, frozen, batch, rng, stage_name=stage_name)
    flat = {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}
    return float(total), {k: float(v) for k, v in metrics.items()}, flat


def _assert_same(got, ref, what):
    total, metrics, grads = got
    ref_total, ref_metrics, ref_grads = ref
    np.testing.assert_allclose(total, ref_total, rtol=1e-6, err_msg=what)
    for k, v in ref_metrics.items():
        np.testing.assert_allclose(metrics[k], v, rtol=1e-6, atol=1e-7, err_msg=f"{what} {k}")
    assert grads.keys() == ref_grads.keys()
    top = max(np.abs(g).max() for g in ref_grads.values())
    for k, g in ref_grads.items():
        err, scale = np.abs(grads[k] - g).max(), np.abs(g).max()
        if k.endswith("key/bias"):
            # softmax is shift-invariant over the keys, so a key bias's gradient is exactly 0: both sides hold
            # rounding noise (~5e-7 here, which the compiler's fusion choices move), never a value to compare
            assert max(np.abs(grads[k]).max(), scale) <= 1e-5 * top, (what, k, scale, top)
            continue
        # A leaf whose gradient is a near-cancelling sum (a cross-attention's query bias: ~0.05 here, next to
        # a largest gradient of ~270) carries rounding noise of the terms it sums, not of its result: on an
        # AVX-512 CPU the chunked CE moved it by 7e-7 (1.4e-5 of it). The floor is 1e-8 of the largest
        # gradient; a dropped or wrong target moves a leaf by a share of its own size.
        assert err <= 1e-5 * scale + 1e-8 * top, (what, k, err, scale, top)


@pytest.mark.parametrize("stage_name", ["coe", "sac"])
def test_target_only_logits_give_the_whole_logits_loss_and_gradients(stage_name):
    """coe (L_emp, LoRA gradients) and sac (signal CE, the added rows' gradients through the LM head):
    the gathered projection, the gathered projection chunked, and the overflow fallback all equal
    ce_targets=0 in float32."""
    batch = {k: jnp.asarray(v) for k, v in make_batch(2).items()}
    rows, n_targets = batch["loss_mask"].shape[0], int(batch["loss_mask"].sum())
    per_row = -(-n_targets // rows)  # the smallest bound that holds the batch: the gathered branch runs
    ref = _run(CFG, batch, stage_name)
    assert np.isfinite(ref[0]) and ref[1]["emp_tokens"] == n_targets
    assert sum(np.abs(g).max() > 0 for g in ref[2].values()) > len(ref[2]) // 2
    variants = {
        "gathered": {"ce_targets": per_row},
        "gathered, chunked": {"ce_targets": per_row, "ce_chunk": 5},
        "overflow -> whole": {"ce_targets": per_row - 2},
        "overflow -> whole, chunked": {"ce_targets": per_row - 2, "ce_chunk": 5},
    }
    for what, fields in variants.items():
        _assert_same(_run(dataclasses.replace(CFG, **fields), batch, stage_name), ref, what)


def test_the_bound_picks_the_branch_and_a_dropped_target_is_caught():
    """sum(mask) <= bound runs the gathered branch, more runs the whole one (both equal the whole logits at
    the loss positions, 0 elsewhere). The gathered branch alone with a bound one short DROPS the last
    target: the loss the equality above compares then differs, so that test would fail."""
    model = _build(CFG)
    batch = make_batch(2)
    mask = jnp.asarray(batch["loss_mask"]).astype(bool)
    ids = jnp.where(mask, jnp.asarray(batch["target_ids"]), 0)
    hidden = jax.random.normal(jax.random.key(0), mask.shape + (CFG.llm.hidden_size,))
    n = int(mask.sum())
    whole = np.where(mask, np.asarray(model.llm.token_nll(hidden, ids)), 0.0)
    for bound in (n, n + 7, n - 1, 1):
        got = np.asarray(model.llm.target_nll(hidden, ids, mask, max_targets=bound))
        np.testing.assert_allclose(got, whole, rtol=1e-6, atol=1e-7, err_msg=str(bound))
    head = model.llm._head()
    exact = np.asarray(gather_target_nll(head, hidden, ids, mask, n))
    np.testing.assert_allclose(exact, whole, rtol=1e-6, atol=1e-7)
    dropped = np.asarray(gather_target_nll(head, hidden, ids, mask, n - 1))
    loss = lambda nll: nll.sum() / n  # noqa: E731  (L_emp's mean over loss_mask)
    assert not np.isclose(loss(dropped), loss(whole), rtol=1e-6, atol=1e-7)
    last = np.argwhere(np.asarray(mask))[-1]
    assert dropped[tuple(last)] == 0 and whole[tuple(last)] > 0


def _coe_loss_at_bound_4():
    """(config, batch, loss of the trainable params, those params): stage coe with ce_targets=4."""
    batch = {k: jnp.asarray(v) for k, v in make_batch(2).items()}
    cfg = dataclasses.replace(CFG, ce_targets=4)
    stage = stages.STAGES["coe"]
    model = _build(cfg)
    graphdef, params, frozen = nnx.split(model, trainable.trainable_filter(stage.trainable_groups), ...)
    rng = jax.random.split(jax.random.key(1), batch["loss_mask"].shape[0])
    loss_fn = objective.make_loss_fn(stage)
    return cfg, batch, lambda p: loss_fn(p, graphdef, frozen, batch, rng), params


def test_the_gathered_branch_really_runs_inside_the_step():
    """The traced loss holds a `cond` whose gathered branch projects [1, bound, V] logits, not [B, T, V]."""
    cfg, batch, loss, params = _coe_loss_at_bound_4()
    rows = batch["loss_mask"].shape[0]
    jaxpr = str(jax.make_jaxpr(loss)(params))
    assert "cond[" in jaxpr
    assert f"f32[1,{4 * rows},{cfg.llm.total_vocab}]" in jaxpr


def _cond_outputs(jaxpr):
    """The output shapes of every `cond` of a jaxpr, recursively."""
    for eqn in jaxpr_eqns(jaxpr):
        if eqn.primitive.name == "cond":
            yield from (tuple(v.aval.shape) for v in eqn.outvars)


def test_the_gradient_keeps_no_whole_logits_for_the_branch_that_did_not_run():
    """Under autodiff a cond's branches return the union of their residuals: without the whole branch's
    remat the gathered branch handed back a zero [B, T, V] softmax every step (0.14 s of a SmolLM2 CPU
    step)."""
    cfg, batch, loss, params = _coe_loss_at_bound_4()
    b, t = batch["loss_mask"].shape
    grad = jax.grad(lambda p: loss(p)[0])
    shapes = list(_cond_outputs(jax.make_jaxpr(grad)(params).jaxpr))
    assert shapes, "no cond traced"
    assert (1, 4 * b, cfg.llm.total_vocab) in shapes  # the gathered branch's own residual
    assert (b, t, cfg.llm.total_vocab) not in shapes
