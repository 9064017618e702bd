"""Training checkpoints (empatheia_jax/train/checkpoint.py): exact round trips, keep policy, sharded restore,
clear errors, atomicity under SIGKILL, and the preemption flag (also agreed by two real processes).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import skip_or_fail
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from empatheia_jax.train.checkpoint import (
    CheckpointError,
    PreemptionWatcher,
    TrainCheckpointer,
    read_meta,
    resolve_checkpoint,
    stage_finished,
)

REPO = Path(__file__).resolve().parents[1]


class Tiny(nnx.Module):
    def __init__(self, width: int = 8, *, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.inp = nnx.Linear(4, width, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x.sum()


def trained(seed: int = 0, width: int = 8) -> tuple[Tiny, nnx.Optimizer]:
    """A model and an adamw optimizer after two updates, so every optimizer leaf is non-trivial."""
    model = Tiny(width, seed=seed)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    x = jnp.ones((3, 4))
    for _ in range(2):
        grads = nnx.grad(lambda m: m(x))(model)
        opt.update(model, grads)
    return model, opt


def states(model, opt):
    return nnx.state(model, nnx.Param), nnx.state(opt)


def leaves_identical(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )


def save_simple(ck: TrainCheckpointer, step: int, metrics=None, value: float = 0.0) -> bool:
    params = {"w": jnp.full((4,), value, jnp.float32)}
    return ck.save(step, params=params, opt_state=None, data_state={"pos": step}, meta={}, metrics=metrics)


SIMPLE_TARGET = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}


# ----------------------------------------------------------------------------------------------------------
# Round trips
# ----------------------------------------------------------------------------------------------------------


def test_round_trip_is_bit_identical(tmp_path):
    model, opt = trained()
    params, opt_state = states(model, opt)
    data_state = {"next_index": 17, "epoch": 1, "nested": {"a": [1, 2]}}
    meta = {"config": {"lr": 0.01, "stage": "sft"}, "tokens_seen": 1234}
    with TrainCheckpointer(tmp_path / "ck") as ck:
        assert ck.save(10, params=params, opt_state=opt_state, data_state=data_state, meta=meta)
        assert ck.latest_step() == 10  # visible while in flight; restore waits for it

        # Live targets with other values: restored values come from the checkpoint, targets stay as they were.
        other_model, other_opt = trained(seed=1)
        t_params, t_opt = states(other_model, other_opt)
        before = jax.tree.map(np.asarray, (t_params, t_opt))
        r = ck.restore(params=t_params, opt_state=t_opt)
        assert r.step == 10
        assert type(r.params) is type(params) and type(r.opt_state) is type(opt_state)
        assert jax.tree.structure(r.params) == jax.tree.structure(params)
        assert jax.tree.structure(r.opt_state) == jax.tree.structure(opt_state)
        assert leaves_identical(r.params, params) and leaves_identical(r.opt_state, opt_state)
        assert leaves_identical((t_params, t_opt), before)
        assert r.data_state == data_state
        assert r.meta == {**meta, "step": 10}

        # Abstract targets (nnx.eval_shape), the usual way to resume; the result drops into a model.
        abs_model = nnx.eval_shape(lambda: Tiny())
        abs_opt = nnx.eval_shape(lambda: nnx.Optimizer(Tiny(), optax.adamw(1e-2), wrt=nnx.Param))
        r2 = ck.restore(10, params=nnx.state(abs_model, nnx.Param), opt_state=nnx.state(abs_opt))
        assert leaves_identical(r2.params, params) and leaves_identical(r2.opt_state, opt_state)
        nnx.update(other_model, r2.params)
        assert float(other_model(jnp.ones((3, 4)))) == float(model(jnp.ones((3, 4))))

        # opt_state not requested -> None
        assert ck.restore(params=t_params).opt_state is None


def test_rng_streams_round_trip(tmp_path):
    """A full nnx.state(model) with RNG streams (typed PRNG keys) restores exactly, so dropout resumes too."""

    class WithDropout(nnx.Module):
        def __init__(self, seed: int):
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(seed))
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=seed))

    model = WithDropout(1)
    model.drop(jnp.ones(4))  # advance the stream: count 1, key still the seed's
    state = nnx.state(model)
    with TrainCheckpointer(tmp_path) as ck:
        ck.save(1, params=state, opt_state=None, data_state=None, meta={})
        for target in (nnx.state(WithDropout(5)), nnx.state(nnx.eval_shape(lambda: WithDropout(5)))):
            r = ck.restore(params=target)
            got, want = nnx.to_pure_dict(r.params), nnx.to_pure_dict(state)
            assert jax.dtypes.issubdtype(got["drop"]["rngs"]["key"].dtype, jax.dtypes.prng_key)
            assert np.array_equal(jax.random.key_data(got["drop"]["rngs"]["key"]),
                                  jax.random.key_data(want["drop"]["rngs"]["key"]))
            assert int(got["drop"]["rngs"]["count"]) == 1
            assert np.array_equal(got["lin"]["kernel"], want["lin"]["kernel"])


def test_save_skips_existing_and_older_steps(tmp_path):
    with TrainCheckpointer(tmp_path, async_save=True) as ck:
        assert save_simple(ck, 5)
        assert not save_simple(ck, 5)  # in flight: still skipped, no crash
        ck.wait_until_finished()
        assert not save_simple(ck, 5)  # resume from 5, preempted at 5 again
        assert not save_simple(ck, 3)  # older than the latest
        assert ck.save(3, params={"w": jnp.ones(4)}, opt_state=None, data_state=None, meta={}, force=True)
        assert ck.all_steps() == [3, 5] and ck.latest_step() == 5
        r = ck.restore(3, params=SIMPLE_TARGET)
        assert r.data_state is None and r.meta == {"step": 3}
        with pytest.raises(ValueError, match="meta"):
            ck.save(6, params={"w": jnp.ones(4)}, opt_state=None, data_state=None, meta={"step": 7})
        with pytest.raises(TypeError, match="data_state"):
            ck.save(6, params={"w": jnp.ones(4)}, opt_state=None, data_state={"x": object()}, meta={})


def test_read_meta_without_a_model(tmp_path):
    with TrainCheckpointer(tmp_path) as ck:
        ck.save(1, params={"w": jnp.ones(4)}, opt_state=None, data_state=None, meta={"stage": "a"})
        ck.save(2, params={"w": jnp.ones(4)}, opt_state=None, data_state=None, meta={"stage": "b"})
    assert read_meta(tmp_path) == (2, {"stage": "b", "step": 2})
    assert read_meta(tmp_path, 1) == (1, {"stage": "a", "step": 1})
    with pytest.raises(CheckpointError, match="no complete step 7"):
        read_meta(tmp_path, 7)
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        read_meta(tmp_path / "absent")


def test_stage_finished_needs_a_saved_step_at_the_schedules_last(tmp_path):
    """A workdir's stage is finished when a complete step reaches its config.json's schedule steps: not before
    its first save, nor when only an interrupted write of the last step is there (the trainer exits 0 after a
    preemption too, so a chain of stages asks this)."""
    assert not stage_finished(tmp_path, "coe")  # no config.json: the trainer never started
    schedule = {"coe": {"steps": 4}, "ccl": {"steps": 2}}
    (tmp_path / "config.json").write_text(json.dumps({"schedule": schedule}))
    assert not stage_finished(tmp_path, "coe")
    with TrainCheckpointer(tmp_path / "checkpoints") as ck:
        ck.save(2, params={"w": jnp.ones(4)}, opt_state=None, data_state=None, meta={"stage": "coe"})
    (tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-0").mkdir()
    assert not stage_finished(tmp_path, "coe") and stage_finished(tmp_path, "ccl")


# ----------------------------------------------------------------------------------------------------------
# Keep policy
# ----------------------------------------------------------------------------------------------------------


def test_keep_last_k_and_best(tmp_path):
    losses = {1: 0.9, 2: 0.1, 3: 0.5, 4: None, 5: float("nan"), 6: 0.7, 7: None}
    with TrainCheckpointer(tmp_path, keep=2, keep_best=True) as ck:
        for step, loss in losses.items():
            metrics = None if loss is None else {"eval/total": loss, "train/loss": 1.0}
            assert save_simple(ck, step, metrics)
        ck.wait_until_finished()
        assert ck.all_steps() == [2, 6, 7]
        assert ck.best_step() == 2
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 6, 7]
    with TrainCheckpointer(tmp_path, keep=2, keep_best=True) as ck:  # a resumed run sees the same
        assert ck.all_steps() == [2, 6, 7] and ck.best_step() == 2
        save_simple(ck, 8, {"eval/total": 0.05})
        ck.wait_until_finished()
        assert ck.all_steps() == [7, 8] and ck.best_step() == 8


def test_keep_best_max_mode_and_steps_without_metrics(tmp_path):
    kw = dict(keep=1, keep_best=True, best_metric="acc", best_mode="max")
    with TrainCheckpointer(tmp_path / "max", **kw) as ck:
        for step, acc in [(1, 0.2), (2, 0.8), (3, 0.5), (4, 0.1)]:
            save_simple(ck, step, {"acc": acc})
        ck.wait_until_finished()
        assert ck.all_steps() == [2, 4] and ck.best_step() == 2
    with TrainCheckpointer(tmp_path / "none", keep=2, keep_best=True) as ck:  # never any metric: last K only
        for step in range(1, 5):
            save_simple(ck, step, {"other": 1.0} if step % 2 else None)
        ck.wait_until_finished()
        assert ck.all_steps() == [3, 4] and ck.best_step() is None
    with TrainCheckpointer(tmp_path / "last", keep=2) as ck:  # keep_best off: metrics do not keep a step
        for step, loss in [(1, 0.1), (2, 0.5), (3, 0.6)]:
            save_simple(ck, step, {"eval/total": loss})
        ck.wait_until_finished()
        assert ck.all_steps() == [2, 3]


# ----------------------------------------------------------------------------------------------------------
# Sharding and donation
# ----------------------------------------------------------------------------------------------------------


def test_restore_into_sharded_target(tmp_path):
    if len(jax.devices()) != 8:
        skip_or_fail(f"needs the 8 fake CPU devices tests/conftest.py sets up, found {len(jax.devices())}")
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    model, opt = trained(width=16)
    params, opt_state = states(model, opt)
    with TrainCheckpointer(tmp_path) as ck:
        ck.save(1, params=params, opt_state=opt_state, data_state=None, meta={})

        def spec(x):
            return PartitionSpec("fsdp", "data") if x.ndim == 2 else PartitionSpec()

        def abstract(x, dtype=None):
            return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=NamedSharding(mesh, spec(x)))

        # Abstract target: restored arrays take its sharding (and dtype: bfloat16 params here).
        t_params = jax.tree.map(lambda x: abstract(x, jnp.bfloat16), params)
        t_opt = jax.tree.map(abstract, opt_state)
        r = ck.restore(params=t_params, opt_state=t_opt)
        for got, want in zip(jax.tree.leaves(r.params), jax.tree.leaves(t_params), strict=True):
            assert got.sharding == want.sharding and got.dtype == jnp.bfloat16
        kernel = r.params["layers"][0]["kernel"].value
        assert len({str(s.index) for s in kernel.addressable_shards}) == 8  # really split, not replicated
        assert np.array_equal(np.asarray(kernel), np.asarray(params["layers"][0]["kernel"].value
                                                              .astype(jnp.bfloat16)))
        assert leaves_identical(r.opt_state, opt_state)

        # Live sharded target.
        live = jax.tree.map(lambda x: jax.device_put(jnp.zeros_like(x), NamedSharding(mesh, spec(x))), params)
        r = ck.restore(params=live)
        assert leaves_identical(r.params, params)
        for got, want in zip(jax.tree.leaves(r.params), jax.tree.leaves(live), strict=True):
            assert got.sharding == want.sharding


def test_donating_after_async_save_does_not_corrupt_it(tmp_path):
    """save() returns once arrays are on the host: a donated (in-place) step right after is safe."""
    params = {"w": jnp.asarray(np.random.default_rng(0).random((512, 1024), np.float32))}
    expected = np.asarray(params["w"]).copy()
    step_fn = jax.jit(lambda p: jax.tree.map(lambda x: x * 0 + 7.0, p), donate_argnums=0)
    with TrainCheckpointer(tmp_path, async_save=True) as ck:
        ck.save(1, params=params, opt_state=None, data_state=None, meta={})
        for _ in range(3):
            params = step_fn(params)
        ck.wait_until_finished()
        r = ck.restore(params={"w": jax.ShapeDtypeStruct((512, 1024), jnp.float32)})
    assert np.array_equal(np.asarray(r.params["w"]), expected)


# ----------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------


def test_shape_or_key_mismatch_names_the_key(tmp_path):
    model, opt = trained(width=8)
    with TrainCheckpointer(tmp_path) as ck:
        ck.save(1, params=nnx.state(model, nnx.Param), opt_state=nnx.state(opt), data_state=None, meta={})
        wide = nnx.state(nnx.eval_shape(lambda: Tiny(16)), nnx.Param)
        with pytest.raises(CheckpointError) as e:
            ck.restore(params=wide)
        msg = str(e.value)
        assert "inp.bias" in msg and "(8,)" in msg and "(16,)" in msg
        assert str(tmp_path / "1" / "params") in msg

        extra = {"inp": {"kernel": jax.ShapeDtypeStruct((4, 8), jnp.float32)},
                 "head": {"kernel": jax.ShapeDtypeStruct((8, 2), jnp.float32)}}
        with pytest.raises(CheckpointError, match=r"'head\.kernel'.*not in the checkpoint"):
            ck.restore(params=extra)
        with pytest.raises(CheckpointError, match="no complete step 2"):
            ck.restore(2, params=wide)


def test_missing_directory_or_steps(tmp_path):
    with TrainCheckpointer(tmp_path / "absent", create=False) as ck:
        assert ck.latest_step() is None and ck.best_step() is None
        with pytest.raises(CheckpointError, match="absent"):
            ck.restore(params=SIMPLE_TARGET)
    (tmp_path / "empty").mkdir()
    with TrainCheckpointer(tmp_path / "empty") as ck, pytest.raises(CheckpointError, match="no complete"):
        ck.restore(params=SIMPLE_TARGET)
    with TrainCheckpointer(tmp_path / "no_opt") as ck:
        save_simple(ck, 1)
        with pytest.raises(CheckpointError, match="opt_state"):
            ck.restore(params=SIMPLE_TARGET, opt_state=SIMPLE_TARGET)


# On a failed read orbax leaves the sibling arrays' read coroutines unawaited; Python reports them when they
# are collected (noise from orbax's error path, not ours), hence the filter and the gc.collect() at the end.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_step_names_the_step_and_array(tmp_path):
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.random((256, 256), np.float32)), "b": jnp.zeros((8,))}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    with TrainCheckpointer(tmp_path, async_save=False) as ck:
        ck.save(3, params=params, opt_state=None, data_state=None, meta={})
        ck.save(4, params=params, opt_state=None, data_state=None, meta={})
    # The largest data file holds the chunk of "a": metadata still reads, the array read fails.
    files = [p for p in (tmp_path / "3" / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    max(files, key=lambda p: p.stat().st_size).unlink()
    (tmp_path / "4" / "params" / "_METADATA").unlink()
    with TrainCheckpointer(tmp_path) as ck:
        with pytest.raises(CheckpointError) as e:
            ck.restore(3, params=target)
        assert str(tmp_path / "3") in str(e.value) and "['a']" in str(e.value)
        with pytest.raises(CheckpointError) as e:
            ck.restore(4, params=target)
        assert str(tmp_path / "4") in str(e.value) and "_METADATA" in str(e.value)
    del e
    gc.collect()


# ----------------------------------------------------------------------------------------------------------
# Atomicity: a writer killed mid-write leaves the previous step as the latest, and it restores
# ----------------------------------------------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys
    import jax.numpy as jnp, numpy as np
    from empatheia_jax.train.checkpoint import TrainCheckpointer
    ck = TrainCheckpointer(sys.argv[1], async_save=True)
    ck.save(1, params={"w": jnp.arange(4.0)}, opt_state=None, data_state={"pos": 1}, meta={})
    ck.wait_until_finished()
    big = jnp.asarray(np.random.default_rng(0).random(50_000_000, np.float32))  # 200 MB, incompressible
    ck.save(2, params={"w": big}, opt_state=None, data_state={"pos": 2}, meta={})
    ck.wait_until_finished()
    print("finished", flush=True)
""")


