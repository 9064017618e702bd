"""`empatheia_jax.eval.evaluate`: every metric against an independent computation on the same model outputs.

A tiny random Empatheia (2 layers, d=32) around the real SmolLM2 tokenizer, on the lite-encoder tiny shards
with stand-in targets (`helpers.make_tiny_shards`: test split = 3 records). Teacher-forced metrics are
recomputed in numpy from one batch holding the whole split (evaluate runs batches of 2, so its second batch
has a filler row that must not count); generations are re-run one prompt at a time (evaluate batches and
left-pads them); baselines are recomputed from the shard records by hand.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FAST, TINY_ROWS, load_smollm2_tokenizer, make_tiny_shards, tiny_empatheia

from empatheia_jax.data import input_pipeline as ip
from empatheia_jax.data import parse, schema
from empatheia_jax.data import templates as tpl
from empatheia_jax.data.examples import build_example
from empatheia_jax.data.pipeline_config import PipelineConfig
from empatheia_jax.data.shard_reader import ShardReader
from empatheia_jax.eval import baselines as eval_baselines
from empatheia_jax.eval import evaluate as ev
from empatheia_jax.eval import generation_pass as gp
from empatheia_jax.eval import report as eval_report
from empatheia_jax.eval.metrics import text as mtext
from empatheia_jax.serve import reply_choice
from empatheia_jax.serve.decoding import Decoding, ReplySampling
from empatheia_jax.serve.generation import eos_token_ids, generate_tokens, left_pad
from empatheia_jax.serve.reply_choice import consensus_index, reply_header_tokens
from empatheia_jax.train import objective, stages

ED = list(schema.ED_EMOTIONS_32)

MAX_LEN, ROWS = 256, TINY_ROWS
PIPE = dict(n_signal=4, max_speech_len=ROWS, max_video_len=ROWS)
pytestmark = pytest.mark.usefixtures("exact_matmuls")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_tiny_shards(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_smollm2_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def model(tok, shards):
    return tiny_empatheia(tok, shards)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST)
def _forward_and_loss(graphdef, state, batch):
    m = nnx.merge(graphdef, state)
    out = m(batch, train=False)
    total, metrics = objective.stage_loss(m, batch, out, stages.STAGES["overall"])
    keep = ("speech_content", "video_content", "speech_style", "video_style", "emotion_logits", "age_logits",
            "gender_logits", "timbre_logits")
    return {k: out[k] for k in keep}, total, metrics


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST)
def _logits(graphdef, state, batch):
    return nnx.merge(graphdef, state)(batch, train=False)["logits"]


def _whole_split_batch(tok, shards) -> dict[str, np.ndarray]:
    pipe = ip.make_dataset(shards, "test", "overall", tok, batch_size=4, max_len=MAX_LEN, shuffle=False,
                           num_epochs=1, window_batches=1, process_index=0, process_count=1, **PIPE)
    (batch,) = list(pipe)
    np.testing.assert_array_equal(batch["record_index"], [0, 1, 2, -1])  # 3 records + 1 filler row
    return batch


def test_teacher_forced_metrics_equal_numpy_on_the_same_outputs(model, tok, shards):
    got = ev.evaluate(model, tok, shards, "test", batch_size=2, max_len=MAX_LEN, generate_text=False,
                      progress=False, compiler_options=FAST)
    batch = _whole_split_batch(tok, shards)
    graphdef, state = nnx.split(model)
    out, total, metrics = jax.device_get(
        _forward_and_loss(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()}))
    real = batch["record_index"] >= 0
    assert got["num_examples"] == 3 and got["skipped_examples"] == 0

    def dists(pred, target, mask):
        p, t = np.asarray(pred, np.float64)[mask], np.asarray(target, np.float64)[mask]
        l2 = np.sqrt(((p - t) ** 2).sum(-1))
        cos = (p * t).sum(-1) / (np.linalg.norm(p, axis=-1) * np.linalg.norm(t, axis=-1))
        return l2.mean(), cos.mean()

    for key in ("speech_content", "video_content"):
        mask = batch[f"{key}_mask"].astype(bool) & real[:, None]
        assert mask.sum() > 3  # several rows per example
        l2, cos = dists(out[key], batch[key], mask)
        assert got[f"{key}_l2"] == pytest.approx(l2, rel=1e-5)
        assert got[f"{key}_cos"] == pytest.approx(cos, rel=1e-4, abs=1e-6)
    for j, key in enumerate(("speech_style", "video_style")):
        l2, cos = dists(out[key], batch[key], batch["style_mask"][:, j].astype(bool) & real)
        assert got[f"{key}_l2"] == pytest.approx(l2, rel=1e-5)
        assert got[f"{key}_cos"] == pytest.approx(cos, rel=1e-4, abs=1e-6)
    names = {"emotion": "emotion_acc_cls", "age": "age_acc", "gender": "gender_acc", "timbre": "timbre_acc"}
    for label, name in names.items():
        pred = np.argmax(out[f"{label}_logits"], -1)[real]
        assert got[name] == pytest.approx(np.mean(pred == batch[label][real]))  # denominator 3, not 4
    # Loss terms over two batches (one with a filler row) = the terms of one batch holding the whole split.
    for term in ("emp", "signal_ce", "ccl_speech", "ccl_video", "sal_speech", "sal_video", "cls_emotion",
                 "cls_age", "cls_gender", "cls_timbre", "kl"):
        assert got[term] == pytest.approx(float(metrics[term]), rel=1e-4), term
    assert got["eval_loss"] == pytest.approx(float(total), rel=1e-4)
    assert got["ppl"] == pytest.approx(np.exp(float(metrics["emp"])), rel=1e-4)
    # reply_ppl: the same logits, only the gold reply's target tokens (log-softmax in numpy)
    logits = _logits(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()})
    logits = np.asarray(jax.device_get(logits), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    reply = batch["loss_mask"].astype(bool) & batch["response_mask"].astype(bool) & real[:, None]
    assert 0 < reply.sum() < (batch["loss_mask"].astype(bool) & real[:, None]).sum()  # CoE steps excluded
    nll = -np.take_along_axis(logp, batch["target_ids"][..., None].astype(int), -1)[..., 0][reply]
    assert got["reply_ppl"] == pytest.approx(np.exp(nll.mean()), rel=1e-4)

    with pytest.raises(ValueError, match="contradicts the model"):
        ev.evaluate(model, tok, shards, "test", generate_text=False, pipeline_overrides={"n_signal": 16})


def test_generations_are_scored_from_their_parse_and_equal_unbatched_decoding(model, tok, shards, tmp_path):
    path = tmp_path / "preds.jsonl"
    got = ev.evaluate(model, tok, shards, "test", batch_size=2, max_len=MAX_LEN,
                      decoding=Decoding(max_new_tokens=6), predictions_path=path, progress=False,
                      compiler_options=FAST)
    preds = [json.loads(line) for line in path.read_text().splitlines()]
    assert [p["record_index"] for p in preds] == [0, 1, 2]
    assert all(p["num_new"] == 6 for p in preds)  # a random model never ends on its own
    replies = [p["reply"] for p in preds]
    assert got["dist1_corpus"] == pytest.approx(mtext.distinct_n(replies, 1))
    assert got["dist2_reply"] == pytest.approx(mtext.distinct_n_per_reply(replies, 2))
    gold = [p["labels"]["emotion"] for p in preds]
    assert gold == [1, 5, 5]  # surprised, disgusted (shards' labels, in record order)
    hits = [p["emotion"] == g for p, g in zip(preds, gold, strict=True)]
    assert got["emotion_acc_text"] == pytest.approx(np.mean(hits))
    assert got["num_generated"] == 3 and got["signal_rate"] == 0.0

    # The generation's own batch size (all three prompts in one left-padded batch) changes nothing.
    path3 = tmp_path / "preds3.jsonl"
    got3 = ev.evaluate(model, tok, shards, "test", batch_size=2, generate_batch_size=3, max_len=MAX_LEN,
                       decoding=Decoding(max_new_tokens=6), predictions_path=path3, progress=False,
                       compiler_options=FAST)
    assert [json.loads(line)["text"] for line in path3.read_text().splitlines()] == [p["text"] for p in preds]
    assert got3 == got
    with pytest.raises(ValueError, match="batch_size must be >= 1, got -3"):
        ev.evaluate(model, tok, shards, "test", batch_size=2, generate_batch_size=-3, max_len=MAX_LEN,
                    decoding=Decoding(max_new_tokens=6), progress=False, compiler_options=FAST)

    # Evaluate sorts prompts by length, batches and left-pads them; one prompt alone must decode the same.
    reader = ShardReader.for_split(shards, "test")
    cfg = PipelineConfig(stage="overall", max_len=MAX_LEN, include_target=False, **PIPE)
    eos = eos_token_ids(model.llm, tok)
    embed = jax.jit(lambda m, *a: m.embed_inputs(*a), compiler_options=FAST)
    for i in (0, 2):
        ex = build_example(reader[i], "overall", tok, cfg)
        ids, _ = left_pad([ex["input_ids"].tolist()], tok.pad_token_id)
        n_aud, n_vid = len(ex["aud_feats"]), len(ex["vid_feats"])
        x = embed(model, jnp.asarray(ids), jnp.asarray(ex["aud_feats"][None]), jnp.ones((1, n_aud), bool),
                  jnp.asarray(ex["vid_feats"][None]), jnp.ones((1, n_vid), bool))
        gen = generate_tokens(model.llm, [ex["input_ids"].tolist()], 6, eos_ids=eos,
                              pad_token_id=tok.pad_token_id, inputs_embeds=x)
        text = tok.decode(gen.new_tokens[0, : gen.num_new[0]].tolist(), skip_special_tokens=False)
        assert text == preds[i]["text"]
        assert preds[i]["prompt_tokens"] == len(ex["input_ids"])


def _prompt_examples(tok, shards) -> list[dict]:
    """The test split's prompts (the overall template without the target), as generation reads them."""
    reader = ShardReader.for_split(shards, "test")
    cfg = PipelineConfig(stage="overall", max_len=MAX_LEN, include_target=False, **PIPE)
    return [build_example(reader[i], "overall", tok, cfg) for i in range(3)]


