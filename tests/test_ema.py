"""The parameter EMA (`train/ema.py`, `optim.ema_decay`).

- `ema_params` chained after an optimizer passes its updates through unchanged and keeps the average the
  module docstring writes down, recomputed here with numpy (warm-up of the decay included).
- A tiny training run with the EMA: every checkpoint holds an `ema` item equal to that recurrence over the
  run's own saved parameters; `load_trained` (so eval, chat, export) and the run's own evaluation use it; a
  run killed after step 2 and resumed ends with the same average, bit for bit, as the run that was not; the
  next stage's `init_from` starts from the average.
"""

from __future__ import annotations

import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import make_tiny_shards, saved_smollm2_tokenizer
from test_trainer import tiny_config

from empatheia_jax import sharding
from empatheia_jax.serve import load as serve_load
from empatheia_jax.train import config as config_lib
from empatheia_jax.train import ema, init, trainer
from empatheia_jax.train import step as step_lib
from empatheia_jax.train.checkpoint import TrainCheckpointer


def _hand_ema(decay: float, start: dict, iterates: list[dict]) -> dict:
    avg = {k: np.asarray(v, np.float64) for k, v in start.items()}
    for t, p in enumerate(iterates, start=1):
        d = min(decay, (1 + t) / (10 + t))
        avg = {k: d * avg[k] + (1 - d) * np.asarray(p[k], np.float64) for k in avg}
    return avg


def test_ema_params_is_the_recurrence_and_leaves_the_updates_alone():
    params = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([0.25, -0.75])}
    grads = [{"w": jnp.full((2, 2), g), "b": jnp.array([g, -g])} for g in (1.0, -0.5, 2.0, 0.25)]
    plain, averaged = optax.sgd(0.1), optax.chain(optax.sgd(0.1), ema.ema_params(0.9))
    p1, s1 = params, plain.init(params)
    p2, s2 = params, averaged.init(params)
    iterates = []
    for g in grads:
        u1, s1 = plain.update(g, s1, p1)
        u2, s2 = averaged.update(g, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
        iterates.append(p2)
    for k in params:
        np.testing.assert_array_equal(p2[k], p1[k])  # the EMA changes no update
    found = ema.find_ema(s2)
    assert int(found.count) == 4
    want = _hand_ema(0.9, params, iterates)
    for k in params:
        np.testing.assert_allclose(found.ema[k], want[k], rtol=1e-6, atol=1e-7)
    # the warm-up: after 4 updates d = min(0.9, 5/14), far from the initial weights
    assert float(ema.decay_at(0.9, jnp.array(4))) == pytest.approx(5 / 14)
    with pytest.raises(ValueError, match="must be in \\(0, 1\\)"):
        ema.ema_params(1.0)
    with pytest.raises(ValueError, match="needs the parameters"):
        averaged.update(grads[0], averaged.init(params))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return saved_smollm2_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_tiny_shards(tmp_path_factory.mktemp("ema_data"))


DECAY = 0.5


def _config(tok, shards, steps: int):
    return tiny_config(tok, shards, **{"schedule.coe.steps": steps, "checkpoint.every": 1,
                                       "checkpoint.keep": 5, "optim.ema_decay": DECAY})


def _flat(state: nnx.State) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}


def _saved(workdir, step: int, item: str, target: nnx.State) -> dict[str, np.ndarray]:
    with TrainCheckpointer(workdir / "checkpoints", create=False, async_save=False) as ck:
        return _flat(ck.restore(step, params=target, item=item).params)


def test_a_run_with_ema_saves_evaluates_loads_and_resumes_the_average(tok, shards, tmp_path):
    run = tmp_path / "run"
    result = trainer.train(_config(tok, shards, 3), run)
    assert result.status == "completed"
    model, tokenizer, config, meta = serve_load.load_trained(run)
    assert meta["ema"] is True
    target = init.saved_state(model, meta["include_backbone"])
    untrained = _flat(init.saved_state(serve_load.load_trained(run, restore=False)[0],
                                       meta["include_backbone"]))
    live = [_saved(run, s, "params", target) for s in (1, 2, 3)]
    trained = [k for k in untrained if not np.array_equal(live[-1][k], untrained[k])]
    assert trained  # the LoRA moved
    for step in (1, 2, 3):
        want = _hand_ema(DECAY, {k: untrained[k] for k in trained}, [p for p in live[:step]])
        got = _saved(run, step, "ema", target)
        for k in trained:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=f"step {step} {k}")
        assert all(np.array_equal(got[k], live[step - 1][k]) for k in untrained if k not in trained)
    # what eval, chat and export load is the average, not the last iterate
    loaded = _flat(init.saved_state(model, meta["include_backbone"]))
    ema3 = _saved(run, 3, "ema", target)
    assert all(np.array_equal(loaded[k], ema3[k]) for k in trained)
    assert any(not np.array_equal(loaded[k], live[-1][k]) for k in trained)
    # the run's own final evaluation was of the average: the loaded model scores the same
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    sharding.shard_model(model, mesh)
    got = step_lib.evaluate_loss(config, config_lib.resolve_stage(config), model, tokenizer, mesh,
                                 max_batches=config.train.eval_batches)
    assert {f"eval/{k}": v for k, v in got.items()} == pytest.approx(result.eval_metrics, rel=1e-6)
    # killed after step 2 (its step-3 checkpoint never written), resumed: the same average, bit for bit
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "3")
    assert trainer.train(_config(tok, shards, 3), resumed).status == "completed"
    again = _saved(resumed, 3, "ema", target)
    for k in trained:
        np.testing.assert_array_equal(again[k], ema3[k], err_msg=k)
    # the next stage starts from the average: ccl trains only the CS, so its adapters are the coe EMA's
    ccl = tmp_path / "ccl"
    trainer.train(tiny_config(tok, shards, stage="ccl", init_from=str(run), **{"schedule.ccl.steps": 2}), ccl)
    chained = _flat(init.saved_state(serve_load.load_trained(ccl)[0], meta["include_backbone"]))
    lora = [k for k in trained if "lora" in k]
    assert lora and all(np.array_equal(chained[k], ema3[k]) for k in lora)
