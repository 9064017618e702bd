"""A training checkpoint saved under one mesh restores under another, bit for bit, on the new layout.

Why: a run is resumed (after preemption, on a new allocation) or evaluated on whatever hardware is free, so
the mesh at restore time is often not the one it was saved on: 8 data-parallel devices at save, fsdp x
tensor at resume, one device for `empatheia eval`. Orbax reshards on read when the restore target carries
the new shardings; `TrainCheckpointer.restore` builds its targets from the live model it is given (never
from the saved layout). These tests pin that down through the trainer's own code, on the 8 fake devices:

- a real `trainer.train` of the `tiny` config (stage coe, one step, so the step counters and the LoRA B
  factors' Adam moments are non-zero) on mesh **data=8**, which checkpoints step 1; every value and
  sharding that `TrainCheckpointer.save` was handed is recorded;
- that workdir resumed by `trainer.train` on mesh **fsdp=4 x tensor=2**: what the trainer holds right after
  its restore (every parameter and the whole optimizer state, step counters included) is the saved state
  byte for byte, each array on the NEW mesh with the logical-axis rules' layout there, and many of them
  really split where data=8 had them replicated (so a restore that kept the saved layout fails); the step,
  meta and data-iterator state are step 1's;
- the trainer's resume calls (`build_model` on the mesh, `make_optimizer`, `TrainCheckpointer.restore` of
  `saved_state` + the optimizer state) on a one-device mesh of the LAST device (not the default one);
- `serve.load.load_trained`, what `empatheia eval` and `chat` load through: a host model on one device.

The final eval of both runs is stubbed out (`step.evaluate_loss`): its compiles would double the test's
time, and it reads but does not restore the state checked here. The resumed run takes no step on the new
mesh (step 1 is its last): that would cost another compile, and the state it would start from is what is
checked here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import make_tiny_shards, require, saved_smollm2_tokenizer
from jax.sharding import PartitionSpec

from configs import tiny
from empatheia_jax import sharding
from empatheia_jax.data.shard_format import load_manifest
from empatheia_jax.serve import load as serve_load
from empatheia_jax.train import checkpoint as train_checkpoint
from empatheia_jax.train import config as config_lib
from empatheia_jax.train import init, stages, trainer
from empatheia_jax.train import step as step_lib
from empatheia_jax.train.checkpoint import TrainCheckpointer

require(len(jax.devices()) == 8, f"needs the 8 fake CPU devices tests/conftest.py sets up, found "
        f"{len(jax.devices())}")

STAGE = "coe"  # the cheapest stage to compile; its optimizer state covers the LoRA factors

Leaf = tuple[np.ndarray, Any]  # (host copy, the array's sharding)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return saved_smollm2_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_tiny_shards(tmp_path_factory.mktemp("cross_mesh_data"))


def tiny_config(tok: str, shards: Path, data: int, fsdp: int, tensor: int) -> Any:
    c = tiny.get_config()
    c.model.tokenizer = str(tok)
    c.data.shards = str(shards)
    c.stage = STAGE
    c.schedule[STAGE].steps = 1
    c.schedule[STAGE].warmup_steps = 0  # else the one step has lr 0 and moves nothing but the moments
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = data, fsdp, tensor
    return c


def snapshot(state: nnx.State) -> dict[str, Leaf]:
    """{"path/to/leaf": (host copy, sharding)}; copies, because the jitted step donates its inputs."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        out["/".join(map(str, path))] = (np.array(jax.device_get(value), copy=True), value.sharding)
    return out


