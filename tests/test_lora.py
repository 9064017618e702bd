"""LoRA: numerics against PEFT, export round trips (PEFT adapter, merged HF), merge/unmerge, trainability.

Every comparison is of values (logits, kernels, optimizer leaves), against PyTorch transformers/peft as
the independent reference, on tiny random GQA models so the whole file runs in seconds.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import require, tiny_hf_model

torch = require("torch", "the PyTorch reference")
peft = require("peft", "the LoRA reference and the adapter export")
transformers = require("transformers", "the HF reference models")

from converters import export_hf as export_hf_cli  # noqa: E402
from empatheia_jax.models.llama import Llama, LlamaConfig, init_added_rows  # noqa: E402
from empatheia_jax.models.lora import (  # noqa: E402
    LoraConfig,
    LoRALinear,
    apply_lora,
    lora_config_of,
    lora_layers,
    merge_lora,
    set_lora_b,
    unmerge_lora,
)
from empatheia_jax.models.trainable import trainable_filter  # noqa: E402
from empatheia_jax.weights.checkpoint_io import save_checkpoint  # noqa: E402
from empatheia_jax.weights.export_hf import ExportError, export_merged, export_peft  # noqa: E402
from empatheia_jax.weights.hf_names import load_hf_tensors  # noqa: E402

LORA = LoraConfig(rank=4, alpha=12.0)  # scale 3, so a missing/doubled alpha/r shows up
TOL = 1e-4
VOCAB = 96


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def tiny_hf(tied: bool, seed: int = 0):
    """Random GQA LlamaForCausalLM (4 query heads over 2 KV heads, random norm scales), eval, fp32."""
    return tiny_hf_model(seed, tie_word_embeddings=tied, vocab_size=VOCAB, hidden_size=64,
                         intermediate_size=96, head_dim=16, initializer_range=0.05)


def ours_from_hf(hf, extra_vocab: int = 0) -> Llama:
    cfg = LlamaConfig.from_hf(hf.config.to_dict(), extra_vocab=extra_vocab)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    load_hf_tensors(model, lambda n: sd[n], set(sd))
    init_added_rows(model)
    return model


def with_lora(model: Llama, seed: int = 1, lora: LoraConfig = LORA) -> Llama:
    apply_lora(model, lora, rngs=nnx.Rngs(seed))
    set_lora_b(model, jax.random.key(seed), std=0.05)
    return model


def randomize_added_rows(model: Llama, seed: int = 7) -> None:
    """Trained-looking added rows (the mean-initialised rows would all be identical)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    model.embed_extra[...] = 0.05 * jax.random.normal(k1, model.embed_extra.shape)
    if not model.config.tie_word_embeddings:
        model.lm_head_extra[...] = 0.05 * jax.random.normal(k2, model.lm_head_extra.shape)


def tokens(vocab: int, batch: int = 2, length: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int64)


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids)).logits.float().numpy()


def our_logits(model: Llama, ids: np.ndarray) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids, jnp.int32)))


def test_lora_forward_matches_peft_get_peft_model():
    """Independent of our exporter: PEFT's own LoRA layers with our A/B copied in give our logits."""
    hf = tiny_hf(tied=True)
    ours = with_lora(ours_from_hf(hf))
    pcfg = peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=list(LORA.targets),
                           lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    ref = peft.get_peft_model(tiny_hf(tied=True), pcfg).eval()
    with torch.no_grad():
        for i, layer in enumerate(ours.layers):
            for t in LORA.targets:
                mine = getattr(layer.self_attn, t).lora
                theirs = getattr(ref.base_model.model.model.layers[i].self_attn, t)
                theirs.lora_A["default"].weight.copy_(torch.tensor(np.asarray(mine.lora_a[...]).T))
                theirs.lora_B["default"].weight.copy_(torch.tensor(np.asarray(mine.lora_b[...]).T))
    ids = tokens(VOCAB)
    expected = hf_logits(ref, ids)
    got = our_logits(ours, ids)
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
    # The adapter must matter, or the comparison above proves nothing about LoRA.
    assert np.abs(expected - hf_logits(tiny_hf(tied=True), ids)).max() > 1e-2


