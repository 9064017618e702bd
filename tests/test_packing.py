"""Sequence packing of the text stages (`data.pack_len`, `batching.pack_text_batch`, segment-aware
attention in `Llama.decode`): a packed batch's loss and gradients equal the unpacked batch's, i.e. the sum
over its turns; a mask that lets a turn see the one before it in the row breaks that equality."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from empatheia_jax.data.batching import PACKED_KEYS, pack_text_batch
from empatheia_jax.models import trainable
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.models.lora import set_lora_b
from empatheia_jax.train import objective, stages
from tests.helpers import FAST
from tests.test_empatheia import BOS, CFG, EOS, PAD, SEP, V

LENGTHS = (9, 14, 6, 11)
T = 16


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def text_batch(seed: int = 0, lengths=LENGTHS) -> dict[str, np.ndarray]:
    """A right-padded text batch (no placeholders): BOS, prompt, SEP, reply, EOS; the loss on the reply."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    ids = np.full((b, T), PAD, np.int32)
    loss_mask = np.zeros((b, T), np.int32)
    attn = np.zeros((b, T), np.int32)
    for i, n in enumerate(lengths):
        prompt = (n - 3) // 2
        seq = [BOS, *rng.integers(5, V, prompt), SEP, *rng.integers(5, V, n - prompt - 3), EOS]
        ids[i, :n] = seq
        attn[i, :n] = 1
        loss_mask[i, prompt + 1:n - 1] = 1  # position t predicts token t+1: the reply and EOS
    target = np.full((b, T), PAD, np.int32)
    target[:, :-1] = ids[:, 1:]
    return {"input_ids": ids, "target_ids": target, "loss_mask": loss_mask, "response_mask": loss_mask.copy(),
            "positions": np.tile(np.arange(T, dtype=np.int32), (b, 1)), "attention_mask": attn,
            "aud_mask": np.zeros((b, 3), np.int32), "vid_mask": np.zeros((b, 3), np.int32),
            "emotion": np.arange(b, dtype=np.int32)}


@functools.partial(jax.jit, static_argnames=("graphdef",), compiler_options=FAST)
def _loss_and_grads(graphdef, params, frozen, batch, rng):
    loss_fn = objective.make_loss_fn(stages.STAGES["coe"])
    return jax.value_and_grad(loss_fn, has_aux=True)(params, graphdef, frozen, batch, rng)


def coe_loss(batch: dict[str, np.ndarray], **fields):
    cfg = dataclasses.replace(CFG, **fields)
    model = Empatheia(cfg, rngs=nnx.Rngs(3))
    set_lora_b(model.llm, jax.random.key(103), std=0.05)
    wrt = trainable.trainable_filter(stages.STAGES["coe"].trainable_groups)
    graphdef, params, frozen = nnx.split(model, wrt, ...)
    jb = {k: jnp.asarray(v) for k, v in batch.items() if k in PACKED_KEYS}
    rng = jax.random.split(jax.random.key(1), jb["input_ids"].shape[0])
    (total, metrics), grads = _loss_and_grads(graphdef, params, frozen, jb, rng)
    flat = {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}
    return float(total), float(metrics["emp_tokens"]), flat


def _same(got, ref, what, rtol=1e-5):
    np.testing.assert_allclose(got[0], ref[0], rtol=rtol, err_msg=what)
    assert got[1] == ref[1], what
    for k, g in ref[2].items():
        err, scale = np.abs(got[2][k] - g).max(), np.abs(g).max()
        assert err <= rtol * scale + 1e-9, (what, k, err, scale)


def test_pack_text_batch_places_turns_first_fit_decreasing_with_restarting_positions():
    batch = text_batch()
    packed = pack_text_batch(batch, 24, pad_id=PAD)
    assert set(packed) == set(PACKED_KEYS)
    assert packed["input_ids"].shape == (2, 24)  # 14 + 9 | 11 + 6
    np.testing.assert_array_equal(packed["segment_ids"][0], [1] * 14 + [2] * 9 + [0])
    np.testing.assert_array_equal(packed["segment_ids"][1], [1] * 11 + [2] * 6 + [0] * 7)
    np.testing.assert_array_equal(packed["positions"][0, :23], list(range(14)) + list(range(9)))
    np.testing.assert_array_equal(packed["input_ids"][0, 14:23], batch["input_ids"][0, :9])
    assert packed["loss_mask"].sum() == batch["loss_mask"].sum()
    assert packed["attention_mask"].sum() == batch["attention_mask"].sum()
    assert pack_text_batch(batch, 24, pad_id=PAD, row_multiple=4)["input_ids"].shape == (4, 24)
    with pytest.raises(ValueError, match="does not fit"):
        pack_text_batch(batch, 12, pad_id=PAD)
    media = dict(batch, aud_mask=np.ones((4, 3), np.int32))
    with pytest.raises(ValueError, match="media"):
        pack_text_batch(media, 24, pad_id=PAD)


