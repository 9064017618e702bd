"""`empatheia_jax.weights.export_empatheia`: a trained Empatheia exported as a PEFT adapter or a merged HF
checkpoint
(+ heads, config, tokenizer) loads back as the same model, and into peft / transformers as the same LLM.

The run is real: a tiny random LlamaForCausalLM (SmolLM2's tokenizer, d=32) saved by transformers, converted
by `empatheia_jax.weights.hf_to_flax`, trained one `coe` step by `empatheia train` (a subprocess with one CPU
device,
conftest's `cli_env`). Its checkpoint is then perturbed (every saved leaf + noise, written as step 2 through
the trainer's own `TrainCheckpointer`), so LoRA B, the added rows, the SD standardiser and every head are
far from their initial values and a parameter that an export drops or mixes up changes the outputs.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from helpers import FAST, REPO, make_tiny_shards, require, saved_smollm2_tokenizer, tiny_hf_model

torch = require("torch", "the HF reference models")
peft = require("peft", "loading the exported adapter")
transformers = require("transformers", "loading the merged export and the HF base")

import empatheia_jax  # noqa: E402
from empatheia_jax.data import input_pipeline as ip  # noqa: E402
from empatheia_jax.serve.load import export_trained, load_exported  # noqa: E402
from empatheia_jax.train.checkpoint import CheckpointError, TrainCheckpointer, read_meta  # noqa: E402
from empatheia_jax.weights.export_empatheia import EXPORT_CONFIG, FORMAT_VERSION, HEADS_FILE, export_model  # noqa: E402
from empatheia_jax.weights.export_hf import ExportError  # noqa: E402
from empatheia_jax.weights.hf_to_flax import convert  # noqa: E402

STEP = 2  # the perturbed checkpoint; step 1 is the trained one
OUTPUTS = ("logits", "speech_content", "video_content", "speech_style", "video_style", "emotion_logits",
           "age_logits", "gender_logits", "timbre_logits")
pytestmark = pytest.mark.usefixtures("exact_matmuls")
# The module fixtures build models under the same precision as the tests (`exact_matmuls`): jax keys its
# caches of compiled eager ops on it, and every model built under another one would compile them again.
_EXACT = functools.partial(jax.default_matmul_precision, "highest")

CONFIG_FILE = """
from configs import tiny


def get_config(arg=None):
    c = tiny.get_config(arg)
    c.stage = "coe"
    c.model.backbone = {backbone!r}
    c.model.tokenizer = {tokenizer!r}
    c.model.llm = {{"dtype": "float32", "param_dtype": "float32", "remat": "none"}}  # overrides only
    c.data.shards = {shards!r}
    c.schedule.coe.steps = 1
    c.optim.warmup_steps = 0
    c.train.eval_batches = 1
    c.checkpoint.every = 1
    return c
