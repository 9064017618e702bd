"""bench/train_step.py on CPU at the tiny shape: the row's fields, the loss it reports is the trainer's loss
on the same weights and batch (so the bench times the real stage-4 step, not a re-implementation), and the
HF + PEFT reference (a separate process) reports the same fields."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "train_step.py"
TINY = ["--shape", "tiny", "--remat", "none", "--seq", "32", "--steps", "2", "--warmup", "1"]
POSITIVE = ("tokens_per_s", "step_s", "compile_s", "mfu_4n", "mfu_6n", "flops_4n", "flops_6n", "loss")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _args(bench, *extra):
    return bench.defaults(bench.parser().parse_args([*TINY, *extra]))


def _check_row(row: dict, side: str) -> None:
    assert row["side"] == side and row["shape"] == "tiny" and row["batch"] == 2 and row["seq"] == 32
    for key in POSITIVE:
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert len(row["step_s_all"]) == 2 and row["peak_tflops"] == 989.0
    assert "peak_mem_gib" in row and row["device"] and row["versions"]


def test_stage4_row_reports_the_trainers_loss(bench):
    import jax
    import jax.numpy as jnp

    from empatheia_jax.train import objective
    from empatheia_jax.train import step as step_lib

    args = _args(bench)
    run = bench.StageRun(args)
    assert run.stage.name == "overall" and run.stage.heads == {"cs", "sd"}
    # The trainer's objective on the initial weights and the bench's batch, with the step's per-example keys.
    batch = {k: jnp.asarray(v) for k, v in run.batch(args.batch, 32).items()}
    counts = objective.loss_counts(run.model.config, batch)
    keys = step_lib.example_keys(jax.random.key(0), (1, args.batch))[0]
    loss_fn = jax.jit(objective.make_loss_fn(run.stage, run.weights), static_argnums=1,
                      compiler_options=bench.cpu_compiler_options())
    total, metrics = loss_fn(run.params, run.graphs.model, run.frozen, batch, keys, counts=counts)
    # Every head's loss takes part (media splice -> signal states -> SD; response rows -> CS).
    for term in ("emp", "ccl_speech", "ccl_video", "sal_speech", "cls_emotion"):
        assert float(metrics[term]) > 0, term
    (row,) = bench.run_ours(args, run)  # times `step.jit_step` on `run`, donating its state
    _check_row(row, "ours")
    assert row["what"].startswith("Empatheia stage-4")
    assert row["loss"] == pytest.approx(float(total), rel=1e-5)
    assert row["loss"] != pytest.approx(float(metrics["emp"]), rel=1e-3)  # the total, not L_emp alone


def test_hf_reference_and_backbone_step_report_the_same_fields(bench):
    args = _args(bench, "--backbone-only")
    (hf,) = bench.run_hf(args, [*TINY, "--backbone-only"])
    _check_row(hf, "hf")
    assert hf["versions"].keys() == {"torch", "transformers", "peft"} and hf["device"].startswith("cpu")
    (ours,) = bench.run_ours(args)
    _check_row(ours, "ours")
    assert ours["what"] == "LoRA LM step"
    assert set(hf) == set(ours) - {"build_s", "compiler_options"}
    assert (ours["attention"], hf["attention"]) == ("auto: einsum", "sdpa")  # "auto" on a CPU: our einsum
    # Same shape, same (random, untrained) task: both start near ln V.
    assert hf["loss"] == pytest.approx(math.log(512), rel=0.1)
    assert ours["loss"] == pytest.approx(math.log(512), rel=0.1)


def test_a_missing_hf_wheel_is_named(bench, tmp_path, monkeypatch):
    (tmp_path / "peft.py").write_text("raise ImportError('no peft here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the child finds this "peft" first
    with pytest.raises(bench.MissingWheels, match=r"wheel\(s\) peft;.*bench/gpu_wheels.sh"):
        bench.run_hf(_args(bench, "--backbone-only"), [*TINY, "--backbone-only"])
