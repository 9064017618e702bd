"""A real 2-process `jax.distributed` run on localhost (CPU devices, gloo collectives) through
`empatheia train` (the launch scripts are checked in tests/test_launchers.py).

Three runs of the `tiny` config (stage coe, 6 steps, global batch 2 = 1 per process, mesh data=1 x fsdp=2),
each a `python driver.py` that runs the real CLI (`empatheia_jax.cli.main`). The model is built and placed by
the real `init.build_model(config, manifest, mesh)`: across the two processes `sharding.shard_model` cuts
each process's shards of the fsdp-split parameters from its host copy, so no process holds those whole. The
driver only observes: a few trainer functions are wrapped to record this process's shards of the parameters
(at the start and after every step), each step's record indices, the metrics, the batch lengths:

1. **two processes** (`--config.distributed.initialize=True`, explicit coordinator on a free localhost port,
   one CPU device each), SIGTERMed on process 1 only after a few steps: the preemption poll is collective,
   so both save the same step and exit 0 ("preempted");
2. the same two processes again on the same workdir: they resume from that checkpoint and finish;
3. **one process with two devices** (same mesh) reading both processes' grain slices concatenated in
   process order, i.e. the same global batch at every step, uninterrupted (the reference; runs beside run 1).

Checked: `jax.process_count()` is 2 inside the runs; the fsdp-split parameters are held half by each
process and the rest by both; wherever both hold an element it is bit-identical, after every step and at the
end, and together they equal the one-process run at the start, after every step and at the end; the
parameters moved; the processes' records are disjoint and each epoch is covered once; the resumed processes
continue at exactly the records and parameters of the uninterrupted reference; the final eval metrics agree.
(A converted backbone instead, `--config.model.backbone`, takes build_model's in-shards path,
`load_checkpoint(mesh=)` + `from_llm`'s shapes-only build, tested on one process over 8 devices in
test_trainer.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import make_tiny_shards, saved_smollm2_tokenizer, xla_flags

REPO = Path(__file__).resolve().parents[1]
STEPS = 6  # one epoch of the 12 training records: 6 per process, one per step
DEADLINE_S = 300  # per phase: a hang (a process waiting on a dead peer) fails instead of blocking CI

# Runs `empatheia train` in this process and records, under OUT: params_<tag>.npz (this process's shards of
# every nnx.Param, NaN elsewhere, at the end and at the start), steps_<tag>.npz (the same of the trained
# parameters after each step) and info_<tag>.json (process/device counts, per-step record indices and
# metrics, each parameter's PartitionSpec, the result).
DRIVER = r'''
import json
import sys
from pathlib import Path

import numpy as np

out, tag, mode, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]

import jax
from flax import nnx

from empatheia_jax import cli
from empatheia_jax.train import distributed, pipelines, stages, trainer
from empatheia_jax.train import step as step_lib
from empatheia_jax.data.batching import TOKEN_KEYS
from empatheia_jax.data.input_pipeline import make_dataset

rec = {"model": None, "init": {}, "shardings": {}, "records": [], "metrics": [], "steps": {}, "lengths": [],
       "global_shapes": []}


def local_copy(state):
    """{path: this process's copy, NaN where it holds no shard}. Under the fsdp axis a parameter is cut
    across the processes, so each holds part of it; the test puts the parts together and checks that
    where both hold an element they agree bit for bit."""
    flat = {}
    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Param):
            continue
        x = var.get_value()
        full = np.full(x.shape, np.nan, np.float32)
        for shard in x.addressable_shards:
            full[shard.index] = np.array(shard.data, copy=True)
        flat["/".join(map(str, path))] = full
    return flat


_split_for_step = stages.split_for_step


def split_for_step(model, optimizer, stage):  # an observer: the model init.build_model really built
    rec["model"] = model
    rec["init"] = local_copy(nnx.state(model, nnx.Param))
    rec["shardings"] = {"/".join(map(str, p)): str(v.get_value().sharding.spec)
                        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return _split_for_step(model, optimizer, stage)


_step_batch = pipelines.step_batch


def step_batch(batch, mesh, grad_accum):
    rec["records"].append(np.asarray(batch["record_index"]).tolist())
    return _step_batch(batch, mesh, grad_accum)


_agree = distributed.agree_on_length


def agree_on_length(batch, pad_id):  # every train and eval batch: (its own length, the agreed one)
    out = _agree(batch, pad_id)
    rec["lengths"].append([batch["input_ids"].shape[1], out["input_ids"].shape[1]])
    return out


_make_global_batch = pipelines.make_global_batch


def make_global_batch(batch, sharding, **kwargs):
    out = _make_global_batch(batch, sharding, **kwargs)
    rec["global_shapes"].append(list(out["input_ids"].shape))
    return out


_jit_step = step_lib.jit_step


def jit_step(*args, **kwargs):
    step = _jit_step(*args, **kwargs)

    def recorded(graphs, params, frozen, opt_state, batch, key):
        new_params, new_opt, metrics = step(graphs, params, frozen, opt_state, batch, key)
        rec["steps"][len(rec["metrics"])] = local_copy(new_params)  # copied before the next step donates
        rec["metrics"].append({k: float(v) for k, v in jax.device_get(metrics).items()})
        return new_params, new_opt, metrics

    return recorded


def pad(batch, length, pad_id):
    extra = length - batch["input_ids"].shape[1]
    if not extra:
        return batch
    out = dict(batch)
    for k in TOKEN_KEYS:
        out[k] = np.pad(batch[k], ((0, 0), (0, extra)), constant_values=pad_id if k.endswith("_ids") else 0)
    out["positions"][:, -extra:] = np.arange(length - extra, length, dtype=np.int32)
    return out


class BothSlices:
    """The reference's pipeline: process 0's and process 1's grain slices (of 2), concatenated per step."""

    def __init__(self, config, stage, model, tok):
        self.pipes = [
            make_dataset(config.data.shards, config.data.train_split, stage.template_stage, tok,
                         batch_size=config.train.batch_size // 2, seed=config.seed, shuffle=True,
                         window_batches=int(config.data.window_batches), process_index=p, process_count=2,
                         **pipelines.pipeline_fields(config, stage, model))
            for p in range(2)
        ]
        self.pad_id = self.pipes[0].pad_id

    def __iter__(self):
        self.its = [iter(p) for p in self.pipes]
        return self

    def __next__(self):
        parts = [next(it) for it in self.its]
        length = max(p["input_ids"].shape[1] for p in parts)
        parts = [pad(p, length, self.pad_id) for p in parts]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def get_state(self):
        return self.its[0].get_state()


_train = trainer.train


def train(config, workdir):
    result = _train(config, workdir)
    first = result.step - len(rec["metrics"])  # a resumed run starts at its checkpoint's step
    final = local_copy(nnx.state(rec["model"], nnx.Param))
    np.savez(out / f"params_{tag}.npz", **{"final/" + k: v for k, v in final.items()},
             **{"init/" + k: v for k, v in rec["init"].items()})
    np.savez(out / f"steps_{tag}.npz",
             **{f"{first + i}/{k}": v for i, flat in rec["steps"].items() for k, v in flat.items()})
    info = {
        "process_index": jax.process_index(), "process_count": jax.process_count(),
        "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
        "first_step": first, "records": rec["records"], "metrics": rec["metrics"],
        "status": result.status, "step": result.step, "eval": result.eval_metrics,
        "lengths": rec["lengths"], "global_shapes": rec["global_shapes"], "shardings": rec["shardings"],
    }
    (out / f"info_{tag}.json").write_text(json.dumps(info))
    return result


stages.split_for_step, pipelines.step_batch = split_for_step, step_batch
step_lib.jit_step, trainer.train = jit_step, train
distributed.agree_on_length, pipelines.make_global_batch = agree_on_length, make_global_batch
if mode == "reference":
    pipelines.make_train_pipeline = BothSlices
cli.main(["empatheia", "train", *argv])
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def env_with(devices: int, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "SLURM_"))}
    env.update(
        # the resumed processes reuse the programs compiled by the first ones (model init, step, eval)
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PLATFORMS="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
        # small programs: XLA's backend optimisation costs more compile time than it saves
        XLA_FLAGS=xla_flags(devices),
    )
    return env