@pytest.mark.parametrize("tied", [True, False])
def test_peft_export_loads_in_peft_with_same_logits(tmp_path, tied):
    hf = tiny_hf(tied)
    ours = with_lora(ours_from_hf(hf))
    out = export_peft(ours, LORA, tmp_path / "adapter", "tiny-base")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["task_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 12.0)
    assert cfg["base_model_name_or_path"] == "tiny-base"
    assert not list(tmp_path.glob("adapter.tmp-*"))  # the temporary folder was renamed, not left behind

    loaded = peft.PeftModel.from_pretrained(tiny_hf(tied), str(out)).eval()
    # Key names are PEFT's: nothing was silently dropped (loaded B equals ours, layer by layer).
    b = loaded.base_model.model.model.layers[1].self_attn.v_proj.lora_B["default"].weight.detach().numpy()
    np.testing.assert_array_equal(b, np.asarray(ours.layers[1].self_attn.v_proj.lora.lora_b[...]).T)
    ids = tokens(VOCAB)
    np.testing.assert_allclose(our_logits(ours, ids), hf_logits(loaded, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_peft_export_carries_added_rows_as_trainable_tokens(tmp_path, tied):
    """extra_vocab>0: rows travel as PEFT trainable_token_indices; the base is resized before loading."""
    extra = 3
    hf = tiny_hf(tied)
    ours = with_lora(ours_from_hf(hf, extra_vocab=extra))
    randomize_added_rows(ours)
    out = export_peft(ours, None, tmp_path / "adapter", "tiny-base")
    base = tiny_hf(tied)
    base.resize_token_embeddings(VOCAB + extra, mean_resizing=False)  # rows are overwritten by the adapter
    loaded = peft.PeftModel.from_pretrained(base, str(out)).eval()
    ids = tokens(VOCAB + extra, length=16)
    ids[:, 3] = VOCAB + np.arange(ids.shape[0])  # make sure added tokens are among the inputs
    expected = hf_logits(loaded, ids)
    assert expected.shape[-1] == VOCAB + extra
    np.testing.assert_allclose(our_logits(ours, ids), expected, atol=TOL, rtol=0)


def test_peft_export_without_lora_is_refused(tmp_path):
    ours = ours_from_hf(tiny_hf(tied=True))
    with pytest.raises(ExportError, match="no LoRA adapter.*--merged"):
        export_peft(ours, None, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("tied,extra", [(True, 0), (False, 0), (True, 3), (False, 3)])
def test_merged_export_loads_in_transformers_with_same_logits(tmp_path, tied, extra):
    hf = tiny_hf(tied)
    ours = with_lora(ours_from_hf(hf, extra_vocab=extra))
    if extra:
        randomize_added_rows(ours)
    kernel_before = np.asarray(ours.layers[0].self_attn.q_proj.kernel[...]).copy()
    out = export_merged(ours, None, tmp_path / "merged")
    np.testing.assert_array_equal(np.asarray(ours.layers[0].self_attn.q_proj.kernel[...]), kernel_before)
    assert not any(isinstance(m, LoRALinear) and m.merged for m in lora_layers(ours))

    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert ("lm_head.weight" in set(f.keys())) is (not tied)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert loaded.config.vocab_size == VOCAB + extra
    ids = tokens(VOCAB + extra, length=16)
    np.testing.assert_allclose(our_logits(ours, ids), hf_logits(loaded, ids), atol=TOL, rtol=0)
    # LoRA really is in the merged weights: the plain base gives different logits.
    if not extra:
        assert np.abs(hf_logits(hf, ids) - hf_logits(loaded, ids)).max() > 1e-2


def test_merged_export_shards_with_index(tmp_path):
    hf = tiny_hf(tied=False)
    ours = with_lora(ours_from_hf(hf))
    out = export_merged(ours, None, tmp_path / "merged", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).exists() for s in shards)
    assert not (out / "model.safetensors").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = tokens(VOCAB)
    np.testing.assert_allclose(our_logits(ours, ids), hf_logits(loaded, ids), atol=TOL, rtol=0)


def test_merge_unmerge():
    ours = with_lora(ours_from_hf(tiny_hf(tied=True)))
    ids = tokens(VOCAB)
    unmerged = our_logits(ours, ids)
    base = {id(m): np.asarray(m.kernel[...]).copy() for m in lora_layers(ours)}
    merge_lora(ours)
    assert all(m.merged for m in lora_layers(ours))
    changed = max(np.abs(np.asarray(m.kernel[...]) - base[id(m)]).max() for m in lora_layers(ours))
    assert changed > 1e-3
    np.testing.assert_allclose(our_logits(ours, ids), unmerged, atol=1e-5, rtol=0)
    unmerge_lora(ours)
    for m in lora_layers(ours):
        np.testing.assert_allclose(np.asarray(m.kernel[...]), base[id(m)], atol=1e-6, rtol=0)
    np.testing.assert_allclose(our_logits(ours, ids), unmerged, atol=1e-5, rtol=0)


def test_lora_config_read_back():
    ours = with_lora(ours_from_hf(tiny_hf(tied=True)), lora=LoraConfig(rank=2, alpha=5.0, targets=("q_proj",
                                                                                                    "down_proj")))
    assert lora_config_of(ours) == LoraConfig(rank=2, alpha=5.0, targets=("q_proj", "down_proj"))
    assert lora_config_of(ours_from_hf(tiny_hf(tied=True))) is None


# ----------------------------------------------------------------------------------------------------------
# Trainability: the optimizer sees only the chosen groups; one jitted step leaves everything else untouched
# ----------------------------------------------------------------------------------------------------------


def _paths(state: nnx.State) -> set[tuple]:
    return {tuple(str(p) for p in path) for path, _ in nnx.to_flat_state(state)}


def _leaf_dict(state: nnx.State) -> dict[tuple, np.ndarray]:
    return {tuple(str(p) for p in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(state)}


def _train_step(model: Llama, wrt, ids: np.ndarray) -> nnx.Optimizer:
    """One AdamW step, jax.jit over nnx.split state, gradient only w.r.t. the `wrt` parameters."""
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.0), wrt=wrt)
    graphdef, trainable, rest = nnx.split(model, wrt, ...)
    opt_graph, opt_state = nnx.split(optimizer)

    @jax.jit
    def step(trainable, rest, opt_state, ids):
        def loss_fn(trainable):
            m = nnx.merge(graphdef, trainable, rest)
            logits = m(ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        m = nnx.merge(graphdef, trainable, rest)
        opt = nnx.merge(opt_graph, opt_state)
        opt.update(m, grads)
        return loss, nnx.state(m, wrt), nnx.state(opt)

    _, new_trainable, new_opt = step(trainable, rest, opt_state, jnp.asarray(ids, jnp.int32))
    nnx.update(model, new_trainable)
    nnx.update(optimizer, new_opt)
    return optimizer


def test_optimizer_covers_only_lora_and_step_changes_only_lora():
    model = with_lora(ours_from_hf(tiny_hf(tied=False)))
    before = _leaf_dict(nnx.state(model))
    optimizer = _train_step(model, nnx.LoRAParam, tokens(VOCAB, length=16))

    lora_paths = {p for p in before if p[-2] in ("lora_a", "lora_b") or p[-1] in ("lora_a", "lora_b")}
    assert len(lora_paths) == 2 * 2 * 4  # layers x (A, B) x q/k/v/o
    mu = nnx.state(optimizer.opt_state)[0]["mu"]
    assert _paths(mu) == lora_paths
    after = _leaf_dict(nnx.state(model))
    for path, value in before.items():
        if path in lora_paths:
            if "lora_b" in path:
                assert np.abs(after[path] - value).max() > 0, f"{path} did not train"
        else:
            np.testing.assert_array_equal(after[path], value, err_msg=f"{path} changed")


@pytest.mark.parametrize("tied", [True, False])
def test_added_rows_filter_trains_new_rows_only(tied):
    model = with_lora(ours_from_hf(tiny_hf(tied), extra_vocab=3))
    wrt = trainable_filter({"lora", "added_rows"})
    ids = tokens(VOCAB + 3, length=16)
    ids[:, 5] = VOCAB + np.arange(ids.shape[0])
    before = _leaf_dict(nnx.state(model))
    optimizer = _train_step(model, wrt, ids)

    extra_names = {"embed_extra"} if tied else {"embed_extra", "lm_head_extra"}
    trained = {p for p in before if "lora_a" in p or "lora_b" in p or p[-1] in extra_names}
    assert _paths(nnx.state(optimizer.opt_state)[0]["mu"]) == trained
    after = _leaf_dict(nnx.state(model))
    for name in extra_names:
        assert np.abs(after[(name,)] - before[(name,)]).max() > 0, f"{name} did not train"
    for path in before.keys() - trained:
        np.testing.assert_array_equal(after[path], before[path], err_msg=f"{path} changed")
    np.testing.assert_array_equal(after[("embed_tokens", "embedding")], before[("embed_tokens", "embedding")])


def _token_nll(model: Llama, ids: np.ndarray, targets: np.ndarray, chunk: int) -> jax.Array:
    hidden, _ = model.decode(model.embed(jnp.asarray(ids, jnp.int32)))
    return model.token_nll(hidden, jnp.asarray(targets, jnp.int32), chunk=chunk)


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_token_nll_equals_torch_cross_entropy(tied):
    """5 positions a chunk over 12 (a ragged last chunk): torch's per-token CE of the HF model's logits."""
    hf = tiny_hf(tied)
    ids, targets = tokens(VOCAB), tokens(VOCAB, seed=1)
    with torch.no_grad():
        logits = hf(input_ids=torch.from_numpy(ids)).logits.transpose(1, 2)
        want = torch.nn.functional.cross_entropy(logits, torch.from_numpy(targets), reduction="none").numpy()
    ours = ours_from_hf(hf)
    for chunk in (0, 5, 12):
        got = np.asarray(_token_nll(ours, ids, targets, chunk))
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL, err_msg=f"chunk {chunk}")


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_token_nll_gives_the_whole_logits_gradients(tied):
    """What training sees: the gradient of every parameter (LoRA, added rows, the tables) through the
    recomputed chunks equals the gradient through the whole logits, added-token targets included."""
    model = with_lora(ours_from_hf(tiny_hf(tied), extra_vocab=3))
    randomize_added_rows(model)
    ids, targets = tokens(VOCAB + 3), tokens(VOCAB + 3, seed=1)
    graphdef, state = nnx.split(model)

    def loss(state, chunk):
        return _token_nll(nnx.merge(graphdef, state), ids, targets, chunk).mean()

    whole, whole_grads = jax.value_and_grad(loss)(state, 0)
    chunked, chunked_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(state, 5)
    np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-6)
    want, got = _leaf_dict(whole_grads), _leaf_dict(chunked_grads)
    assert want.keys() == got.keys()
    for path, g in want.items():
        assert np.abs(g).max() > 0, f"{path}: no gradient to compare"
        np.testing.assert_allclose(got[path], g, rtol=1e-4, atol=1e-6, err_msg=str(path))


def test_trainable_filter_rejects_unknown_group():
    with pytest.raises(ValueError, match="unknown trainable groups"):
        trainable_filter({"lora", "whole_embedding"})


# ----------------------------------------------------------------------------------------------------------
# The command line, from a converted checkpoint folder
# ----------------------------------------------------------------------------------------------------------


def test_cli_exports_peft_and_merged_from_checkpoint(tmp_path, capsys):
    hf = tiny_hf(tied=False)
    ours = with_lora(ours_from_hf(hf))
    ckpt = save_checkpoint(tmp_path / "ckpt", ours, lora=LORA, source="tiny-source")
    assert export_hf_cli.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "peft"), "--peft"]) == 0
    assert export_hf_cli.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "merged"), "--merged"]) == 0
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "tiny-source"
    ids = tokens(VOCAB)
    expected = our_logits(ours, ids)
    adapter = peft.PeftModel.from_pretrained(tiny_hf(tied=False), str(tmp_path / "peft")).eval()
    np.testing.assert_allclose(hf_logits(adapter, ids), expected, atol=TOL, rtol=0)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    np.testing.assert_allclose(hf_logits(merged, ids), expected, atol=TOL, rtol=0)
    # An existing output folder is not replaced silently.
    assert export_hf_cli.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "peft"), "--peft"]) == 2
    assert "exists" in capsys.readouterr().err


def test_cli_peft_without_lora_fails_clearly(tmp_path, capsys):
    ckpt = save_checkpoint(tmp_path / "ckpt", ours_from_hf(tiny_hf(tied=True)))
    assert export_hf_cli.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "peft"), "--peft"]) == 2
    err = capsys.readouterr().err
    assert "no LoRA adapter" in err and "--merged" in err
    assert not (tmp_path / "peft").exists()