"""


def _perturb_saved_params(ckpt_dir: Path, step: int, new_step: int) -> None:
    """Step `new_step` = step `step` + noise on every saved leaf (LoRA, added rows, projections, CS, SD)."""
    tree = ocp.StandardCheckpointer().restore(ckpt_dir / str(step) / "params")
    rng = np.random.default_rng(0)
    noisy = jax.tree.map(lambda v: np.asarray(v) + 0.05 * rng.standard_normal(v.shape).astype(v.dtype), tree)
    _, meta = read_meta(ckpt_dir, step)
    meta.pop("step")
    with TrainCheckpointer(ckpt_dir, async_save=False, keep=5) as ckpt:
        assert ckpt.save(new_step, params=noisy, opt_state=None, data_state=None, meta=meta)


@pytest.fixture(scope="module")
def run(tmp_path_factory, cli_env):
    """(root, hf folder, workdir): a converted tiny HF backbone trained one coe step, + perturbed step 2."""
    root = tmp_path_factory.mktemp("export_run")
    tok_dir = saved_smollm2_tokenizer(tmp_path_factory)
    shards = make_tiny_shards(root / "data")
    vocab = len(transformers.AutoTokenizer.from_pretrained(tok_dir))
    tiny_hf_model(0, vocab_size=vocab).save_pretrained(root / "hf")
    backbone = convert(root / "hf", root / "backbone")
    cfg_file = root / "export_config.py"
    cfg_file.write_text(CONFIG_FILE.format(backbone=str(backbone), tokenizer=tok_dir, shards=str(shards)))
    workdir = root / "run"
    cmd = [sys.executable, "-m", "empatheia_jax.cli", "train", f"--config={cfg_file}", f"--workdir={workdir}"]
    p = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    _perturb_saved_params(workdir / "checkpoints", 1, STEP)
    return root, root / "hf", workdir


@pytest.fixture(scope="module")
def original(run):
    """The perturbed step as `load_trained` gives it: the reference every export must reproduce."""
    with _EXACT():
        return empatheia_jax.load_trained(run[2], step=STEP)


@pytest.fixture(scope="module")
def exports(run, original):
    """{"peft": folder, "merged": folder}: peft through `export_trained` (checkpoint on disk), merged
    through `export_model` from the loaded model (the same code after loading; one load less)."""
    root, _, workdir = run
    model, tok, _, meta = original
    with _EXACT():
        return {
            "peft": export_trained(workdir, root / "peft", step=STEP, mode="peft"),
            "merged": export_model(model, tok, meta, root / "merged", mode="merged"),
        }


@pytest.fixture(scope="module")
def batch(original):
    """Two train examples of the overall template: media splices, signal tokens, response span, targets."""
    tok = original[1]
    pipe = ip.make_dataset(original[2].data.shards, "train", "overall", tok, batch_size=2, max_len=256,
                           shuffle=False, num_epochs=1, window_batches=1, process_index=0, process_count=1,
                           n_signal=4, max_speech_len=16, max_video_len=16)
    return next(iter(pipe))


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST)
def _forward(graphdef, state, batch):
    out = nnx.merge(graphdef, state)(batch, train=False)
    return {k: out[k] for k in OUTPUTS}


def _outputs(model, batch) -> dict[str, np.ndarray]:
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, jax.devices()[0])  # restored and fresh arrays alike: one compile
    return jax.tree.map(np.asarray, _forward(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()}))


def _ids(model, signal: bool = True) -> np.ndarray:
    """[2, 24] text ids, with the <AUDi>/<VIDi> signal tokens (their rows travel in the adapter)."""
    cfg = model.config
    ids = np.random.default_rng(1).integers(0, cfg.llm.vocab_size, (2, 24))
    if signal:
        ids[:, 5:5 + len(cfg.signal_ids)] = cfg.signal_ids
    return ids.astype(np.int64)


def _torch_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids)).logits.float().numpy()


# ----------------------------------------------------------------------------------------------------------
# Round trip through our own loader
# ----------------------------------------------------------------------------------------------------------


def test_perturbed_checkpoint_is_far_from_the_untrained_model(run, original, batch):
    """Guards the tests below: with the trained step equal to the untrained model they would prove little."""
    untrained = empatheia_jax.load_trained(run[2], step=STEP, restore=False)[0]
    got, fresh = _outputs(original[0], batch), _outputs(untrained, batch)
    for k in OUTPUTS:
        assert np.abs(got[k] - fresh[k]).max() > 1e-2, k
    extra = np.asarray(original[0].llm.embed_extra[...])
    assert np.abs(extra - extra.mean(0)).max() > 1e-2  # the added rows are distinct, not the mean row


@pytest.mark.parametrize("mode", ["peft", "merged"])
def test_load_trained_of_an_export_reproduces_the_model(original, exports, batch, mode):
    model, tok, config, meta = empatheia_jax.load_trained(exports[mode])
    assert (meta["mode"], meta["step"], meta["format_version"]) == (mode, STEP, FORMAT_VERSION)
    assert meta["model_config"] == original[3]["model_config"] == model.config.to_dict()
    assert config == original[2] and meta["encoder"] == original[3]["encoder"]
    assert len(tok) == len(original[1])
    assert tok.convert_tokens_to_ids("<AUD1>") == model.config.aud_signal_ids[0]
    got, want = _outputs(model, batch), _outputs(original[0], batch)
    atol = 2e-5 if mode == "merged" else 1e-6  # merged: W + (alpha/r) A B is rounded once more in fp32
    for k in OUTPUTS:
        np.testing.assert_allclose(got[k], want[k], atol=atol, rtol=0, err_msg=k)
    if mode == "peft":  # every parameter comes back bit for bit
        for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                     nnx.to_flat_state(nnx.state(original[0], nnx.Param)), strict=True):
            np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


def test_a_moved_backbone_is_given_with_backbone(run, exports, original, batch, tmp_path):
    """backbone= replaces the folder an export or a run recorded (the packaged reference model is loaded
    on machines whose converted SmolLM2 lives elsewhere); a folder that is not there is named."""
    import shutil

    moved = shutil.copytree(run[0] / "backbone", tmp_path / "elsewhere")
    for src in (exports["peft"], run[2]):
        model, _, _, meta = empatheia_jax.load_trained(src, step=STEP, backbone=moved)
        assert meta["backbone"] == str(moved)
        got, want = _outputs(model, batch), _outputs(original[0], batch)
        for k in OUTPUTS:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{src} {k}")
        with pytest.raises(CheckpointError, match="nowhere"):
            empatheia_jax.load_trained(src, step=STEP, backbone=tmp_path / "nowhere")


def test_max_len_sets_the_budget_the_export_serves_at_and_keeps_the_weights(run, exports, tmp_path):
    """max_len= (the launcher's COE_FROM budget): the re-export serves its prompts at that length, records the
    run's own as trained_max_len, and its weight files hold the same tensors."""
    from safetensors.numpy import load_file

    _, _, workdir = run
    trained = int(empatheia_jax.load_trained(exports["peft"], step=STEP)[2].data.max_len)
    out = export_trained(exports["peft"], tmp_path / "served", step=STEP, max_len=trained - 8)
    _, _, config, meta = empatheia_jax.load_trained(out, step=STEP)
    assert config.data.max_len == trained - 8 and meta["trained_max_len"] == trained
    for name in ("adapter_model.safetensors", "heads.safetensors"):
        a, b = load_file(str(exports["peft"] / name)), load_file(str(out / name))
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), name
    for bad in (8, 64.0, True):
        with pytest.raises(ExportError, match=f"max_len={bad!r} must be an int >= 16"):
            export_trained(workdir, tmp_path / "bad", step=STEP, max_len=bad)
    assert not (tmp_path / "bad").exists()