def _rigged_generation(examples, texts, tok):
    """A stand-in for `generate_tokens` writing each example's rigged text after its prompt, then stopping."""
    from empatheia_jax.serve import generation

    rigged = {tuple(ex["input_ids"].tolist()): tok(t, add_special_tokens=False)["input_ids"]
              for ex, t in zip(examples, texts, strict=True)}

    def fake_generate(llm, prompts, max_new_tokens, **kw):
        news = [rigged[tuple(p)] for p in prompts]
        ids, mask = left_pad(prompts, kw["pad_token_id"])
        width = max(len(n) for n in news)
        new = np.array([n + [kw["pad_token_id"]] * (width - len(n)) for n in news], np.int32)
        return generation.Generation(np.concatenate([ids, new], 1), np.concatenate([mask, new > -1], 1),
                                     ids.shape[1], np.array([len(n) for n in news]))

    return fake_generate


def _rigged_coe_texts():
    """A full CoE, one that skipped step 2, a bare reply."""
    return [tpl.format_coe({"event_scenario": "my dog ran away", "speaker_emotion": "joyful"}, "oh no"),
            "Firstly, the event scenario of this conversation is: I won\n\nFinally, the response is: yay",
            "just some words"]


def test_scored_emotion_is_the_most_likely_ed_label_after_the_generated_step_1(model, tok, shards,
                                                                              monkeypatch):
    """`score_emotions`: CoE step 2 is chosen among the 32 ED labels by likelihood after the model's OWN
    generated step 1 (here rigged generations: a full CoE, one that skipped step 2, and a bare reply). The
    choice must equal the argmax of an independent full forward (no cache, no padding, media spliced) of
    prompt + generated text through the header + " label" + the step separator."""
    texts = _rigged_coe_texts()
    examples = _prompt_examples(tok, shards)
    monkeypatch.setattr(gp, "generate_tokens", _rigged_generation(examples, texts, tok))
    preds = gp.generate_predictions(model, tok, shards, "test", batch_size=2, max_len=MAX_LEN,
                                    progress=False, compiler_options=FAST, score_emotions=True)
    assert [p["text"] for p in preds] == texts

    emap = schema.EmotionMap.load("avamerg7")
    heads = [texts[0].split(" joyful")[0], texts[1].split("\n\nFinally")[0] + "\n\n" + "Secondly, the "
             "emotion of the speaker is:"]
    forward = jax.jit(lambda m, ids, *feats: m.llm.logits(m.llm.decode(m.embed_inputs(ids, *feats))[0]),
                      compiler_options=FAST)
    for ex, head, pred in zip(examples[:2], heads, preds[:2], strict=True):
        prefix = ex["input_ids"].tolist() + tok(head, add_special_tokens=False)["input_ids"]
        n_aud, n_vid = len(ex["aud_feats"]), len(ex["vid_feats"])
        scores = []
        for word in ED:
            label = tok(f" {word}\n\n", add_special_tokens=False)["input_ids"]
            ids = jnp.asarray([prefix + label])
            logits = forward(model, ids, jnp.asarray(ex["aud_feats"][None]), jnp.ones((1, n_aud), bool),
                             jnp.asarray(ex["vid_feats"][None]), jnp.ones((1, n_vid), bool))
            logp = np.asarray(jax.nn.log_softmax(logits[0], -1))
            scores.append(sum(logp[len(prefix) - 1 + i, t] for i, t in enumerate(label)))
        np.testing.assert_allclose(pred["emotion_label_logprobs"], scores, atol=2e-4, rtol=0)
        best = int(np.argmax(scores))
        assert np.sort(scores)[-1] - np.sort(scores)[-2] > 1e-4  # a clear winner, not a float tie
        assert pred["emotion_fine_scored"] == best and pred["emotion_word_scored"] == ED[best]
        assert pred["emotion_scored"] == (-1 if (c := emap.project(ED[best])) is None else c)
    assert preds[2]["emotion_fine_scored"] == -1 and preds[2]["emotion_word_scored"] == ""  # no CoE: unscored
    assert "emotion_label_logprobs" not in preds[2]
    m = mtext.text_metrics(preds)
    assert m["emotion_scored_rate"] == pytest.approx(2 / 3)
    gold_fine = [p["labels"]["emotion_fine"] for p in preds]
    assert m["emotion32_acc_scored"] == pytest.approx(np.mean(
        [p["emotion_fine_scored"] == g for p, g in zip(preds, gold_fine, strict=True) if g >= 0]))
    with pytest.raises(stages.TemplateError, match="score_emotions needs a Chain-of-Empathy target"):
        gp.generate_predictions(model, tok, shards, "test", template="sac", score_emotions=True,
                                progress=False, compiler_options=FAST)


