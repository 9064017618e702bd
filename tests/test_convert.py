"""HF -> converted folder -> load_model: logits equal transformers'; broken inputs give clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import tiny_hf_model
from jax.sharding import PartitionSpec
from safetensors.torch import load_file, save_file

from converters import hf_to_flax as hf_to_flax_cli
from empatheia_jax import load_model
from empatheia_jax.models.lora import LoraConfig, apply_lora, set_lora_b
from empatheia_jax.serve.generation import generate_tokens
from empatheia_jax.sharding import make_mesh
from empatheia_jax.weights import hf_to_flax
from empatheia_jax.weights.checkpoint_io import CheckpointError, empty_model, load_checkpoint, save_checkpoint
from empatheia_jax.weights.hf_names import ConversionError

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
VARIANTS = {
    "mha-untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "gqa-llama3-rope": dict(num_key_value_heads=1, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
}
SEQ = 48  # > 3x original_max_position_embeddings: llama3 scaling changes the low frequencies here


@pytest.fixture(autouse=True)
def _exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _ids(vocab: int, batch: int = 2, seq: int = SEQ, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int64)


def _hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.from_numpy(ids)).logits.float().numpy()


def _save_hf(hf, folder: Path, **kw) -> Path:
    hf.save_pretrained(folder, safe_serialization=True, **kw)
    return folder


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each variant: (hf model, converted folder), converted once for the module."""
    out = {}
    for name, kw in VARIANTS.items():
        base = tmp_path_factory.mktemp(name)
        hf = tiny_hf_model(seed=len(out), **kw)
        out[name] = (hf, hf_to_flax.convert(_save_hf(hf, base / "hf"), base / "converted"))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(converted, variant):
    hf, folder = converted[variant]
    model, tokenizer = load_model(folder)
    assert tokenizer is None  # a bare weights folder has none
    assert model.config.tie_word_embeddings == VARIANTS[variant]["tie_word_embeddings"]
    ids = _ids(hf.config.vocab_size)
    ours = np.asarray(model(jnp.asarray(ids)))
    assert ours.dtype == np.float32 and ours.shape == (2, SEQ, hf.config.vocab_size)
    np.testing.assert_allclose(ours, _hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_llama3_rope_scaling_matters(converted):
    """The llama3 case would pass trivially if scaling changed nothing at this length; check it does."""
    hf, folder = converted["gqa-llama3-rope"]
    model, _ = load_model(folder)
    assert model.config.rope_scaling["rope_type"] == "llama3"
    plain = empty_model(model.config.replace(rope_scaling=None))
    nnx.update(plain, nnx.state(model))
    ids = _ids(hf.config.vocab_size)
    diff = np.abs(np.asarray(plain(jnp.asarray(ids))) - _hf_logits(hf, ids)).max()
    assert diff > 1e-2


def test_sharded_safetensors_bf16_extra_vocab_and_cli(tmp_path):
    hf = tiny_hf_model(seed=7)
    src = _save_hf(hf, tmp_path / "hf", max_shard_size="40KB")
    assert (src / "model.safetensors.index.json").is_file()
    assert hf_to_flax_cli.main(["--src", str(src), "--out", str(tmp_path / "f32"), "--extra-vocab", "3"]) == 0
    model, _ = load_model(tmp_path / "f32")
    ids = _ids(hf.config.vocab_size, seed=1)
    logits = np.asarray(model(jnp.asarray(ids)))
    np.testing.assert_allclose(logits[..., : hf.config.vocab_size], _hf_logits(hf, ids), atol=1e-4, rtol=0)
    # Added rows start at the mean of the pretrained rows (DESIGN §2).
    emb = np.asarray(model.embed_tokens.embedding[...])
    np.testing.assert_allclose(np.asarray(model.embed_extra[...]),
                               np.repeat(emb.mean(0, keepdims=True), 3, 0), atol=1e-7)
    head = np.asarray(model.lm_head.kernel[...])
    np.testing.assert_allclose(np.asarray(model.lm_head_extra[...]),
                               np.repeat(head.mean(1, keepdims=True), 3, 1), atol=1e-7)
    # bfloat16: parameters stored in bf16, logits still float32 and close to the reference.
    bf16 = hf_to_flax.convert(src, tmp_path / "bf16", dtype="bfloat16")
    model16, _ = load_model(bf16)
    assert model16.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    out16 = np.asarray(model16(jnp.asarray(ids)))
    assert out16.dtype == np.float32
    ref = _hf_logits(hf, ids)
    assert np.abs(out16 - ref).mean() < 0.03 and (out16.argmax(-1) == ref.argmax(-1)).mean() > 0.9
    # The CLI reports errors without a traceback and exits non-zero.
    assert hf_to_flax_cli.main(["--src", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 1


def test_load_hf_model_into_flax_from_object():
    hf = tiny_hf_model(seed=3, tie_word_embeddings=True)
    model = hf_to_flax.load_hf_model_into_flax(hf)
    ids = _ids(hf.config.vocab_size, seed=2)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), _hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_lora_checkpoint_roundtrip_sharded(tmp_path):
    """save_checkpoint keeps LoRA adapters; load with a mesh restores each parameter into its shards."""
    model = hf_to_flax.load_hf_model_into_flax(tiny_hf_model(seed=5))
    lora = LoraConfig(rank=2, alpha=4.0)
    apply_lora(model, lora, rngs=nnx.Rngs(1))
    set_lora_b(model, jax.random.key(2), std=0.2)
    ids = jnp.asarray(_ids(128, seed=3))
    ref = np.asarray(model(ids))
    folder = save_checkpoint(tmp_path / "lora", model, lora=lora, source="unit test")
    assert json.loads((folder / "config.json").read_text())["lora"] == lora.to_dict()
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    loaded, _ = load_checkpoint(folder, mesh=mesh)
    kernel = loaded.layers[0].mlp.gate_proj.kernel[...]
    assert kernel.sharding.mesh.shape == mesh.shape
    assert kernel.sharding.spec == PartitionSpec("fsdp", "tensor")
    assert loaded.layers[0].self_attn.q_proj.lora.lora_b[...].shape == (2, 32)
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(np.asarray(loaded(ids)), ref, atol=1e-5, rtol=0)
    # The decode program runs on the sharded parameters too (GSPMD), with the same ids.
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    np.testing.assert_array_equal(generate_tokens(loaded, prompts, 8, eos_ids=[]).new_tokens,
                                  generate_tokens(model, prompts, 8, eos_ids=[]).new_tokens)
    with pytest.raises(FileExistsError, match="already exists"):
        save_checkpoint(folder, model, lora=lora)
    with pytest.raises(ValueError, match="pass lora="):
        save_checkpoint(tmp_path / "nolora", model)
    assert not list(tmp_path.glob("*.tmp-*"))  # failed writes leave nothing behind


# ----------------------------------------------------------------------------------------------------------
# Errors: each names the file / tensor / key at fault
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return _save_hf(tiny_hf_model(seed=11), tmp_path_factory.mktemp("err") / "hf")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_error_truncated_safetensors(hf_folder, tmp_path):
    src = _copy(hf_folder, tmp_path / "hf")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ConversionError, match=r"model\.safetensors.*truncated or corrupt"):
        hf_to_flax.convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_error_missing_tensor(hf_folder, tmp_path):
    src = _copy(hf_folder, tmp_path / "hf")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        hf_to_flax.convert(src, tmp_path / "out")


def test_error_config_shapes_mismatch_tensors(hf_folder, tmp_path):
    src = _copy(hf_folder, tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape"):
        hf_to_flax.convert(src, tmp_path / "out")


def test_error_not_llama(hf_folder, tmp_path):
    src = _copy(hf_folder, tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"config\.json.*model_type='gpt2' is not a LLaMA"):
        hf_to_flax.convert(src, tmp_path / "out")


def test_error_missing_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_to_flax.convert(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match=r"empty/config\.json is missing"):
        hf_to_flax.convert(tmp_path / "empty", tmp_path / "out")


@pytest.fixture(scope="module")
def converted_ok(hf_folder, tmp_path_factory):
    return hf_to_flax.convert(hf_folder, tmp_path_factory.mktemp("ok") / "converted")


def test_error_missing_folder_and_complete(converted_ok, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nothing")
    folder = _copy(converted_ok, tmp_path / "c")
    (folder / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        load_model(folder)


def test_error_corrupt_params_file(converted_ok, tmp_path):
    folder = _copy(converted_ok, tmp_path / "c")
    data_files = sorted((folder / "params").rglob("d/*"), key=lambda p: p.stat().st_size)
    target = data_files[-1]
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 3])
    with pytest.raises(CheckpointError, match=r"cannot read parameters \['.*'\] from .*params.*corrupt"):
        load_model(folder)


def test_error_converted_config_mismatch(converted_ok, tmp_path):
    folder = _copy(converted_ok, tmp_path / "c")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (folder / "config.json").write_text(json.dumps(cfg))
    msg = r"parameter 'layers\.0\.mlp\.down_proj\.kernel' has shape \(64, 32\)"
    with pytest.raises(CheckpointError, match=msg):
        load_model(folder)


def test_error_converted_config_invalid_key(converted_ok, tmp_path):
    folder = _copy(converted_ok, tmp_path / "c")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_experts"] = 4
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: unknown LlamaConfig keys: \['num_experts'\]"):
        load_model(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        load_model(folder)
