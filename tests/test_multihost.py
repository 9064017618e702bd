"""A real 2-process `jax.distributed` run on localhost (CPU devices, gloo collectives) through
`empatheia train`, and the launch scripts.

Three runs of the `tiny` config (stage coe, 6 steps, global batch 2 = 1 per process, mesh data=2), each a
`python driver.py` that runs the real CLI (`empatheia_jax.cli.main`) with a few trainer functions wrapped to
record what the test compares (the model's parameters after every step, each step's record indices, the
metrics):

1. **two processes** (`--config.distributed.initialize=True`, explicit coordinator on a free localhost port,
   one CPU device each), SIGTERMed on process 1 only after a few steps: the preemption poll is collective,
   so both save the same step and exit 0 ("preempted");
2. the same two processes again on the same workdir: they resume from that checkpoint and finish;
3. **one process with two devices** reading both processes' grain slices concatenated in process order,
   i.e. the same global batch at every step, uninterrupted (the reference; runs beside run 1).

Checked: `jax.process_count()` is 2 inside the runs; the two processes hold identical parameters after
every step and at the end; the parameters moved; the processes' records are disjoint and each epoch is
covered once; the resumed processes continue at exactly the records and parameters of the uninterrupted
reference, whose every step (parameters, loss) they reproduce; the final eval metrics agree.
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
from helpers import make_tiny_shards, saved_smollm2_tokenizer

REPO = Path(__file__).resolve().parents[1]
STEPS = 6  # one epoch of the 12 training records: 6 per process, one per step
DEADLINE_S = 300  # per phase: a hang (a process waiting on a dead peer) fails instead of blocking CI

# Runs `empatheia train` in this process and records, under OUT: params_<tag>.npz (this process's copy of
# every nnx.Param at the end and at init), steps_<tag>.npz (the trained parameters after each step) and
# info_<tag>.json (process/device counts, per-step record indices and metrics, the result).
DRIVER = r'''
import json
import sys
from pathlib import Path

import numpy as np

out, tag, mode, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]

import jax
from flax import nnx

from empatheia_jax import cli, sharding, trainer
from empatheia_jax.input_pipeline import TOKEN_KEYS, make_dataset

rec = {"model": None, "records": [], "metrics": [], "steps": {}, "lengths": [], "global_shapes": []}


def local_copy(state):
    """{path: this process's full copy}; params are replicated over the "data" axis, so it has all of it."""
    flat = {}
    for path, var in nnx.to_flat_state(state):
        x = var.get_value()
        full = np.full(x.shape, np.nan, np.float32)
        for shard in x.addressable_shards:
            full[shard.index] = np.array(shard.data, copy=True)
        assert not np.isnan(full).any(), path
        flat["/".join(map(str, path))] = full
    return flat


_build = trainer.build_model


def build_model(config, manifest, mesh=None):
    model, tok = _build(config, manifest)  # the host build (a random backbone is built there anyway)
    rec["model"] = model
    rec["init"] = {k: np.asarray(v.get_value()) for k, v in
                   (("/".join(map(str, p)), v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))}
    if mesh is not None:
        sharding.shard_model(model, mesh)
    return model, tok


_step_batch = trainer.step_batch


def step_batch(batch, mesh, grad_accum):
    rec["records"].append(np.asarray(batch["record_index"]).tolist())
    return _step_batch(batch, mesh, grad_accum)


_agree = trainer.agree_on_length


def agree_on_length(batch, pad_id):  # every train and eval batch: (its own length, the agreed one)
    out = _agree(batch, pad_id)
    rec["lengths"].append([batch["input_ids"].shape[1], out["input_ids"].shape[1]])
    return out


_make_global_batch = trainer.make_global_batch


def make_global_batch(batch, sharding, **kwargs):
    out = _make_global_batch(batch, sharding, **kwargs)
    rec["global_shapes"].append(list(out["input_ids"].shape))
    return out


_jit_step = trainer.jit_step


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
                         **trainer.pipeline_fields(config, stage, model))
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
        "lengths": rec["lengths"], "global_shapes": rec["global_shapes"],
    }
    (out / f"info_{tag}.json").write_text(json.dumps(info))
    return result


trainer.build_model, trainer.step_batch = build_model, step_batch
trainer.jit_step, trainer.train = jit_step, train
trainer.agree_on_length, trainer.make_global_batch = agree_on_length, make_global_batch
if mode == "reference":
    trainer.make_train_pipeline = BothSlices
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
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0 "
        "--xla_llvm_disable_expensive_passes=true",
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
        "--config.mesh.data=2",
        "--config.mesh.fsdp=1",
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
        **{tag: load(root, tag) for tag in ("first0", "first1", "resumed0", "resumed1", "ref")},
    }