def test_emotion_head_reads_the_spliced_prompts_and_votes_with_step_2(model, tok, shards, monkeypatch):
    """`dialogue_summaries` = an independent unpadded forward of each prompt with its media spliced; with a
    head, each prediction carries the head's log-probabilities of those features, its label, and the
    combination of head, scored and free step 2 as `emotion_head.combine` computes it by hand."""
    from empatheia_jax.eval import emotion_head as eh

    texts = _rigged_coe_texts()
    examples = _prompt_examples(tok, shards)
    read = gp.dialogue_summaries(model, tok, shards, "test", batch_size=2, max_len=MAX_LEN, progress=False,
                                 compiler_options=FAST)
    assert read["record_index"].tolist() == [0, 1, 2]
    reader = ShardReader.for_split(shards, "test")
    gold = [(reader[i].get("labels") or {}).get("emotion_fine") for i in range(3)]
    assert read["emotion_fine"].tolist() == [-1 if g is None else int(g) for g in gold]
    d = model.llm.config.hidden_size
    hidden = jax.jit(lambda m, ids, *feats: m.llm.decode(m.embed_inputs(ids, *feats))[0],
                     compiler_options=FAST)
    for i, ex in enumerate(examples):
        n_aud, n_vid = len(ex["aud_feats"]), len(ex["vid_feats"])
        h = np.asarray(hidden(model, jnp.asarray(ex["input_ids"][None]), jnp.asarray(ex["aud_feats"][None]),
                              jnp.ones((1, n_aud), bool), jnp.asarray(ex["vid_feats"][None]),
                              jnp.ones((1, n_vid), bool)))[0]
        np.testing.assert_allclose(read["features"][i, :d], h[-1], atol=2e-4, rtol=0)
        np.testing.assert_allclose(read["features"][i, d:], h.mean(0), atol=2e-4, rtol=0)

    rng = np.random.default_rng(0)
    x = np.concatenate([read["features"]] * 4) + rng.normal(scale=0.05, size=(12, 2 * d))
    head = eh.fit_probe(x, [3, 8, 20] * 4, c=0.1).with_weights(0.7, 1.5)
    monkeypatch.setattr(gp, "generate_tokens", _rigged_generation(examples, texts, tok))
    preds = gp.generate_predictions(model, tok, shards, "test", batch_size=2, max_len=MAX_LEN, progress=False,
                                    compiler_options=FAST, score_emotions=True, emotion_head=head)
    emap = schema.EmotionMap.load("avamerg7")
    for p, f in zip(preds, read["features"], strict=True):
        want = head.log_probs(f[None])[0]
        np.testing.assert_allclose(p["emotion_head_logprobs"], want, atol=2e-3, rtol=0)
        assert p["emotion_fine_head"] == int(np.argmax(want))
        assert p["emotion_head"] == (-1 if (c := emap.project(ED[p["emotion_fine_head"]])) is None else c)
        total = 0.7 * np.asarray(p["emotion_head_logprobs"])
        if "emotion_label_logprobs" in p:
            total += _log_softmax(p["emotion_label_logprobs"])
        if p["emotion_fine"] >= 0:
            total[p["emotion_fine"]] += 1.5
        assert p["emotion_fine_combined"] == int(np.argmax(total))
    assert [p["emotion_fine_head"] for p in preds] == [3, 8, 20]  # the head learnt its rigged labels
    assert "emotion_label_logprobs" not in preds[2]  # the bare reply votes with the head alone
    m = mtext.text_metrics(preds)
    gold = [p["labels"]["emotion_fine"] for p in preds]
    for kind in ("head", "combined"):
        assert m[f"emotion32_acc_{kind}"] == pytest.approx(np.mean(
            [p[f"emotion_fine_{kind}"] == g for p, g in zip(preds, gold, strict=True) if g >= 0]))
    unweighted = eh.fit_probe(x, [3, 8, 20] * 4, c=0.1)  # weights not chosen: the head's rows, no combination
    preds = gp.generate_predictions(model, tok, shards, "test", batch_size=2, max_len=MAX_LEN, progress=False,
                                    compiler_options=FAST, score_emotions=True, emotion_head=unweighted)
    assert all("emotion_fine_head" in p and "emotion_fine_combined" not in p for p in preds)
    other = eh.fit_probe(rng.normal(size=(12, 6)), [3, 8, 20] * 4, c=0.1)
    with pytest.raises(eh.EmotionHeadError, match="fitted to another backbone"):
        gp.generate_predictions(model, tok, shards, "test", progress=False, compiler_options=FAST,
                                emotion_head=other)


