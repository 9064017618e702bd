"""bench/memory_plan.py: the memory plan of the real train step, on CPU, for 1-2 layers of the 7B shapes.

The plan's parameter and optimizer-state bytes come from the sharded abstract state of the model the
trainer builds; they must equal the hand count (every weight written out from the architecture, sharded by
the logical-axis rules) to the byte, on several meshes. The compiled part runs the plan's command line for
two remat policies of a 2-layer Vicuna-7B (stage coe: the same decoder layers, without the CS/SD heads whose
hundreds of optimizer leaves make an `overall` compile take minutes on XLA:CPU); full remat must shrink
XLA's temporaries and add recomputed forward FLOPs, which a broken remat policy or a plan that does not
compile the real step would fail.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "memory_plan.py"
CONFIG = str(REPO / "configs" / "vicuna7b.py")


@pytest.fixture(scope="module")
def plan():
    """The script as a module (jax is already set up with conftest's 8 fake CPU devices)."""
    spec = importlib.util.spec_from_file_location("memory_plan", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def backbone_and_lora_bytes(llm, lora) -> int:
    """Whole-model bytes of the Vicuna backbone and its LoRA adapters, written out independently of the
    script's leaf list: embedding + lm_head, per layer q/k/v/o + SwiGLU + two norms, the final norm; LoRA
    A [d, r] + B [r, d] on q/k/v/o in float32. (The added-token rows are the trainable group added_rows.)"""
    d, f, L, r, v = llm.hidden_size, llm.intermediate_size, llm.num_hidden_layers, lora.rank, llm.vocab_size
    backbone = 2 * v * d + L * (4 * d * d + 3 * d * f + 2 * d) + d
    return 4 * backbone + 4 * L * len(lora.targets) * 2 * d * r


def test_params_and_optimizer_state_equal_the_hand_count(plan):
    import jax

    from empatheia_jax import sharding
    from empatheia_jax.train import config as config_lib

    config = plan.load_config(CONFIG, "overall")
    stage = config_lib.resolve_stage(config)
    manifest = plan.feature_dims(config, plan.AUDIO_DIM, plan.VIDEO_DIM)
    cfg = plan.empatheia_config(config, plan.llm_config(config, layers=2), manifest)
    assert (cfg.llm.hidden_size, cfg.llm.intermediate_size, cfg.llm.vocab_size) == (4096, 11008, 32000)
    model, optimizer = plan.build_abstract(config, cfg)

    whole = plan.hand_count(cfg, stage.trainable_groups, {"data": 1, "fsdp": 1, "tensor": 1})
    frozen_and_lora = [leaf for leaf in plan.param_inventory(cfg) if leaf.group in (None, "lora")]
    assert sum(math.prod(x.shape) * x.itemsize for x in frozen_and_lora) == backbone_and_lora_bytes(
        cfg.llm, cfg.lora)
    assert whole.optimizer == 2 * whole.trainable + plan.OPT_SCALAR_BYTES
    frozen = sum(math.prod(x.shape) * x.itemsize for x in frozen_and_lora if x.group is None)
    assert whole.trainable == whole.params - frozen  # the stage trains everything but the backbone

    for sizes in ({"data": 1, "fsdp": 2, "tensor": 1}, {"data": 1, "fsdp": 4, "tensor": 2},
                  {"data": 2, "fsdp": 4, "tensor": 1}):
        mesh = sharding.make_mesh(**sizes, devices=jax.devices()[: math.prod(sizes.values())])
        run = plan.place(model, optimizer, stage, mesh)
        hand = plan.hand_count(cfg, stage.trainable_groups, sizes)
        measured = plan.bytes_per_device(run.params) + plan.bytes_per_device(run.frozen)
        assert measured == hand.params_per_device, sizes
        assert plan.bytes_per_device(run.opt_state) == hand.optimizer_per_device, sizes
        assert plan.bytes_per_device(run.params) == hand.trainable_per_device, sizes
        # Sharding really splits the weights: fsdp x tensor devices hold about 1/n of the whole each.
        n = sizes["fsdp"] * sizes["tensor"]
        assert whole.params / n <= hand.params_per_device < 1.1 * whole.params / n, sizes


def test_plan_command_compiles_the_step_and_remat_shrinks_temporaries(tmp_path):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its device count
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", CONFIG, "--stage", "coe", "--layers", "2",
         "--meshes", "fsdp=2", "--seq", "256", "--remat", "none,full", "--json", str(out)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| fsdp=2 | 1 x 256 (2, 16) | none | 2 |" in p.stdout, p.stdout
    rows = {r["remat"]: r for r in json.loads(out.read_text())}
    none, full = rows["none"], rows["full"]
    for r in (none, full):
        assert (r["params"], r["opt"]) == (r["hand_params"], r["hand_opt"])
        assert r["alias"] == r["donated"]  # trainable params + optimizer state updated in place
        assert r["total"] == r["params"] + r["opt"] + r["batch"] + r["output"] - r["alias"] + r["temp"]
    assert full["temp"] < none["temp"]
    assert full["residuals"] < none["residuals"]
    # Full remat recomputes the layers' forward in the backward pass: more FLOPs than no remat.
    assert full["flops_xla"] > none["flops_xla"]
    # The trainer's MFU convention is the same for both (it counts the model, not the schedule).
    assert full["flops_trainer"] == none["flops_trainer"] > 0


def test_micro_batch_loop_does_not_keep_every_layers_gathered_weights(plan):
    """The step's micro-batch loop re-gathers each layer's FSDP-sharded weights where it uses them.

    Frozen weights are the same in every micro-batch, so XLA's loop-invariant code motion would hoist each
    layer's all-gather (and dtype cast) out of the `lax.scan` and keep every layer's whole weights alive for
    the step: 0.83 GiB more temporaries per 7B layer at fsdp=8 (docs/design.md, "Hoisted weight gathers").
    Compiled here at 1 and 2 layers of the 7B shapes (T=256, fsdp=8, grad_accum 4): one more layer may add
    its activations and its own transient gather, far less than the 0.75 GiB of a layer kept gathered."""
    import jax

    from empatheia_jax import sharding
    from empatheia_jax.train import config as config_lib

    config = plan.load_config(CONFIG, "coe")
    stage = config_lib.resolve_stage(config)
    manifest = plan.feature_dims(config, plan.AUDIO_DIM, plan.VIDEO_DIM)
    mesh = sharding.make_mesh(data=1, fsdp=8, tensor=1, devices=jax.devices()[:8])
    temps = {}
    for depth in (1, 2):
        cfg = plan.empatheia_config(config, plan.llm_config(config, depth, "full"), manifest)
        run = plan.place(*plan.build_abstract(config, cfg), stage, mesh)
        temps[depth] = plan.compile_step(config, run, stage, mesh, micro=8, accum=4, seq=256,
                                         options=plan.compiler_options()).temp
    llm = plan.llm_config(config)
    layer_bytes = 4 * (4 * llm.hidden_size**2 + 3 * llm.hidden_size * llm.intermediate_size)  # fp32, whole
    growth = temps[2] - temps[1]
    assert growth < 0.25 * layer_bytes, (temps, layer_bytes)
