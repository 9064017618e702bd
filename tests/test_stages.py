"""The training stages: stage data and ablations, freezing (one jitted update touches only the stage's
groups), and learning (each stage's loss halves on a synthetic task; the style classifiers generalise).

The synthetic task makes every target a function of the inputs: the reply maps prompt words through a
fixed permutation; content rows are fixed random vectors of the reply tokens; style codes are fixed random
projections of the spliced speaker features; labels are argmaxes of projections of a few feature dims.
One compiled step per stage serves both the freezing and the learning test.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.models.llama import init_added_rows
from empatheia_jax.models.lora import set_lora_b
from empatheia_jax.models.trainable import trainable_filter
from empatheia_jax.train import losses, objective, stages
from empatheia_jax.train import step as step_lib
from empatheia_jax.train.stages import (
    PIPELINE_BASELINE,
    STAGE_ORDER,
    STAGES,
    Stage,
    StageSkipped,
    apply_ablations,
)
from tests.test_empatheia import BOS, CFG, EOS, FAST, PAD, SEP, V

AUD, VID = CFG.aud_token_id, CFG.vid_token_id
SIGNALS = list(CFG.aud_signal_ids) + list(CFG.vid_signal_ids)
B, T = 8, 20
TX = optax.adam(3e-3)  # one object: the optimizer graphdef (hence the compiled step) is shared


@pytest.fixture(autouse=True)
def _highest_precision():  # the same jit-cache context as test_empatheia, so model builds are reused
    with jax.default_matmul_precision("highest"):
        yield


# ----------------------------------------------------------------------------------------------------------
# Stages as data
# ----------------------------------------------------------------------------------------------------------


def test_stage_table_matches_the_paper():
    assert STAGES["coe"].trainable_groups == {"lora"}
    assert STAGES["ccl"].trainable_groups == {"cs"}
    assert STAGES["sac"].trainable_groups == {"sd", "proj", "added_rows"}
    assert STAGES["overall"].trainable_groups == {"lora", "cs", "sd", "proj", "added_rows"}
    assert STAGES["coe"].loss_terms == (losses.EMP,)
    assert set(STAGES["ccl"].loss_terms) == {*losses.CCL_TERMS, losses.KL}
    sac_terms = {*losses.SAL_TERMS, *losses.CLS_TERMS, losses.SIGNAL_CE, losses.KL}
    assert set(STAGES["sac"].loss_terms) == sac_terms
    assert losses.SIGNAL_CE not in STAGES["overall"].loss_terms  # signal tokens are part of L_emp there
    assert [STAGES[n].heads for n in STAGE_ORDER] == [set(), {"cs"}, {"sd"}, {"cs", "sd"}]
    # not a paper stage: ccl from the units alone, no LLM
    units = STAGES["ccl_units"]
    assert (units.trainable_groups, units.loss_terms, units.template_stage) == (
        STAGES["ccl"].trainable_groups, STAGES["ccl"].loss_terms, "ccl")
    assert not units.reads_llm and all(STAGES[n].reads_llm for n in STAGE_ORDER)
    assert "ccl_units" not in STAGE_ORDER
    spec = STAGES["sac"].template_spec(n_signal=16)
    assert spec.stage == "sac" and spec.has_media and spec.has_signal and not spec.has_text
    assert PIPELINE_BASELINE.template_spec().pipeline_baseline
    assert PIPELINE_BASELINE.trainable_groups == {"lora"}
    for s in (*STAGES.values(), PIPELINE_BASELINE):
        assert Stage.from_dict(json.loads(json.dumps(s.to_dict()))) == s
        assert stages.get_stage(s.name) is s
    with pytest.raises(ValueError, match="unknown trainable groups"):
        Stage("x", frozenset({"everything"}), (losses.EMP,), "coe", "coe")
    with pytest.raises(ValueError, match="not part of"):
        Stage("x", frozenset({"lora"}), (losses.CCL_SPEECH,), "coe", "coe")


def test_ablations_remove_groups_terms_and_whole_stages():
    no_cs = apply_ablations(STAGES["overall"], no_cs=True)
    assert no_cs.trainable_groups == {"lora", "sd", "proj", "added_rows"}
    assert not set(losses.CCL_TERMS) & set(no_cs.loss_terms) and no_cs.heads == {"sd"}
    no_sd = apply_ablations(STAGES["overall"], no_sd=True)
    assert no_sd.trainable_groups == {"lora", "cs", "proj", "added_rows"} and no_sd.heads == {"cs"}
    no_media = apply_ablations(STAGES["overall"], no_media=True)
    assert "proj" not in no_media.trainable_groups and no_media.pipeline_fields()["media_input"] is False
    assert not no_media.template_spec().has_media
    assert apply_ablations(STAGES["coe"], no_coe=True).template_spec().use_coe is False
    with pytest.raises(StageSkipped):
        apply_ablations(STAGES["ccl"], no_cs=True)
    with pytest.raises(StageSkipped):
        apply_ablations(STAGES["sac"], no_sd=True)
    with pytest.raises(StageSkipped):
        apply_ablations(STAGES["sac"], no_media=True)
    assert [s.name for s in stages.stage_plan(no_cs=True, no_media=True)] == ["coe", "overall"]
    assert [s.name for s in stages.stage_plan()] == ["coe", "ccl", "sac", "overall"]


def test_make_optimizer_refuses_groups_the_model_lacks():
    model = Empatheia(CFG.replace(use_cs=False), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\['cs'\]"):
        stages.make_optimizer(model, STAGES["ccl"], TX)


# ----------------------------------------------------------------------------------------------------------
# Synthetic task
# ----------------------------------------------------------------------------------------------------------

_P = np.random.default_rng(1234)
WORDS = np.arange(5, 13)
REPLY = dict(zip(WORDS.tolist(), _P.permutation(np.arange(13, 21)).tolist(), strict=True))
TOK_S, TOK_V = _P.normal(size=(V, 8)), _P.normal(size=(V, 8))
PROJ_S, PROJ_V = _P.normal(size=(8, 12)) / np.sqrt(12), _P.normal(size=(8, 10)) / np.sqrt(10)


def stage_batch(stage: str, seed: int, n: int = B) -> dict[str, np.ndarray]:
    """A batch in the pipeline's layout for `stage`'s template (text and/or <Aud><Vid>, signal tokens)."""
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((n, T), np.int32) for k in ("input_ids", "target_ids", "loss_mask", "response_mask",
                                                   "attention_mask")}
    out["positions"] = np.tile(np.arange(T, dtype=np.int32), (n, 1))
    # One speaker per dialogue: each utterance's features are the speaker's vector plus a little noise.
    out["aud_feats"] = (rng.normal(size=(n, 1, 12)) + 0.3 * rng.normal(size=(n, 2, 12))).astype(np.float32)
    out["vid_feats"] = (rng.normal(size=(n, 1, 10)) + 0.3 * rng.normal(size=(n, 2, 10))).astype(np.float32)
    out["aud_mask"] = np.ones((n, 2), np.int32)
    out["vid_mask"] = np.ones((n, 2), np.int32)
    a, v = out["aud_feats"].mean(1), out["vid_feats"].mean(1)
    out["speech_style"] = (a @ PROJ_S.T).astype(np.float32)
    out["video_style"] = (v @ PROJ_V.T).astype(np.float32)
    out["style_mask"] = np.ones((n, 2), np.int32)
    s_s, s_v = out["speech_style"], out["video_style"]  # labels: argmaxes of parts of the style codes
    out["emotion"] = np.argmax(np.concatenate([s_s[:, :4], s_v[:, :3]], 1), 1).astype(np.int32)
    out["age"] = np.argmax(s_s[:, 4:8], 1).astype(np.int32)
    out["gender"] = (s_v[:, 3] > 0).astype(np.int32)
    out["timbre"] = np.argmax(s_v[:, 4:7], 1).astype(np.int32)
    out["record_index"] = np.arange(n, dtype=np.int32)
    for k in ("speech_content", "video_content"):
        out[k] = np.zeros((n, 6, 8), np.float32)
        out[f"{k}_mask"] = np.zeros((n, 6), np.int32)
    text = stage != "sac"
    media = stage in ("sac", "overall")
    for b in range(n):
        words = rng.choice(WORDS, 3)
        seq = [BOS]
        for i in range(2):
            seq += ([int(words[i])] if text else []) + ([AUD, VID] if media else [])
        seq += ([int(words[2])] if text else []) + [SEP]
        start = len(seq)
        if text:
            reply = [REPLY[int(w)] for w in words]
            seq += reply
            out["response_mask"][b, start:start + 3] = 1
            out["speech_content"][b, :3], out["video_content"][b, :3] = TOK_S[reply], TOK_V[reply]
            out["speech_content_mask"][b, :3] = out["video_content_mask"][b, :3] = 1
        if media:
            seq += SIGNALS
        seq.append(EOS)
        n_tok = len(seq)
        out["input_ids"][b, :n_tok] = seq
        out["input_ids"][b, n_tok:] = PAD
        out["attention_mask"][b, :n_tok] = 1
        out["target_ids"][b, : n_tok - 1] = seq[1:]
        out["loss_mask"][b, start - 1 : n_tok - 1] = 1
    return out


def pretrained_like(model: Empatheia) -> Empatheia:
    """A random backbone with a pretrained model's scales: O(1) embeddings, 1/sqrt(d) kernels and a logit
    scale that lets LoRA move the output (the 0.02 init gives logits of ~0.1 whatever the adapter does)."""
    llm = model.llm
    for path, var in nnx.to_flat_state(nnx.state(llm, nnx.Param)):
        if path[0] == "layers" and path[-1] == "kernel":
            var[...] = var[...] * 4.0
    llm.embed_tokens.embedding[...] = llm.embed_tokens.embedding[...] * 50.0
    llm.lm_head.kernel[...] = llm.lm_head.kernel[...] * 10.0
    init_added_rows(llm)
    set_lora_b(llm, jax.random.key(11), std=0.02)  # B != 0, so A gets a gradient in the first step
    return model


def build(stage: Stage, seed: int = 0) -> Empatheia:
    cfg = CFG.replace(pipeline_baseline=True) if stage.pipeline_baseline else CFG
    return pretrained_like(Empatheia(cfg, rngs=nnx.Rngs(seed)))


@functools.cache
def compiled_step(name: str):
    """The trainer's jitted step (`step.make_step`) on one micro-batch: (graphs, params, frozen, opt_state,
    batch, key) -> (params, opt_state, metrics)."""
    step = jax.jit(step_lib.make_step(stages.get_stage(name), losses.LossWeights()), static_argnums=0,
                   compiler_options=FAST)
    return lambda graphs, params, frozen, opt_state, batch, key: step(
        graphs, params, frozen, opt_state, {k: v[None] for k, v in batch.items()}, key)


def to_jax(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in batch.items()}


def run(model: Empatheia, stage: Stage, steps: int, *, seed0: int = 1000) -> list[dict[str, float]]:
    """`steps` updates on fresh batches; returns the metrics of each step and updates the model in place."""
    optimizer = stages.make_optimizer(model, stage, TX)
    graphs, params, frozen, opt_state = stages.split_for_step(model, optimizer, stage)
    step = compiled_step(stage.name)
    template = "coe" if stage.pipeline_baseline else stage.template_stage
    history = []
    for i in range(steps):
        batch = to_jax(stage_batch(template, seed0 + i))
        params, opt_state, metrics = step(graphs, params, frozen, opt_state, batch, jax.random.key(i))
        history.append(metrics)
    stages.merge_after_step(model, optimizer, params, opt_state)
    return [{k: float(v) for k, v in m.items()} for m in history]


# ----------------------------------------------------------------------------------------------------------
# Freezing
# ----------------------------------------------------------------------------------------------------------


def _leaves(model: Empatheia) -> dict[tuple[str, ...], np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {tuple(str(p) for p in path): np.array(v[...]) for path, v in flat}


def _component(path: tuple[str, ...]) -> tuple[str, ...]:
    """The unit that must visibly train: a VAE block, a head or projection, a LoRA adapter, an added table."""
    if path[0] == "llm":
        return path[:-2] if "lora" in path else path[:2]
    return path[:2] if path[0] in ("content_sync", "style_dis") else path[:1]


@pytest.mark.parametrize("name", ["coe", "ccl", "sac", "overall", "pipeline"])
def test_one_update_changes_only_the_stage_groups(name):
    stage = stages.get_stage(name)
    model = build(stage)
    before = _leaves(model)
    trained = stages.trainable_paths(model, stage.trainable_groups)
    optimizer = stages.make_optimizer(model, stage, TX)
    mu = nnx.to_flat_state(nnx.state(optimizer.opt_state)[0]["mu"])
    assert {tuple(str(p) for p in path) for path, _ in mu} == trained  # optimizer state: trainable only
    graphs, params, frozen, opt_state = stages.split_for_step(model, optimizer, stage)
    template = "coe" if stage.pipeline_baseline else stage.template_stage
    params, opt_state, metrics = compiled_step(name)(graphs, params, frozen, opt_state,
                                                     to_jax(stage_batch(template, 0)), jax.random.key(0))
    stages.merge_after_step(model, optimizer, params, opt_state)
    after = _leaves(model)
    assert np.isfinite(metrics["total"])

    for path in before.keys() - trained:
        np.testing.assert_array_equal(after[path], before[path], err_msg=f"frozen {path} changed")
    changed = {p for p in trained if not np.array_equal(after[p], before[p])}
    assert len(changed) >= 0.9 * len(trained), sorted(trained - changed)
    components = {_component(p) for p in trained}
    assert {_component(p) for p in changed} == components
    groups = {"lora": ("lora",), "added_rows": ("embed_extra", "lm_head_extra"),
              "proj": ("aud_proj", "vid_proj"), "cs": ("content_sync",), "sd": ("style_dis",)}
    allowed = [n for g in stage.trainable_groups for n in groups[g]]
    assert all(any(n in p for n in allowed) for p in trained), sorted(trained)  # filters not too broad
    for group, names in groups.items():  # every group of the stage trained, no other group did
        touched = any(any(n in p for n in names) for p in changed)
        assert touched == (group in stage.trainable_groups), (group, touched)
    assert ("llm", "embed_tokens", "embedding") in before and ("llm", "lm_head", "kernel") in before


# ----------------------------------------------------------------------------------------------------------
# Learning
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,steps", [("coe", 100), ("ccl", 60), ("sac", 300), ("overall", 60)])
def test_each_stage_halves_its_loss(name, steps):
    stage = STAGES[name]
    model = build(stage)
    history = run(model, stage, steps)
    first = history[0]["total"]
    last = float(np.mean([h["total"] for h in history[-10:]]))
    assert last < 0.5 * first, (first, last, [round(h["total"], 3) for h in history[::10]])
    if name != "sac":
        return
    # The style classifiers generalise: held-out accuracy (z = mu) above the majority-class rate.
    held = to_jax(stage_batch("sac", 99, 256))
    out = jax.jit(lambda m, b: m(b, heads={"sd"}), compiler_options=FAST)(model, held)
    margins = {}
    for attr in ("emotion", "age", "gender", "timbre"):
        labels = np.asarray(held[attr])
        acc = float(np.mean(np.argmax(np.asarray(out[f"{attr}_logits"]), -1) == labels))
        margins[attr] = acc - np.bincount(labels).max() / len(labels)
    assert np.mean(list(margins.values())) > 0.08, margins
    assert sum(m > 0.03 for m in margins.values()) >= 3, margins


# ----------------------------------------------------------------------------------------------------------
# Gradient accumulation: 4 micro-batches of 1 == 1 batch of 4
# ----------------------------------------------------------------------------------------------------------


def accumulation_batch(stage: str) -> dict[str, np.ndarray]:
    """4 examples of `stage`'s template: 0 complete; 1 a filler row (nothing valid at all); 2 without content
    rows, emotion/age labels, speech style and <VIDi> tokens; 3 without a timbre label."""
    b = stage_batch(stage, 7, n=4)
    for k in ("input_ids", "target_ids", "loss_mask", "response_mask", "attention_mask", "aud_mask",
              "vid_mask", "speech_content_mask", "video_content_mask", "style_mask"):
        b[k][1] = PAD if k in ("input_ids", "target_ids") else 0
    for k in ("emotion", "age", "gender", "timbre", "record_index"):
        b[k][1] = -1
    b["speech_content_mask"][2] = b["video_content_mask"][2] = 0
    b["emotion"][2] = b["age"][2] = -1
    b["style_mask"][2, 0] = 0
    for k in ("input_ids", "target_ids"):
        b[k][2] = np.where(np.isin(b[k][2], CFG.vid_signal_ids), 5, b[k][2])
    b["timbre"][3] = -1
    return b


def _stage_totals(params, graphdef, frozen, batch, keys, counts):
    """The totals of every stage (STAGE_ORDER) on one forward pass with all heads, and their metrics."""
    model = nnx.merge(graphdef, params, frozen)
    out = model(batch, train=True, rng=keys)
    res = [objective.stage_loss(model, batch, out, STAGES[n], counts=counts) for n in STAGE_ORDER]
    return jnp.stack([t for t, _ in res]), {n: m for n, (_, m) in zip(STAGE_ORDER, res, strict=True)}


def _totals_and_grads(params, graphdef, frozen, batch, keys, counts):
    """Each stage's total, metrics and gradient (leading axis: the stage) from one batched backward pass."""
    totals, vjp, metrics = jax.vjp(lambda p: _stage_totals(p, graphdef, frozen, batch, keys, counts), params,
                                   has_aux=True)
    (grads,) = jax.vmap(vjp)(jnp.eye(len(STAGE_ORDER), dtype=jnp.float32))
    return totals, metrics, grads


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST)
def accumulate(graphdef, params, frozen, batch, keys):
    """One program for all four stages: values/metrics/grads of the whole batch (counts=None) and of a
    lax.scan over its micro-batches of 1 with the whole batch's counts, as a trainer runs it. The scan also
    runs `objective.make_loss_fn` (overall) with counts=, to check its plumbing."""
    model = nnx.merge(graphdef, params, frozen)
    full, m_full, g_full = _totals_and_grads(params, graphdef, frozen, batch, keys, None)
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0], 1, *x.shape[1:]), batch)
    counts = objective.loss_counts(model.config, batch)
    loss_fn = objective.make_loss_fn(STAGES["overall"])

    def body(_, xs):
        mb, k = xs
        totals, metrics, grads = _totals_and_grads(params, graphdef, frozen, mb, k, counts)
        via_loss_fn, _ = loss_fn(params, graphdef, frozen, mb, k, counts=counts)
        return None, (totals, metrics, grads, via_loss_fn)

    _, (totals, m_micro, g_micro, via_loss_fn) = jax.lax.scan(body, None, (micro, keys.reshape(-1, 1)))
    return {"full": full, "m_full": m_full, "g_full": g_full, "totals": totals, "m_micro": m_micro,
            "g_micro": g_micro, "via_loss_fn": via_loss_fn, "counts": counts,
            "micro_counts": jax.vmap(functools.partial(objective.loss_counts, model.config))(micro),
            "stacked_counts": objective.loss_counts(model.config, micro)}