def test_reply_sampling_draws_the_reply_after_the_greedy_coe(model, tok, shards, monkeypatch):
    """`ReplySampling`: the greedy CoE (rigged here) is kept through the step-5 header, found in token space,
    and only the reply is drawn after it: with a nucleus of one token the drawn reply is the greedy
    continuation of prompt + header, each row decoded alone with its media spliced; the CoE fields equal the
    greedy run's; a text without the header keeps its greedy reply; a seed repeats, another seed differs."""
    from empatheia_jax.serve import generation
    from empatheia_jax.serve.forward import embed_prompts

    texts = _rigged_coe_texts()
    examples = _prompt_examples(tok, shards)
    rigged = _rigged_generation(examples, texts, tok)
    real = generation.generate_tokens

    def phase(llm, prompts, max_new_tokens, temperature=0.0, top_p=1.0, **kw):  # greedy: the rigged CoE
        if temperature == 0:
            return rigged(llm, prompts, max_new_tokens, **kw)
        return real(llm, prompts, max_new_tokens, temperature, top_p, **kw)

    monkeypatch.setattr(gp, "generate_tokens", phase)
    monkeypatch.setattr(reply_choice, "generate_tokens", phase)
    kw = dict(batch_size=2, max_len=MAX_LEN, progress=False, compiler_options=FAST)
    greedy = gp.generate_predictions(model, tok, shards, "test", **kw, decoding=Decoding(max_new_tokens=80))
    narrow = gp.generate_predictions(model, tok, shards, "test", **kw, decoding=Decoding(
        max_new_tokens=80, reply_sampling=ReplySampling(temperature=1.0, top_p=1e-6)))
    eos = eos_token_ids(model.llm, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    for ex, text, g, p in zip(examples, texts, greedy, narrow, strict=True):
        assert p["text_greedy"] == g["text"] == text
        new = tok(text, add_special_tokens=False)["input_ids"]
        k = reply_header_tokens(tok, new)
        if "the response is" not in text:
            assert k is None and p["text"] == text  # no header: the greedy reply stays
            continue
        assert tok.decode(new[:k]).rstrip().endswith("the response is:")
        assert not tok.decode(new[: k - 1]).rstrip().endswith("the response is:")  # the fewest tokens
        prefix = ex["input_ids"].tolist() + new[:k]
        ids, _ = left_pad([prefix], pad)
        af, vf = ex["aud_feats"][None], ex["vid_feats"][None]
        embeds = embed_prompts(model, ids, af, np.ones(af.shape[:2], np.int32), vf,
                               np.ones(vf.shape[:2], np.int32))
        alone = real(model.llm, [prefix], 80 - k, eos_ids=eos, pad_token_id=pad, inputs_embeds=embeds)
        want = new[:k] + alone.new_tokens[0, : alone.num_new[0]].tolist()
        assert p["text"] == tok.decode(want, skip_special_tokens=False)
        for field in ("emotion_word", "emotion", "emotion_fine"):
            assert p[field] == g[field], field
        assert {k: v for k, v in p["coe"].items() if k != "response"} == \
            {k: v for k, v in g["coe"].items() if k != "response"}  # every step but the reply: greedy
    drawn = [gp.generate_predictions(model, tok, shards, "test", **kw, decoding=Decoding(
                 max_new_tokens=80, reply_sampling=ReplySampling(temperature=1.5, top_p=1.0, seed=s)))
             for s in (0, 0, 1)]
    assert [p["text"] for p in drawn[0]] == [p["text"] for p in drawn[1]]
    assert [p["text"] for p in drawn[0]] != [p["text"] for p in drawn[2]]
    with pytest.raises(ValueError, match="temperature=0"):
        ReplySampling(temperature=0.0)


def test_reply_candidates_keep_the_consensus_of_the_drawn_replies(model, tok, shards, monkeypatch):
    """`ReplySampling(candidates=3)`: one sampled call asks for 3 continuations per prefix (prompt + the
    greedy CoE through the step-5 header) and the kept reply is the candidate that agrees most with the
    others. The draws are rigged to three hand-made replies whose consensus is the last one, so keeping the
    first draw (or the greedy reply) fails."""
    from empatheia_jax.serve import generation

    texts = _rigged_coe_texts()
    examples = _prompt_examples(tok, shards)
    rigged = _rigged_generation(examples, texts, tok)
    drafts = ["Oh no.", "So sorry, what did the vet say?", "Oh no, I am so sorry, what did the vet say then?"]
    draws = [tok(d + tok.eos_token, add_special_tokens=False)["input_ids"] for d in drafts]
    calls = []

    def phase(llm, prompts, max_new_tokens, temperature=0.0, top_p=1.0, **kw):
        if temperature == 0:
            return rigged(llm, prompts, max_new_tokens, **kw)
        calls.append((len(prompts), kw["num_samples"]))
        rows = [d for _ in prompts for d in draws]
        ids, mask = left_pad(prompts, kw["pad_token_id"])
        ids, mask = np.repeat(ids, 3, axis=0), np.repeat(mask, 3, axis=0)
        width = max(len(r) for r in rows)
        new = np.array([r + [kw["pad_token_id"]] * (width - len(r)) for r in rows], np.int32)
        return generation.Generation(np.concatenate([ids, new], 1), np.concatenate([mask, new > -1], 1),
                                     ids.shape[1], np.array([len(r) for r in rows]))

    monkeypatch.setattr(gp, "generate_tokens", phase)
    monkeypatch.setattr(reply_choice, "generate_tokens", phase)
    kw = dict(batch_size=2, max_len=MAX_LEN, progress=False, compiler_options=FAST)
    preds = gp.generate_predictions(model, tok, shards, "test", **kw, decoding=Decoding(
        max_new_tokens=80, reply_sampling=ReplySampling(temperature=1.0, candidates=3)))
    assert calls and all(c == (2, 3) for c in calls)
    assert consensus_index(drafts) == 2
    for text, p in zip(texts, preds, strict=True):
        if "the response is" not in text:
            assert p["text"] == text and "reply_candidates" not in p
            continue
        assert p["reply"] == drafts[2]
        assert p["reply_candidates"] == drafts  # every draw, in draw order: a reader can choose again
        assert p["text"].startswith(text[: text.index("the response is:")])


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_parse_and_score_of_rigged_generations():
    emap = schema.EmotionMap.load("avamerg7")
    coe = {"event_scenario": "my dog ran away", "speaker_emotion": "Terrified", "emotion_cause": "the dog",
           "goal_to_response": "comfort"}
    texts = [
        tpl.format_coe(coe, "I am so sorry. Is he back?") + "\n<AUD1><AUD2><VID1><VID2><|im_end|>",
        "Secondly, the emotion of the speaker is: feeling very sad\n\nFinally, the response is: oh no, oh no",
        "Secondly, the emotion of the speaker is: tired\n\nFinally, the response is: rest",  # no class
        "just some words",  # no CoE at all: the bare reply
    ]
    parsed = [parse.parse_generation(t, emap) for t in texts]
    assert [p["emotion"] for p in parsed] == [3, 4, -1, -1]  # fear, sad (first word that maps), none, none
    replies = ["I am so sorry. Is he back?", "oh no, oh no", "rest", "just some words"]
    assert [p["reply"] for p in parsed] == replies
    assert parsed[0]["coe"]["event_scenario"] == "my dog ran away"
    assert [p["emotion_fine"] for p in parsed] == [ED.index("terrified"), ED.index("sad"), -1, -1]
    gold = [3, 0, 2, 4]
    gold_fine = [ED.index("afraid"), ED.index("sad"), ED.index("annoyed"), -1]  # same 7-class, other label
    preds = [dict(p, labels={"emotion": g, "emotion_fine": f, "age": -1, "gender": -1, "timbre": -1})
             for p, g, f in zip(parsed, gold, gold_fine, strict=True)]
    m = mtext.text_metrics(preds)
    assert m["emotion_acc_text"] == 0.25  # only the first; unparseable counts as wrong
    assert m["emotion32_acc_text"] == pytest.approx(1 / 3)  # terrified != afraid; sad == sad; tired: none
    assert m["coe_parse_rate"] == 0.75 and m["emotion_parse_rate"] == 0.5
    assert m["emotion32_parse_rate"] == 0.5  # "tired" is an unmapped word in both maps
    # words: [i am so sorry . is he back ?] [oh no , oh no] [rest] [just some words] = 18 tokens, 16 distinct;
    # bigrams: 8 + 4 (oh-no twice) + 0 + 2 = 14, 13 distinct.
    assert m["dist1_corpus"] == pytest.approx(16 / 18) and m["dist2_corpus"] == pytest.approx(13 / 14)
    # per reply: 9/9, 3/5, 1/1, 3/3 unigrams; 8/8, 3/4, (none), 2/2 bigrams
    assert m["dist1_reply"] == pytest.approx((1 + 3 / 5 + 1 + 1) / 4)
    assert m["dist2_reply"] == pytest.approx((1 + 3 / 4 + 1) / 3)
    assert m["repetition_rate"] == 0.0  # "oh no , oh no" repeats a bigram, not a 4-gram
    assert m["reply_words"] == pytest.approx((7 + 4 + 1 + 3) / 4)  # punctuation is not a word
    assert mtext.distinct_n(["a b a", "b c"], 1) == pytest.approx(3 / 5)
    assert mtext.distinct_n(["a b a", "b c"], 2) == pytest.approx(3 / 3)
    assert mtext.distinct_n([""], 2) == 0.0
    # the demo's failure: one sentence said again
    looped = "I am here for you. I am here for you. I am here for you."
    assert mtext.has_repeated_ngram(looped) and not mtext.has_repeated_ngram("I am here for you, always.")
    m = mtext.text_metrics([dict(p, labels={}) for p in parsed] + [dict(parsed[3], reply=looped, labels={})])
    assert m["repetition_rate"] == pytest.approx(1 / 5)

    pipe = parse.parse_generation("Emotion: joyful\nProfile: young, female, HIGH\nResponse: great news!",
                               emap, pipeline_baseline=True)
    assert (pipe["emotion"], pipe["age"], pipe["gender"], pipe["timbre"]) == (0, 1, 1, 2)
    assert pipe["reply"] == "great news!"
    m = mtext.text_metrics([dict(pipe, labels={"emotion": 0, "age": 1, "gender": 0, "timbre": 2})])
    got = [m[f"{k}_acc_text"] for k in ("emotion", "age", "gender", "timbre")]
    assert got == [1, 1, 0, 1]


def test_reply_overlap_and_engagement_rows_on_hand_made_replies():
    """BLEU-1/2 and ROUGE-L are the libraries' own figures (and BLEU-1 a hand count on a one-pair corpus);
    question, reuse and duplicate rates are counted by hand."""
    from rouge_score import rouge_scorer
    from sacrebleu.metrics import BLEU

    replies = ["I am so sorry about your dog.", "That is great news!", "That is great news!",
               "Did you call the vet?"]
    golds = ["Oh no, I am sorry to hear about your dog.", "Congratulations, that is wonderful news!",
             "How exciting, when do you start?", "Have you talked to a vet about it?"]
    turns = ["My dog is sick and I'm worried.", "I got the job!", "I start my new job on Monday.",
             "My cat stopped eating."]
    got = mtext.reply_overlap(replies, golds)
    for n in (1, 2):
        want = BLEU(max_ngram_order=n, lowercase=True).corpus_score(replies, [golds]).score / 100
        assert got[f"reply_bleu{n}"] == pytest.approx(want) and 0 < want < 1
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    assert got["reply_rouge_l"] == pytest.approx(np.mean([scorer.score(g, r)["rougeL"].fmeasure
                                                          for r, g in zip(replies, golds, strict=True)]))
    # one pair by hand: "that is great news !" vs "that is wonderful news !" (13a splits the "!"): 4 of 5
    # unigrams match, equal lengths (no brevity penalty)
    one = mtext.reply_overlap(["That is great news!"], ["That is wonderful news!"])
    assert one["reply_bleu1"] == pytest.approx(4 / 5)
    assert mtext.reply_overlap(["a b c"], ["x y z"])["reply_rouge_l"] == 0.0
    rows = mtext.reply_engagement(replies, turns)
    assert rows["question_rate"] == pytest.approx(1 / 4)  # only the vet question
    # content words shared with the speaker's turn: "dog" (1st); "news" vs "got the job": none (2nd); none
    # (3rd: "great news" vs "start my new job on Monday"); "vet" vs "cat stopped eating": none
    assert rows["reuse_rate"] == pytest.approx(1 / 4)
    assert mtext.content_words("My dog is sick and I'm worried.") == {"dog", "sick", "worried"}
    assert rows["duplicate_rate"] == pytest.approx(1 - 3 / 4)  # "That is great news!" twice
    assert mtext.reply_engagement(["Ok.", "ok"], ["", ""])["duplicate_rate"] == 0.5  # case, punctuation
    with pytest.raises(ValueError, match="2 replies for 1"):
        mtext.reply_engagement(["a", "b"], ["c"])
    # text_metrics adds them when the predictions carry the gold reply and the speaker's turn
    preds = [{"reply": r, "gold_reply": g, "speaker_turn": t, "emotion_word": "", "emotion": -1, "labels": {}}
             for r, g, t in zip(replies, golds, turns, strict=True)]
    m = mtext.text_metrics(preds)
    assert {k: m[k] for k in (*got, *rows)} == {**got, **rows}


def test_baselines_equal_a_hand_computation(shards):
    got = eval_baselines.baselines(shards, "test", max_speech_len=ROWS, max_video_len=ROWS)
    train = ShardReader.for_split(shards, "train")
    test = ShardReader.for_split(shards, "test")
    tr = [train[i] for i in range(len(train))]
    te = [test[i] for i in range(len(test))]
    for label, name in (("emotion", "emotion_acc_cls"), ("age", "age_acc"), ("gender", "gender_acc"),
                        ("timbre", "timbre_acc")):
        majority = np.argmax(np.bincount([r["labels"][label] for r in tr]))  # argmax: first of ties
        assert got[name] == pytest.approx(np.mean([r["labels"][label] == majority for r in te]))
    assert got["emotion_acc_text"] == got["emotion_acc_cls"]
    for kind, rows in (("speech_content", ROWS), ("video_content", ROWS)):
        longest = min(rows, max(len(r["targets"][kind]) for r in tr))
        stack = np.full((len(tr), longest, tr[0]["targets"][kind].shape[1]), np.nan)
        for j, r in enumerate(tr):
            x = r["targets"][kind][:rows]
            stack[j, : len(x)] = x
        mean = np.nanmean(stack, axis=0)  # row i: the mean over the train targets that have a row i
        l2, cos = [], []
        for r in te:
            t = r["targets"][kind][:rows].astype(np.float64)
            p = mean[: len(t)]
            l2 += list(np.linalg.norm(p - t, axis=1))
            cos += list((p * t).sum(1) / np.linalg.norm(p, axis=1) / np.linalg.norm(t, axis=1))
        assert got[f"{kind}_l2"] == pytest.approx(np.mean(l2), rel=1e-9)
        assert got[f"{kind}_cos"] == pytest.approx(np.mean(cos), rel=1e-9)
    for kind in ("speech_style", "video_style"):
        mean = np.mean([r["targets"][kind] for r in tr], axis=0, dtype=np.float64)
        l2 = [np.linalg.norm(mean - r["targets"][kind]) for r in te]
        assert got[f"{kind}_l2"] == pytest.approx(np.mean(l2), rel=1e-9)
    assert got["dist1_corpus"] == pytest.approx(mtext.distinct_n([r["response"] for r in te], 1))
    assert got["dist2_reply"] == pytest.approx(mtext.distinct_n_per_reply([r["response"] for r in te], 2))
    engaged = mtext.reply_engagement([r["response"] for r in te], [mtext.speaker_turn(r) for r in te])
    assert {k: got[k] for k in engaged} == engaged and engaged["question_rate"] >= 0
    assert got["num_examples"] == 3
    # evaluate's one-pass form gives the same column and the bag-of-words floor of the same records
    both = eval_baselines.baseline_columns(shards, "test", max_speech_len=ROWS, max_video_len=ROWS)
    assert both["baseline"] == got
    assert both["bag_of_words"] == eval_baselines.bag_of_words(tr, te)
    chance = eval_baselines.chance_levels()
    assert chance["emotion_acc_cls"] == pytest.approx(1 / 7) and chance["gender_acc"] == 0.5


def test_format_table_shows_every_column_and_dashes_for_missing_values():
    table = eval_report.format_table({
        "trained": {"eval_loss": 1.23456, "emotion_acc_text": 0.5, "num_examples": 3.0},
        "baseline": {"emotion_acc_text": 0.25, "custom": 2.0},
    })
    lines = table.splitlines()
    assert lines[0].split("|")[1:-1] == [" metric           ", " better ", " trained ", " baseline "]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]}
    assert rows["emotion_acc_text"] == ["higher", "0.5000", "0.2500"]
    assert rows["eval_loss"] == ["lower", "1.2346", "-"]
    assert rows["num_examples"] == ["", "3", "-"]
    assert rows["custom"] == ["", "-", "2.0000"]
    order = [line.split("|")[1].strip() for line in lines[2:]]
    assert order == ["emotion_acc_text", "eval_loss", "num_examples", "custom"]