def test_bfloat16_export_stores_every_weight_rounded_once(original, tmp_path):
    """`dtype="bfloat16"` (the committed reference model's format): the adapter and heads files hold bf16,
    and loading gives each parameter the original rounded to bf16, the frozen backbone untouched."""
    import ml_dtypes
    from safetensors import safe_open

    model0, tok, _, meta = original
    out = export_model(model0, tok, meta, tmp_path / "bf16", mode="peft", dtype="bfloat16")
    for name in ("adapter_model.safetensors", HEADS_FILE):
        with safe_open(str(out / name), "np") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, name  # noqa: SIM118
    model, _, _, meta2 = empatheia_jax.load_trained(out)
    assert meta2["stored_dtype"] == "bfloat16"
    changed = 0
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(model0, nnx.Param)), strict=True):
        a, b = np.asarray(a[...]), np.asarray(b[...])
        want = b if path[0] == "llm" and "lora" not in path and "extra" not in str(path[-1]) else (
            b.astype(ml_dtypes.bfloat16).astype(b.dtype))
        np.testing.assert_array_equal(a, want, err_msg=str(path))
        changed += int(not np.array_equal(a, b))
    assert changed > 10  # the rounding happened (float32 values are rarely bf16-exact)
    with pytest.raises(ExportError, match="dtype='int8'"):
        export_model(model0, tok, meta, tmp_path / "bad", mode="peft", dtype="int8")
    assert not (tmp_path / "bad").exists()