class Procs:
    """Subprocesses started in their own sessions; `finish` waits under one deadline, the context kills
    whatever is still running (a failed or hung phase never leaves processes behind)."""

    def __init__(self, logs: Path):
        self.logs, self.procs = logs, {}

    def start(self, name: str, args: list[str], devices: int) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("w") as log:
            p = subprocess.Popen(
                args,
                env=env_with(devices, self.logs / "jax_cache"),
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed whole on failure
            )
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def tail(self, name: str) -> str:
        text = "\n".join(
            line
            for line in self.log(name).splitlines()
            if not re.match(r"[IWE]\d{4} ", line)  # absl noise
        )
        return f"---- {name} ----\n{text[-4000:]}"

    def finish(self, names, deadline: float) -> None:
        for name in names:
            p = self.procs[name]
            try:
                p.wait(timeout=max(deadline - time.time(), 1))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"{name} still running at the deadline\n" + "\n".join(map(self.tail, names)))
        bad = [n for n in names if self.procs[n].returncode != 0]
        if bad:
            self.kill()
            pytest.fail(f"{bad} exited non-zero\n" + "\n".join(map(self.tail, names)))

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def load(out: Path, tag: str):
    info = json.loads((out / f"info_{tag}.json").read_text())
    steps: dict[int, dict[str, np.ndarray]] = {}
    with np.load(out / f"steps_{tag}.npz") as z:
        for key in z.files:
            step, name = key.split("/", 1)
            steps.setdefault(int(step), {})[name] = z[key]
    with np.load(out / f"params_{tag}.npz") as z:
        params = {k: z[k] for k in z.files}
    return info, steps, params


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tok = saved_smollm2_tokenizer(tmp_path_factory)
    shards = make_tiny_shards(tmp_path_factory.mktemp("multihost_data"))
    root = tmp_path_factory.mktemp("multihost")
    driver = root / "driver.py"
    driver.write_text(DRIVER)
    workdir, refdir = root / "run", root / "reference"
    common = [
        "--config", str(REPO / "configs" / "tiny.py"),
        f"--config.model.tokenizer={tok}",
        f"--config.data.shards={shards}",
        "--config.stage=coe",
        f"--config.schedule.coe.steps={STEPS}",
        "--config.train.batch_size=2",
        "--config.data.window_batches=6",  # a window = one epoch of a process's slice (6 records)
        "--config.mesh.data=1",
        "--config.mesh.fsdp=2",  # the parameters are cut across the two processes
        "--config.checkpoint.every=1000",
    ]  # fmt: skip

    def two_process_args(i: int, port: int, tag: str) -> list[str]:
        return [
            sys.executable, str(driver), str(root), f"{tag}{i}", "distributed", *common,
            f"--workdir={workdir}",
            "--config.distributed.initialize=True",
            f"--config.distributed.coordinator_address=localhost:{port}",
            "--config.distributed.num_processes=2",
            f"--config.distributed.process_id={i}",
            "--config.distributed.cpu_collectives=gloo",
        ]  # fmt: skip

    start = time.time()
    with Procs(root) as procs:
        # Phase 1: the two processes (preempted by a SIGTERM to process 1 only) beside the reference.
        port = free_port()
        for i in range(2):
            procs.start(f"first{i}", two_process_args(i, port, "first"), devices=1)
        ref = [sys.executable, str(driver), str(root), "ref", "reference", *common, f"--workdir={refdir}"]
        procs.start("ref", ref, devices=2)
        deadline = time.time() + DEADLINE_S
        metrics = workdir / "metrics.jsonl"
        while not (metrics.exists() and '"step": 2,' in metrics.read_text()):
            if time.time() > deadline or any(procs.procs[f"first{i}"].poll() is not None for i in range(2)):
                procs.kill()
                pytest.fail(
                    "the 2-process run never logged step 2\n" + procs.tail("first0") + procs.tail("first1")
                )
            time.sleep(0.05)
        procs.procs["first1"].send_signal(signal.SIGTERM)
        procs.finish(["first0", "first1"], deadline)
        first = time.time() - start
        # Phase 2: the same two processes resume from the checkpoint and finish (the reference goes on).
        port = free_port()
        for i in range(2):
            procs.start(f"resumed{i}", two_process_args(i, port, "resumed"), devices=1)
        procs.finish(["resumed0", "resumed1", "ref"], time.time() + DEADLINE_S)
    return {
        "root": root,
        "workdir": workdir,
        "logs": {n: procs.log(n) for n in procs.procs},
        "seconds": time.time() - start,
        "first_seconds": first,
        **{tag: load(root, tag) for tag in ("first0", "first1", "resumed0", "resumed1", "ref")},
    }