def test_missing_split_or_folder_is_named(model, tok, shards, tmp_path):
    with pytest.raises(ValueError, match=r"has no split 'nosuch'.*\['test', 'train', 'valid'\]"):
        ev.evaluate(model, tok, shards, "nosuch", progress=False)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ev.evaluate(model, tok, tmp_path / "nowhere", "test", progress=False)
    with pytest.raises(ValueError, match="no split 'training'"):
        eval_baselines.baselines(shards, "test", train_split="training")


def test_emotion_voting_takes_the_majority_and_breaks_ties_by_voter_order():
    gold = [0, 1, 2, 3, 4]

    def voter(emotions):
        return [{"record_index": i, "emotion": e, "emotion_fine": e, "emotion_word": "x", "reply": "",
                 "labels": {"emotion": g, "emotion_fine": g}}
                for i, (e, g) in enumerate(zip(emotions, gold, strict=True))]

    a = voter([0, 1, 5, -1, 6])
    b = voter([0, 2, 2, -1, 4])
    c = voter([1, 1, 2, -1, -1])
    # record 0: 0,0,1 -> 0; 1: 1,2,1 -> 1; 2: 5,2,2 -> 2; 3: nobody parsed -> -1;
    # 4: 6 vs 4, a tie -> the first voter's 6
    assert mtext.vote_emotions([a, b, c]) == {0: 0, 1: 1, 2: 2, 3: -1, 4: 6}
    assert mtext.vote_emotions([b, a, c])[4] == 4
    m = mtext.vote_metrics([a, b, c])
    assert m == {"emotion_acc_vote": pytest.approx(3 / 5), "emotion32_acc_vote": pytest.approx(3 / 5)}
    assert mtext.text_metrics(a)["emotion_acc_text"] == pytest.approx(2 / 5)  # voting beat the first voter
    assert mtext.vote_metrics([]) == {}