def assert_close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys() and a, what
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7, err_msg=f"{what}: {k}")


def test_two_processes_train_as_one(runs):
    (i0, s0, p0), (i1, s1, p1) = runs["first0"], runs["first1"]
    ref_info, ref_steps, ref_params = runs["ref"]
    for info in (i0, i1):  # jax.distributed really spans the two processes, one device each
        assert (info["process_count"], info["device_count"], info["local_device_count"]) == (2, 2, 1)
    assert (i0["process_index"], i1["process_index"]) == (0, 1)
    assert (ref_info["process_count"], ref_info["device_count"]) == (1, 2)

    # The SIGTERM reached process 1 only; the collective poll made both save the same step and exit 0.
    stop = i0["step"]
    assert i0["status"] == i1["status"] == "preempted" and i1["step"] == stop and 2 <= stop < STEPS
    for name in ("first0", "first1"):
        assert f"preempted: step {stop} in" in runs["logs"][name]
    assert (runs["workdir"] / "checkpoints" / str(stop) / "params").is_dir()

    # Both processes hold the same parameters after every step, bit for bit ...
    assert sorted(s0) == sorted(s1) == list(range(stop))
    for step in range(stop):
        assert s0[step].keys() == s1[step].keys() and s0[step]
        for k in s0[step]:
            np.testing.assert_array_equal(s0[step][k], s1[step][k], err_msg=f"step {step}: {k}")
    for k in p0:
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)
    # ... and they trained (coe: the LoRA adapters move; B starts at 0; the lr warms up from 0 at step 0).
    moved = [k for k in s0[stop - 1] if not np.array_equal(s0[stop - 1][k], p0["init/" + k])]
    assert any("lora_b" in k for k in moved) and 2 * len(moved) >= len(s0[stop - 1])

    # Each process read its own slice: disjoint records, together the reference's global batch.
    for step in range(stop):
        a, b = i0["records"][step], i1["records"][step]
        assert len(a) == len(b) == 1 and not set(a) & set(b)
        assert a + b == ref_info["records"][step]
    # ... and the update of that global batch is the one-process update (loss and every parameter).
    for step in range(stop):
        assert_close(s0[step], ref_steps[step], f"step {step} vs one process")
        np.testing.assert_allclose(
            i0["metrics"][step]["total"], ref_info["metrics"][step]["total"], rtol=1e-6
        )
    print(f"2-process multihost runs: {runs['seconds']:.0f} s in all")


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
    # The resumed steps reproduce the uninterrupted reference, and the processes still agree bit for bit.
    assert sorted(s0) == sorted(s1) == list(range(stop, STEPS))
    for step in range(stop, STEPS):
        for k in s0[step]:
            np.testing.assert_array_equal(s0[step][k], s1[step][k], err_msg=f"step {step}: {k}")
        assert_close(s0[step], ref_steps[step], f"resumed step {step} vs one process")
    for k in p0:
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)
    assert_close(
        {k: v for k, v in p0.items() if k.startswith("final/")},
        {k: v for k, v in ref_params.items() if k.startswith("final/")},
        "final parameters vs one process",
    )
    # The eval split (3 records) is read per process too, one example per batch: process 1's second batch
    # is a filler row in the 128 bucket while process 0's is 256 long. They agree on the length
    # (`trainer.agree_on_length`), so every global array, train or eval, has one shape on both processes
    # (one program), and the split's exact mean is still the one-process value.
    assert [128, 256] in i1["lengths"] and [128, 256] not in i0["lengths"]
    for a, b in ((f0, f1), (i0, i1)):
        assert a["global_shapes"] == b["global_shapes"] and len(a["global_shapes"]) >= len(a["records"])
    assert i0["eval"].keys() == ref_info["eval"].keys() and "eval/total" in i0["eval"]
    for k, v in ref_info["eval"].items():
        np.testing.assert_allclose(i0["eval"][k], v, rtol=1e-5, err_msg=k)
        assert i1["eval"][k] == i0["eval"][k]


# ----------------------------------------------------------------------------------------------------------
# Launch scripts
# ----------------------------------------------------------------------------------------------------------

LAUNCH = sorted((REPO / "launch").glob("*.sh")) + sorted((REPO / "launch").glob("*.sbatch"))


@pytest.mark.parametrize("script", LAUNCH, ids=[p.name for p in LAUNCH])
def test_launch_script_parses(script):
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert script.read_text().startswith("#!"), "launch scripts start with a shebang"


def test_every_launcher_exists():
    names = {p.name for p in LAUNCH}
    assert {"local.sh", "tpu_pod.sh", "slurm_gpu.sbatch"} <= names