@pytest.mark.parametrize("template", ["coe", "ccl", "sac", "overall"])
def test_micro_batches_with_global_counts_and_per_example_keys_give_the_full_batch_update(template):
    """On each stage's batch, for every stage formula: Σ over 4 micro-batches of 1 of loss(counts=whole
    batch's counts) and of its gradient == the whole batch's loss and gradient (VAE sampling on)."""
    model = build(STAGES["overall"])
    graphdef, params, frozen = nnx.split(model, trainable_filter(STAGES["overall"].trainable_groups), ...)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(3), i))(jnp.arange(4))
    r = accumulate(graphdef, params, frozen, to_jax(accumulation_batch(template)), keys)
    r = jax.tree.map(np.asarray, r)

    # Counts from the batch alone: additive over micro-batches and over [A, m] leading axes.
    assert set(r["counts"]) == set(objective.COUNT_KEYS)
    for k, v in r["counts"].items():
        assert int(v) == int(r["micro_counts"][k].sum()) == int(r["stacked_counts"][k]), k
    assert r["counts"]["emp_tokens"] > 0
    np.testing.assert_allclose(r["via_loss_fn"], r["totals"][:, STAGE_ORDER.index("overall")], rtol=1e-6)
    assert np.isfinite(r["totals"]).all()
    assert not r["totals"][1].any()  # the filler row adds nothing to any stage
    for s, name in enumerate(STAGE_ORDER):
        np.testing.assert_allclose(r["totals"][:, s].sum(), r["full"][s], rtol=1e-5, err_msg=name)
        for k, v in r["m_full"][name].items():  # every metric adds up: terms, kl_*, acc_*, counts, total
            np.testing.assert_allclose(r["m_micro"][name][k].sum(0), v, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}: {k}")
    if template in ("sac", "overall"):
        assert r["m_full"]["sac"]["sal_video"] > 0 and r["m_micro"]["sac"]["sal_video"][2] == 0.0
    flat_full = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(r["g_full"])}
    flat_micro = {p: np.asarray(v[...]).sum(0) for p, v in nnx.to_flat_state(r["g_micro"])}
    assert flat_full.keys() == flat_micro.keys()
    for s, name in enumerate(STAGE_ORDER):
        top = max(np.abs(g[s]).max() for g in flat_full.values())
        if top == 0:  # a stage with nothing to learn on this template (sac on text, ccl on media only)
            assert name != template and not any(g[s].any() for g in flat_micro.values()), name
            continue
        worst = {}
        for path, g in flat_full.items():
            # Relative to the leaf's own scale; leaves whose exact gradient is 0 (attention key biases, which
            # softmax ignores) hold only rounding noise, hence the floor relative to the largest leaf.
            scale = max(np.abs(g[s]).max(), 1e-3 * top)
            worst[path] = np.abs(flat_micro[path][s] - g[s]).max() / scale
        path = max(worst, key=worst.get)
        assert worst[path] <= 1e-5, (name, path, worst[path])