def test_per_class_accuracy_and_its_plot(tmp_path):
    classes = ("joyful", "sad", "angry")
    preds = [{"emotion": e, "labels": {"emotion": g}} for e, g in ((0, 0), (1, 0), (1, 1), (-1, 1), (0, 1),
                                                                    (2, -1))]
    got = mtext.per_class_accuracy(preds, "emotion", classes)
    assert got == {"joyful": {"accuracy": 0.5, "n": 2.0}, "sad": {"accuracy": pytest.approx(1 / 3), "n": 3.0}}
    path = eval_report.plot_per_class(got, "emotion (CoE step 2)", tmp_path / "plots" / "emotion.png")
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 300


def test_per_class_report_and_the_report_folder(tmp_path):
    """Figure 6 from both passes (generations and classifiers) and the folder a reader opens; every figure
    checked against a hand count of the hand-made predictions."""
    emap = schema.EmotionMap.load("avamerg7")
    sad, joy = emap.classes.index("sad"), emap.classes.index("happy")
    fine = schema.ED_EMOTIONS_32.index("sad")
    preds = [
        {"record_index": 0, "emotion": sad, "emotion_fine": fine, "reply": "a",
         "labels": {"emotion": sad, "emotion_fine": fine, "age": 1}},
        {"record_index": 1, "emotion": -1, "emotion_fine": -1, "reply": "b",  # a parse failure
         "labels": {"emotion": sad, "emotion_fine": fine, "age": 2}},
        {"record_index": 2, "emotion": sad, "emotion_fine": fine, "reply": "c",
         "labels": {"emotion": joy, "emotion_fine": -1, "age": -1}},
    ]
    classified = {0: {"labels": {"emotion": sad, "age": 1, "gender": 0, "timbre": -1}, "emotion_cls": sad,
                      "age_cls": 1, "gender_cls": 1},
                  1: {"labels": {"emotion": sad, "age": 2, "gender": 0, "timbre": -1}, "emotion_cls": joy,
                      "age_cls": 2, "gender_cls": 0}}
    got = eval_report.per_class_report({"predictions": preds, "classified": classified}, emap)
    assert set(got) == {"emotion_text", "emotion32_text", "emotion_cls", "age_cls", "gender_cls"}
    assert got["emotion_text"] == {"sad": {"accuracy": 0.5, "n": 2.0}, emap.classes[joy]: {"accuracy": 0.0,
                                                                                           "n": 1.0}}
    assert got["emotion32_text"] == {"sad": {"accuracy": 0.5, "n": 2.0}}
    assert got["emotion_cls"] == {"sad": {"accuracy": 0.5, "n": 2.0}}
    assert got["age_cls"] == {schema.AGES[1]: {"accuracy": 1.0, "n": 1.0},
                              schema.AGES[2]: {"accuracy": 1.0, "n": 1.0}}
    assert got["gender_cls"] == {"male": {"accuracy": 0.5, "n": 2.0}}  # timbre: no labelled example

    columns = {"trained": {"emotion_acc_text": 1 / 3, "num_generated": 3.0},
               "chance": {"emotion_acc_text": 0.2}}
    report = eval_report.write_report(tmp_path / "r", columns, notes=["template: coe"], per_class=got,
                             predictions={"coe": preds}, extra={"split": "test"})
    folder = report.parent
    assert json.loads((folder / "metrics.json").read_text()) == {**columns, "split": "test"}
    assert json.loads((folder / "per_class.json").read_text()) == got
    assert [json.loads(line) for line in (folder / "predictions_coe.jsonl").read_text().splitlines()] == preds
    text = report.read_text()
    assert "- template: coe" in text and eval_report.format_table(columns).strip() in text
    for plot in got:
        assert f"![{plot}](per_class_{plot}.png)" in text and (folder / f"per_class_{plot}.png").is_file()
    assert "| sad | 0.5000 | 2 |" in text