def assert_close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys() and a, what
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7, err_msg=f"{what}: {k}")


def joined(a: dict, b: dict, what: str) -> dict:
    """The two processes' copies put together (NaN = a shard that process does not hold): wherever both
    hold an element it is bit-identical, and together they hold every element."""
    assert a.keys() == b.keys() and a, what
    out = {}
    for k in a:
        both = ~np.isnan(a[k]) & ~np.isnan(b[k])
        np.testing.assert_array_equal(a[k][both], b[k][both], err_msg=f"{what}: {k}")
        out[k] = np.where(np.isnan(a[k]), b[k], a[k])
        assert not np.isnan(out[k]).any(), f"{what}: {k} is held by neither process"
    return out


def test_two_processes_train_as_one(runs):
    (i0, s0, p0), (i1, s1, p1) = runs["first0"], runs["first1"]
    ref_info, ref_steps, ref_params = runs["ref"]
    for info in (i0, i1):  # jax.distributed really spans the two processes, one device each
        assert (info["process_count"], info["device_count"], info["local_device_count"]) == (2, 2, 1)
    assert (i0["process_index"], i1["process_index"]) == (0, 1)
    assert (ref_info["process_count"], ref_info["device_count"]) == (1, 2)

    # The real build placed the model on the mesh, cutting the parameters across the processes: each holds
    # exactly half of an fsdp-split parameter, the other process the other half; the rest is on both.
    specs = i0["shardings"]
    assert specs == i1["shardings"] == ref_info["shardings"]
    split = [k for k, spec in specs.items() if "fsdp" in spec]
    assert any(k.startswith("llm/") and "lora" not in k for k in split), "backbone kernels split over fsdp"
    assert any(not k.startswith("llm/") for k in split), "head parameters split over fsdp"
    for k in specs:
        held = [~np.isnan(p["init/" + k]) for p in (p0, p1)]
        if k in split:
            assert held[0].mean() == held[1].mean() == 0.5 and not (held[0] & held[1]).any(), k
        else:
            assert held[0].all() and held[1].all(), k
    # Built the same across two processes as in one.
    init = joined({k: v for k, v in p0.items() if k.startswith("init/")},
                  {k: v for k, v in p1.items() if k.startswith("init/")}, "init")
    assert_close(init, {k: v for k, v in ref_params.items() if k.startswith("init/")}, "init vs one process")

    # The SIGTERM reached process 1 only; the collective poll made both save the same step and exit 0.
    stop = i0["step"]
    assert i0["status"] == i1["status"] == "preempted" and i1["step"] == stop and 2 <= stop < STEPS
    for name in ("first0", "first1"):
        assert f"preempted: step {stop} in" in runs["logs"][name]
    assert (runs["workdir"] / "checkpoints" / str(stop) / "params").is_dir()

    # Both processes agree on every parameter after every step, bit for bit, wherever both hold it ...
    assert sorted(s0) == sorted(s1) == list(range(stop))
    steps = {step: joined(s0[step], s1[step], f"step {step}") for step in range(stop)}
    final = joined(p0, p1, "final")
    # ... and they trained (coe: the LoRA adapters move; B starts at 0; the lr warms up from 0 at step 0).
    moved = [k for k in steps[stop - 1] if not np.array_equal(steps[stop - 1][k], final["init/" + k])]
    assert any("lora_b" in k for k in moved) and 2 * len(moved) >= len(steps[stop - 1])

    # Each process read its own slice: disjoint records, together the reference's global batch.
    for step in range(stop):
        a, b = i0["records"][step], i1["records"][step]
        assert len(a) == len(b) == 1 and not set(a) & set(b)
        assert a + b == ref_info["records"][step]
    # ... and the update of that global batch is the one-process update (loss and every parameter).
    for step in range(stop):
        assert_close(steps[step], ref_steps[step], f"step {step} vs one process")
        np.testing.assert_allclose(
            i0["metrics"][step]["total"], ref_info["metrics"][step]["total"], rtol=1e-6
        )
        assert i1["metrics"][step] == i0["metrics"][step]
    print(f"2-process multihost runs: {runs['seconds']:.0f} s in all, "
          f"{runs['first_seconds']:.0f} s to the preemption")