def assert_same_bytes(got: dict[str, Leaf], want: dict[str, Leaf], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ: {sorted(got.keys() ^ want.keys())[:5]}"
    for k, (value, _) in got.items():
        ref = want[k][0]
        assert (value.dtype, value.shape) == (ref.dtype, ref.shape), f"{what} {k}"
        assert value.tobytes() == ref.tobytes(), f"{what} {k}: not bit-identical to the saved step"


def is_split(s: Any, shape: tuple[int, ...]) -> bool:
    return tuple(s.shard_shape(shape)) != tuple(shape)


@pytest.fixture(scope="module")
def saved_run(tok, shards, tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """The data=8 run's workdir, and the values and shardings `TrainCheckpointer.save` got for step 1."""
    workdir = tmp_path_factory.mktemp("data8")
    saves: dict[int, dict[str, Any]] = {}
    real_save = TrainCheckpointer.save

    def save(self, step, *, params, opt_state, data_state, **kw):
        saves[int(step)] = {"params": snapshot(params), "opt_state": snapshot(opt_state),
                            "data_state": json.loads(json.dumps(data_state))}
        return real_save(self, step, params=params, opt_state=opt_state, data_state=data_state, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TrainCheckpointer, "save", save)
        mp.setattr(step_lib, "evaluate_loss", lambda *a, **k: {})
        result = trainer.train(tiny_config(tok, shards, 8, 1, 1), workdir)
    assert result.status == "completed" and sorted(saves) == [1]
    saved = saves[1]
    for item in ("params", "opt_state"):  # the saved layout: data=8 splits no parameter or optimizer leaf
        assert not any(is_split(s, v.shape) for v, s in saved[item].values())
    counters = [v for k, (v, _) in saved["opt_state"].items() if k.rsplit("/", 1)[-1] in ("step", "count")]
    assert counters and all(int(v) == 1 for v in counters)
    # LoRA B starts at 0, so A's gradient and moments are 0 after one step; B's are not.
    b_moments = [v for k, (v, _) in saved["opt_state"].items() if "lora_b" in k and "/mu/" in k]
    assert b_moments and all(np.any(v) for v in b_moments)
    return workdir, saved


def test_resume_on_fsdp4_x_tensor2_restores_every_leaf_on_the_new_mesh(saved_run, tok, shards, tmp_path):
    workdir, saved = saved_run
    resumed = tmp_path / "run"
    shutil.copytree(workdir, resumed)
    mesh = sharding.make_mesh(1, 4, 2)  # the trainer's mesh for this config (same devices, same order)
    seen: dict[str, Any] = {}
    real_restore, real_split = TrainCheckpointer.restore, stages.split_for_step

    def restore(self, *a, **k):
        seen["restored"] = r = real_restore(self, *a, **k)
        return r

    def split_for_step(model, optimizer, stage):  # called once, after the restore, before any step
        params = init.saved_state(model, include_backbone=True)
        seen["params"], seen["opt_state"] = snapshot(params), snapshot(nnx.state(optimizer))
        seen["rules"] = {"/".join(map(str, p)): s.get_value()
                         for p, s in nnx.to_flat_state(sharding.state_shardings(params, mesh))}
        return real_split(model, optimizer, stage)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TrainCheckpointer, "restore", restore)
        mp.setattr(stages, "split_for_step", split_for_step)
        mp.setattr(step_lib, "evaluate_loss", lambda *a, **k: {})
        result = trainer.train(tiny_config(tok, shards, 1, 4, 2), resumed)
    assert result.status == "completed" and result.step == 1

    restored = seen["restored"]
    assert restored.step == 1 and restored.meta["step"] == 1
    assert restored.data_state == saved["data_state"]
    assert restored.meta["config"]["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}  # really another mesh
    for item in ("params", "opt_state"):
        held = seen[item]
        assert_same_bytes(held, saved[item], f"{item} after the resume on fsdp=4 x tensor=2")
        for k, (value, got) in held.items():
            assert got.mesh == mesh, f"{item} {k} is on {got}, not on the fsdp=4 x tensor=2 mesh"
            if is_split(got, value.shape):  # ... where the saved arrays were whole on every device
                assert not got.is_equivalent_to(saved[item][k][1], value.ndim), f"{item} {k}"
    for k, want in seen["rules"].items():  # parameters: the logical-axis rules' layout on the new mesh
        value, got = seen["params"][k]
        assert got.is_equivalent_to(want, value.ndim), f"params {k}: {got.spec}, the rules say {want.spec}"
    split = {item: sum(is_split(s, v.shape) for v, s in seen[item].values())
             for item in ("params", "opt_state")}
    assert split["params"] > 10 and split["opt_state"] > 2, split  # lora A/B and their moments are split
    specs = [str(s.spec) for _, s in seen["params"].values() if s.spec != PartitionSpec()]
    assert any("tensor" in s for s in specs) and any("fsdp" in s for s in specs)


def test_trainer_restore_onto_one_device(saved_run, tok, shards):
    """The trainer's resume calls on a one-device mesh of the last device: a restore that landed on the
    default device, or stayed on all eight, fails."""
    workdir, saved = saved_run
    config = tiny_config(tok, shards, 1, 1, 1)
    device = jax.devices()[-1]
    mesh = sharding.make_mesh(1, 1, 1, devices=[device])
    model, _ = init.build_model(config, load_manifest(config.data.shards), mesh)
    tx, _ = init.make_tx(config, config_lib.stage_schedule(config))
    with jax.set_mesh(mesh):
        optimizer = stages.make_optimizer(model, config_lib.resolve_stage(config), tx)
    with TrainCheckpointer(workdir / train_checkpoint.CHECKPOINT_DIR, create=False, async_save=False) as ckpt:
        restored = ckpt.restore(params=init.saved_state(model, True), opt_state=nnx.state(optimizer))
    nnx.update(model, restored.params)
    nnx.update(optimizer, restored.opt_state)
    assert restored.step == 1 and restored.data_state == saved["data_state"]
    for item, state in (("params", init.saved_state(model, True)), ("opt_state", nnx.state(optimizer))):
        held = snapshot(state)
        assert_same_bytes(held, saved[item], f"{item} on one device")
        for k, (_, s) in held.items():
            assert s.device_set == {device}, f"{item} {k} is on {s.device_set}, not on {device}"


def test_load_trained_reads_the_data8_checkpoint_onto_one_device(saved_run):
    """`empatheia eval` / `chat` load through `load_trained`: a host model, on the default device."""
    workdir, saved = saved_run
    model = serve_load.load_trained(workdir)[0]
    held = snapshot(nnx.state(model, nnx.Param))
    assert_same_bytes(held, saved["params"], "load_trained")
    for k, (_, s) in held.items():
        assert s.device_set == {jax.devices()[0]}, f"{k} is on {s.device_set}"