def test_bag_of_words_floor_is_fitted_on_the_train_part_only():
    """The floor learns which words go with which emotion from the train records alone: a word planted in
    every test record of one class (and in no train record) changes none of its predictions, and it scores
    the test records by hand."""
    def rec(text, emotion, fine):
        return {"history": [{"role": "speaker", "utterance": text}], "labels": {"emotion": emotion,
                                                                              "emotion_fine": fine}}

    train = [rec(t, e, f) for t, e, f in [
        ("I won the lottery today", 0, 1), ("we won the game, so happy", 0, 1), ("my best day ever", 0, 2),
        ("my dog died last night", 4, 5), ("I cried all night, so sad", 4, 5), ("I lost my job", 4, 6),
        ("a spider in my bed, terrified", 3, 7), ("the storm scared me", 3, 7)]]
    test = [rec("I won a prize", 0, 1), rec("my cat died", 4, 5), rec("a spider scared me", 3, 7),
            rec("the lottery made my day", 4, 6)]
    got = eval_baselines.bag_of_words(train, test)
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True).fit([eval_baselines.dialogue_text(r)
                                                                       for r in train])
    for key, name in (("emotion", "emotion_acc_text"), ("emotion_fine", "emotion32_acc_text")):
        clf = LogisticRegression(max_iter=2000).fit(vec.transform([eval_baselines.dialogue_text(r)
                                                                   for r in train]),
                                                    [r["labels"][key] for r in train])
        pred = clf.predict(vec.transform([eval_baselines.dialogue_text(r) for r in test]))
        assert got[name] == pytest.approx(np.mean(pred == [r["labels"][key] for r in test]))
    assert got["emotion_acc_text"] >= 0.75  # the three worded like the train records
    planted = [rec(r["history"][0]["utterance"] + (" zyzzyva" if r["labels"]["emotion"] == 4 else ""),
                   r["labels"]["emotion"], r["labels"]["emotion_fine"]) for r in test]
    assert eval_baselines.bag_of_words(train, planted) == got
    # a floor fitted on train AND test (the leak the test guards against) does use it
    leaked = eval_baselines.bag_of_words(train + planted, planted)
    assert leaked["emotion_acc_text"] > got["emotion_acc_text"], (leaked, got)