def test_two_process_resume_continues_exactly(runs):
    (f0, _, _), (f1, _, _) = runs["first0"], runs["first1"]
    (i0, s0, p0), (i1, s1, p1) = runs["resumed0"], runs["resumed1"]
    ref_info, ref_steps, ref_params = runs["ref"]
    stop = f0["step"]
    for info in (i0, i1):
        assert info["process_count"] == 2 and info["status"] == "completed" and info["step"] == STEPS
        assert info["first_step"] == stop  # resumed from the preemption checkpoint, not from scratch
    # Every process continued its own slice at the next batch (its own iterator state from the checkpoint).
    records = {p: f["records"] + r["records"] for p, f, r in ((0, f0, i0), (1, f1, i1))}
    for step in range(STEPS):
        assert records[0][step] + records[1][step] == ref_info["records"][step], step
    # The epoch: 6 records per process, disjoint, together all 12 train records, each read once.
    mine = [sum(records[p], []) for p in range(2)]
    assert len(set(mine[0])) == len(set(mine[1])) == 6 and not set(mine[0]) & set(mine[1])
    assert sorted(mine[0] + mine[1]) == list(range(12))
    # The resumed steps (restored into the processes' shards) reproduce the uninterrupted reference, and the
    # processes still agree bit for bit wherever both hold a parameter.
    assert sorted(s0) == sorted(s1) == list(range(stop, STEPS))
    for step in range(stop, STEPS):
        assert_close(joined(s0[step], s1[step], f"step {step}"), ref_steps[step],
                     f"resumed step {step} vs one process")
    final = joined(p0, p1, "final")
    assert_close(
        {k: v for k, v in final.items() if k.startswith("final/")},
        {k: v for k, v in ref_params.items() if k.startswith("final/")},
        "final parameters vs one process",
    )
    # The eval split (3 records) is read per process too, one example per batch: process 1's second batch
    # is a filler row in the 128 bucket while process 0's is 256 long. They agree on the length
    # (`distributed.agree_on_length`), so every global array, train or eval, has one shape on both processes
    # (one program), and the split's exact mean is still the one-process value.
    assert [128, 256] in i1["lengths"] and [128, 256] not in i0["lengths"]
    for a, b in ((f0, f1), (i0, i1)):
        assert a["global_shapes"] == b["global_shapes"] and len(a["global_shapes"]) >= len(a["records"])
    assert i0["eval"].keys() == ref_info["eval"].keys() and "eval/total" in i0["eval"]
    for k, v in ref_info["eval"].items():
        np.testing.assert_allclose(i0["eval"][k], v, rtol=1e-5, err_msg=k)
        assert i1["eval"][k] == i0["eval"][k]



def test_a_many_host_config_on_one_machine_is_a_config_error(tmp_path):
    """`empatheia train --config configs/vicuna7b.py` on one machine (distributed.initialize with no cluster
    to join and no coordinator) ends in one config error naming the key and the way out, not jax's bare
    ValueError traceback. Its own process: jax.distributed.initialize must come before any backend use, and
    this pytest process has long used one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COORDINATOR")}
    env["HF_HUB_OFFLINE"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "empatheia_jax.cli", "train", "--config", str(REPO / "configs/vicuna7b.py"),
         "--workdir", str(tmp_path / "run")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert re.search(r"config\.distributed\.initialize=True.*no cluster to join "
                     r"\(coordinator_address should be defined\.\).*--config\.distributed\.initialize=False",
                     run.stderr), run.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