def bytes_under(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):  # tolerant of folders renamed or removed while walking
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


def test_killed_writer_leaves_previous_step(tmp_path):
    ckdir = tmp_path / "ck"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), "XLA_FLAGS": ""}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(ckdir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            tmps = list(ckdir.glob("2.orbax-checkpoint-tmp*"))
            if tmps and bytes_under(tmps[0]) > 16 << 20:  # array data being written: kill mid-write
                break
            time.sleep(0.002)
        assert proc.poll() is None, proc.communicate()
        assert not (ckdir / "2").exists(), "the writer finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert list(ckdir.glob("2.orbax-checkpoint-tmp*")) and not (ckdir / "2").exists()
    assert read_meta(ckdir) == (1, {"step": 1})
    assert resolve_checkpoint(ckdir) == (ckdir, 1)
    with TrainCheckpointer(ckdir, create=False) as ck:  # a reader: sees step 1, leaves the folder alone
        assert ck.all_steps() == [1]
        assert ck.restore(params={"w": jax.ShapeDtypeStruct((4,), jnp.float32)}).data_state == {"pos": 1}
    assert list(ckdir.glob("2.orbax-checkpoint-tmp*"))
    with TrainCheckpointer(ckdir) as ck:
        assert ck.all_steps() == [1] and ck.latest_step() == 1
        r = ck.restore(params={"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
        assert r.step == 1 and np.array_equal(np.asarray(r.params["w"]), np.arange(4.0))
        assert r.data_state == {"pos": 1}
    assert not list(ckdir.glob("*.orbax-checkpoint-tmp*"))  # the new writer cleaned the leftover up


# ----------------------------------------------------------------------------------------------------------
# --init_from
# ----------------------------------------------------------------------------------------------------------


def test_resolve_checkpoint(tmp_path):
    ckdir = tmp_path / "checkpoints"
    with TrainCheckpointer(ckdir) as ck:
        save_simple(ck, 60)
        save_simple(ck, 120)
    assert resolve_checkpoint(ckdir) == (ckdir, 120)
    assert resolve_checkpoint(str(ckdir / "60")) == (ckdir, 60)
    (ckdir / "180.orbax-checkpoint-tmp-123").mkdir()
    assert resolve_checkpoint(ckdir) == (ckdir, 120)
    with pytest.raises(CheckpointError, match="interrupted"):
        resolve_checkpoint(ckdir / "180.orbax-checkpoint-tmp-123")
    with pytest.raises(CheckpointError, match="no such file"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no step folders"):
        resolve_checkpoint(tmp_path)  # the workdir, not the checkpoint directory
    with pytest.raises(CheckpointError, match="no step folders"):
        resolve_checkpoint(ckdir / "60" / "params")


# ----------------------------------------------------------------------------------------------------------
# Preemption
# ----------------------------------------------------------------------------------------------------------


def test_preemption_watcher_sets_flag_and_restores_handlers():
    before_term, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with PreemptionWatcher() as w:
        assert not w.requested(0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the Python-level handler runs at the next bytecode boundary
        assert w.requested(1) and w.requested(2)  # sticky
        assert w.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before_term and signal.getsignal(signal.SIGINT) == before_int

    w = PreemptionWatcher(signals=(signal.SIGTERM, signal.SIGINT))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert w.requested(0) and w.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C still stops the run
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    finally:
        w.restore_handlers()
    assert signal.getsignal(signal.SIGINT) == before_int


MULTI = textwrap.dedent("""
    import json, os, signal, sys, time
    import jax
    pid, port = int(sys.argv[1]), sys.argv[2]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
    from empatheia_jax.train.checkpoint import PreemptionWatcher
    flags = []
    with PreemptionWatcher() as w:
        for step in range(5):
            if pid == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)
            flags.append(w.requested(step))
    print(json.dumps({"flags": flags, "received": w.received}), flush=True)
    jax.distributed.shutdown()
""")


def test_preemption_agreed_by_all_processes():
    """Two real processes (localhost, CPU collectives): a SIGTERM to one stops both at the same step."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), "XLA_FLAGS": ""}
    procs = [subprocess.Popen([sys.executable, "-c", MULTI, str(i), str(port)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert [o["flags"] for o in outs] == [[False, False, True, True, True]] * 2
    assert outs[0]["received"] is None and outs[1]["received"] == signal.SIGTERM