@pytest.mark.parametrize("ce_targets", [0, 4])
def test_a_packed_batch_has_the_loss_and_gradients_of_its_turns_unpacked(ce_targets):
    """The coe loss (mean over every loss token) and its LoRA gradients: packed == unpacked, and the
    packed loss x tokens == the sum over the turns, each run alone. Then the planted bug: the second turn
    of a row made the same segment as the first (it may attend to the turn before it) changes the loss,
    so the equality above would fail. (Positions restart per turn as unpacked; RoPE being relative, a
    constant offset within a turn would not change its loss, so the segment mask is what keeps it exact.)"""
    batch = text_batch()
    ref = coe_loss(batch, ce_targets=ce_targets)
    packed = pack_text_batch(batch, 24, pad_id=PAD)
    got = coe_loss(packed, ce_targets=ce_targets)
    _same(got, ref, "packed")
    per_turn = [coe_loss({k: v[i:i + 1] for k, v in batch.items()}) for i in range(len(LENGTHS))]
    np.testing.assert_allclose(got[0] * got[1], sum(t[0] * t[1] for t in per_turn), rtol=1e-5)

    leaky = {k: v.copy() for k, v in packed.items()}
    leaky["segment_ids"] = np.where(leaky["segment_ids"] > 0, 1, 0).astype(np.int32)  # one segment per row
    assert not np.isclose(coe_loss(leaky, ce_targets=ce_targets)[0], ref[0], rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# The trainer with data.pack_len
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tests.helpers import saved_smollm2_tokenizer

    return saved_smollm2_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from tests.helpers import make_tiny_shards

    return make_tiny_shards(tmp_path_factory.mktemp("packing_data"))


def _tiny(tok, shards, stage="coe", **overrides):
    from configs import tiny

    c = tiny.get_config()
    c.model.tokenizer, c.data.shards, c.stage = str(tok), str(shards), stage
    c.schedule[stage].steps = 3
    c.train.eval_every = 1000
    for key, value in overrides.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def _train_losses(cfg, workdir) -> list[float]:
    import json

    from empatheia_jax.train import trainer

    trainer.train(cfg, workdir)
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [line["train/total"] for line in lines if "train/total" in line]


def test_a_packed_coe_run_trains_like_the_unpacked_one(tok, shards, tmp_path):
    """data.pack_len in the real trainer (conftest's 8 devices: the packed rows are padded to a multiple of
    8, the row axis sharded over them): the coe stage's logged losses equal the unpacked run's step for
    step; a stage with heads and a pack_len below max_len are refused before anything is built."""
    from empatheia_jax.train import config as config_lib
    from empatheia_jax.train import trainer

    ref = _train_losses(_tiny(tok, shards), tmp_path / "ref")
    got = _train_losses(_tiny(tok, shards, **{"data.pack_len": 512, "model.empatheia.ce_targets": 64}),
                        tmp_path / "packed")
    assert len(ref) == 3 and np.isfinite(ref).all()
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    with pytest.raises(config_lib.ConfigError, match="stage 'sac' reads per-example targets"):
        trainer.train(_tiny(tok, shards, stage="sac", **{"data.pack_len": 512}), tmp_path / "sac")
    with pytest.raises(config_lib.ConfigError, match="data.pack_len=128: must be 0 or >= data.max_len"):
        trainer.train(_tiny(tok, shards, **{"data.pack_len": 128}), tmp_path / "short")
    with pytest.raises(config_lib.ConfigError, match="model.empatheia.ce_targets=-1"):
        trainer.train(_tiny(tok, shards, **{"model.empatheia.ce_targets": -1}), tmp_path / "neg")