def test_export_folder_layout(run, exports, original):
    from safetensors import safe_open

    peft_dir, merged_dir = exports["peft"], exports["merged"]
    assert {"adapter_config.json", "adapter_model.safetensors", HEADS_FILE, EXPORT_CONFIG,
            "tokenizer.json"} <= {p.name for p in peft_dir.iterdir()}
    assert not (peft_dir / "config.json").exists()
    assert {"config.json", "model.safetensors", "model.safetensors.index.json", HEADS_FILE, EXPORT_CONFIG,
            "tokenizer.json"} <= {p.name for p in merged_dir.iterdir()}
    assert not list(run[0].glob("*.tmp-*"))
    meta = json.loads((peft_dir / EXPORT_CONFIG).read_text())
    assert meta["backbone_source"] == str((run[1]).absolute())
    assert meta["exported_from"] == str(run[2].absolute())
    with safe_open(str(peft_dir / HEADS_FILE), "np") as f:
        names = set(f.keys())
        np.testing.assert_array_equal(f.get_tensor("style_dis.speech_in.shift"),
                                      np.asarray(original[0].style_dis.speech_in.shift[...]))
    assert "aud_proj.kernel" in names and not any(n.startswith("llm.") for n in names)
    adapter = json.loads((peft_dir / "adapter_config.json").read_text())
    cfg = original[0].config
    assert adapter["trainable_token_indices"] == {"embed_tokens": list(cfg.added_ids),
                                                   "lm_head": list(cfg.added_ids)}


# ----------------------------------------------------------------------------------------------------------
# The backbone part in peft / transformers
# ----------------------------------------------------------------------------------------------------------


def test_peft_adapter_on_the_hf_base_gives_our_logits(exports, original):
    model, tok = original[0], original[1]
    meta = json.loads((exports["peft"] / EXPORT_CONFIG).read_text())
    base = transformers.AutoModelForCausalLM.from_pretrained(meta["backbone_source"],
                                                             attn_implementation="eager").eval()
    base.resize_token_embeddings(len(tok), mean_resizing=False)  # the adapter overwrites the new rows
    loaded = peft.PeftModel.from_pretrained(base, str(exports["peft"])).eval()
    ids = _ids(model)
    expected = np.asarray(model.llm(jnp.asarray(ids, jnp.int32)))
    got = _torch_logits(loaded, ids)
    assert got.shape[-1] == model.config.llm.total_vocab
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    # The adapter matters: on text alone, the plain base is far from us.
    plain = transformers.AutoModelForCausalLM.from_pretrained(meta["backbone_source"]).eval()
    text, vocab = _ids(model, signal=False), model.config.llm.vocab_size
    ours = np.asarray(model.llm(jnp.asarray(text, jnp.int32)))[..., :vocab]
    assert np.abs(_torch_logits(plain, text) - ours).max() > 1e-2


def test_merged_folder_loads_in_transformers_with_our_logits(exports, original):
    model = original[0]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(exports["merged"])).eval()
    assert loaded.config.vocab_size == model.config.llm.total_vocab
    ids = _ids(model)
    np.testing.assert_allclose(_torch_logits(loaded, ids), np.asarray(model.llm(jnp.asarray(ids, jnp.int32))),
                               atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------


def test_user_errors_are_named(run, exports, original, tmp_path):
    root, _, workdir = run
    with pytest.raises(ExportError, match="mode='bogus'"):
        export_trained(workdir, tmp_path / "x", mode="bogus")
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "nowhere"))):
        export_trained(tmp_path / "nowhere", tmp_path / "x")
    before = sorted(p.name for p in exports["peft"].iterdir())
    with pytest.raises(ExportError, match=re.escape(f"{exports['peft']} exists and is not empty")):
        export_trained(workdir, exports["peft"], step=STEP)
    assert sorted(p.name for p in exports["peft"].iterdir()) == before
    with pytest.raises(ExportError, match="would replace the checkpoint"):
        export_trained(workdir / "checkpoints" / str(STEP), workdir, overwrite=True)
    model, tok, _, meta = original
    with pytest.raises(ExportError, match="random backbone"):
        export_model(model, tok, {**meta, "backbone": ""}, tmp_path / "x", mode="peft")
    with pytest.raises(ExportError, match="merged export"):
        export_model(model, tok, {**meta, "mode": "merged"}, tmp_path / "x", mode="peft")
    assert not (tmp_path / "x").exists()
    with pytest.raises(CheckpointError, match=f"exports step {STEP}, not step 1"):
        empatheia_jax.load_trained(exports["peft"], step=1)