def test_a_killed_generation_resumes_from_its_journal_as_if_never_stopped(model, tok, shards, tmp_path,
                                                                         monkeypatch, capsys):
    """`generate_predictions(journal=)`: killed after its first batch (and mid-way through writing a line),
    the run started again generates only the missing batch, and its predictions equal an uninterrupted
    run's; other settings or other weights start the journal over; a damaged line in its middle is named."""
    from empatheia_jax.eval import journal as journal_lib

    sampling = ReplySampling(temperature=1.5, top_p=1.0, seed=3, candidates=2)
    kw = dict(batch_size=2, max_len=MAX_LEN, progress=False, compiler_options=FAST,
              decoding=Decoding(max_new_tokens=12, reply_sampling=sampling))
    whole = gp.generate_predictions(model, tok, shards, "test", **kw)
    real, calls = gp._generate_batch, []

    def killed_at(n):
        def batch(*a, **k):
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt
            return real(*a, **k)
        return batch

    path = tmp_path / "eval" / "generation.journal.jsonl"
    monkeypatch.setattr(gp, "_generate_batch", killed_at(2))
    with pytest.raises(KeyboardInterrupt):
        gp.generate_predictions(model, tok, shards, "test", **kw, journal=path)
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 2 and json.loads(lines[0])["journal"] == journal_lib.VERSION  # one batch of two
    with path.open("a") as f:
        f.write('{"record_index": 1, "te')  # the kill came mid-line

    calls.clear()
    monkeypatch.setattr(gp, "_generate_batch", killed_at(0))
    resumed = gp.generate_predictions(model, tok, shards, "test", **kw, journal=path)
    assert len(calls) == 1  # the missing batch only
    assert resumed == json.loads(json.dumps(whole))
    assert "2 predictions already generated" in capsys.readouterr().err
    kept = [json.loads(x) for x in path.read_text().splitlines()[1:]]  # the cut line is gone
    assert sorted(p["record_index"] for p in kept) == [0, 1, 2]

    calls.clear()  # other decoding settings: every batch again
    shorter = Decoding(max_new_tokens=10, reply_sampling=sampling)
    again = gp.generate_predictions(model, tok, shards, "test", **{**kw, "decoding": shorter}, journal=path)
    assert len(calls) == 2 and "another model, data or settings" in capsys.readouterr().err
    assert len(again) == 3

    state = nnx.state(model, nnx.Param)
    before = journal_lib.fingerprint(state, {"a": 1})
    leaf = jax.tree_util.tree_leaves(state)[-1]
    nudged = jax.tree_util.tree_map(lambda x: x.at[(0,) * x.ndim].add(1e-3) if x is leaf else x, state)
    assert journal_lib.fingerprint(nudged, {"a": 1}) != before != journal_lib.fingerprint(state, {"a": 2})
    assert journal_lib.fingerprint(state, {"a": 1}) == before

    # a template that splices no media decodes with the LLM alone: the CS and SD are not in its key
    def key(spliced):
        return gp._journal_of(tmp_path / f"k{spliced}.jsonl", model, None, {"a": 1}, spliced).fingerprint

    keys = {s: key(s) for s in (False, True)}
    cs_weight, llm_weight = model.content_sync.speech.out_proj.kernel, model.llm.norm.scale
    for var, same_unspliced in ((cs_weight, True), (llm_weight, False)):
        saved = var[...]
        var[...] = saved.at[(0,) * saved.ndim].add(1e-3)
        try:
            assert (key(False) == keys[False]) == same_unspliced and key(True) != keys[True]
        finally:
            var[...] = saved

    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"generation.journal.jsonl line 2: not JSON"):
        gp.generate_predictions(model, tok, shards, "test", **{**kw, "decoding": shorter}, journal=path)