def test_a_failed_export_leaves_no_folder_and_overwrite_replaces(original, tmp_path):
    model, tok, _, meta = original
    too_long = transformers.AutoTokenizer.from_pretrained(str(original[3]["config"]["model"]["tokenizer"]))
    too_long.add_tokens([f"<x{i}>" for i in range(len(tok) - len(too_long) + 1)])  # more tokens than rows
    with pytest.raises(ExportError, match="do not belong together"):  # raised after the adapter was written
        export_model(model, too_long, meta, tmp_path / "out", mode="peft")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("old")
    export_model(model, tok, meta, tmp_path / "out", mode="peft", overwrite=True)
    assert not (tmp_path / "out" / "stale.txt").exists() and (tmp_path / "out" / EXPORT_CONFIG).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_damaged_exports_are_refused_with_the_file(exports, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(exports["merged"], bad)
    cfg = json.loads((bad / EXPORT_CONFIG).read_text())
    (bad / EXPORT_CONFIG).write_text(json.dumps({**cfg, "format_version": 99}))
    with pytest.raises(CheckpointError, match=r"empatheia_config.json: format_version=99"):
        load_exported(bad)
    (bad / EXPORT_CONFIG).write_text(json.dumps(cfg))
    (bad / HEADS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=re.escape(str(bad / HEADS_FILE))):
        load_exported(bad)


def test_a_stage_starts_from_a_peft_export_with_a_new_cs(run, exports, cli_env, tmp_path):
    """`init_from` an export (the committed reference model is one): a ccl stage with a redesigned CS (a row
    convolution) starts from the export's LoRA, added rows, projections and SD, bit for bit, its CS
    fresh; a merged export (LoRA folded into the kernels) is refused with the reason."""
    root, _, workdir = run
    cfg_file = root / "export_config.py"

    def train(out, init_from):
        cmd = [sys.executable, "-m", "empatheia_jax.cli", "train", f"--config={cfg_file}", f"--workdir={out}",
               "--config.stage=ccl", "--config.schedule.ccl.steps=1", "--config.model.empatheia.cs_conv=3",
               f"--config.init_from={init_from}"]
        return subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=600, cwd=REPO)

    p = train(tmp_path / "ccl", exports["peft"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "start fresh" in p.stderr and str(exports["peft"]) in p.stderr

    def flat(ckpt_dir, step):
        tree = ocp.StandardCheckpointer().restore(ckpt_dir / str(step) / "params")
        return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
                for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}

    source, started = flat(workdir / "checkpoints", STEP), flat(tmp_path / "ccl" / "checkpoints", 1)
    kept = [k for k in source if "content_sync" not in k]
    assert any("lora" in k for k in kept) and any("style_dis" in k for k in kept)
    for k in kept:  # ccl trains only the CS: everything else is the export's (float32: the checkpoint's)
        np.testing.assert_array_equal(started[k], source[k], err_msg=k)
    assert any("conv" in k for k in started if "content_sync" in k)
    p = train(tmp_path / "merged", exports["merged"])
    assert p.returncode != 0 and "export with --mode peft" in p.stderr and "Traceback" not in p.stderr, \
        p.stderr[-3000:]
