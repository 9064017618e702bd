"""grain input pipeline: exact template text through the pipeline, masks, features, truncation,
resume in a new process, per-process slices, corrupt shards. Shards are written here with the real
record format (empatheia_jax.data.shard_format) and the real SmolLM2 tokenizer."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from helpers import saved_smollm2_tokenizer

from empatheia_jax.assets import sha256_file
from empatheia_jax.data import input_pipeline as ip
from empatheia_jax.data import shard_format
from empatheia_jax.data.batching import collate, make_global_batch
from empatheia_jax.data.examples import ExampleBuilder, ExampleTooLongError, PipelineCounters, build_example
from empatheia_jax.data.pipeline_config import PipelineConfig
from empatheia_jax.data.shard_format import ShardRecordError
from empatheia_jax.data.shard_reader import ShardReader

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D_A, D_V = 8, 6

HIST = [
    ("speaker", "I paid all my bills today, I feel great!"),
    ("listener", "Every little accomplishment counts! What bills did you have to pay?"),
    (
        "speaker",
        "Rent and electricity. We've been struggling financially so it's such a relief to pay bills.",
    ),
]
COE = {
    "event_scenario": "Paying off overdue rent and electricity bills amid financial struggles.",
    "speaker_emotion": "content",
    "emotion_cause": "Relief from the burden of financial stress after successfully paying bills.",
    "goal_to_response": "Providing support and validation for the speaker's sense of accomplishment.",
}
RESP = "Sorry to hear that. Well, at least this will be a weight off your shoulders."

CHAT_PREFIX = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n"
)
CHAT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
COE_TARGET = (
    "Firstly, the event scenario of this conversation is: Paying off overdue rent and electricity bills amid "
    "financial struggles.\n\n"
    "Secondly, the emotion of the speaker is: content\n\n"
    "Thirdly, the emotion cause is: Relief from the burden of financial stress after successfully paying "
    "bills.\n\n"
    "Fourthly, the goal to response is: Providing support and validation for the speaker's sense of "
    "accomplishment.\n\n"
    "Finally, the response is: Sorry to hear that. Well, at least this will be a weight off your shoulders."
)
SIGNALS = "".join(f"<AUD{i}>" for i in range(1, 17)) + "".join(f"<VID{i}>" for i in range(1, 17))


# --------------------------------------------------------------------------------------------------
# fixtures


def make_record(i, hist=HIST, coe=COE, resp=RESP, k=1, targets=True):
    rng = np.random.default_rng(i)
    n = len(hist)
    tg = {}
    if targets:
        tg = {
            "speech_content": rng.standard_normal((5 + i % 7, 1024)).astype(np.float32),
            "video_content": rng.standard_normal((9 + i % 5, 256)).astype(np.float32),
            "speech_style": rng.standard_normal(256).astype(np.float32),
            "video_style": rng.standard_normal(256).astype(np.float32),
        }
    return {
        "schema_version": 1,
        "uid": f"c{i}:0",
        "split": "train",
        "conversation_id": f"c{i}",
        "turn": 0,
        "topic": "money",
        "speaker_profile": {"age": "young", "gender": "male", "timbre": "high", "ID": 1},
        "listener_profile": {"age": "elderly", "gender": "female", "timbre": "low", "ID": 2},
        "history": [
            {"index": j, "role": r, "utterance": u, "utt_id": f"diac{i}utt{j}_{1 + j % 2}"}
            for j, (r, u) in enumerate(hist)
        ],
        "response": resp,
        "response_utt_id": f"diac{i}utt{n}_2",
        "coe": dict(coe),
        "labels": {"emotion": i % 7, "emotion_fine": 9, "age": 3, "gender": 1, "timbre": 0},
        # distinct, recognisable rows: value = 1000*i + 10*utterance + vector index
        "audio_feats": (
            1000.0 * i
            + 10.0 * np.arange(n)[:, None, None]
            + np.arange(k)[None, :, None]
            + np.zeros((1, 1, D_A))
        ).astype(np.float32),
        "video_feats": (
            -1000.0 * i
            - 10.0 * np.arange(n)[:, None, None]
            - np.arange(k)[None, :, None]
            + np.zeros((1, 1, D_V))
        ).astype(np.float32),
        "targets": tg,
    }


def varied_records(n):
    out = []
    for i in range(n):
        hist = [HIST[j % 3] for j in range(1 + i % 5)]
        hist = [(("speaker", "listener")[j % 2], f"utt {j} of {i}: {u}") for j, (_, u) in enumerate(hist)]
        out.append(make_record(i, hist=hist))
    return out


def write_shards(out, records, n_shards=3, split="train", raw=None):
    """A shard folder as data/prepare.py writes it (manifest last). `raw` = {index: bytes} overrides."""
    os.makedirs(os.path.join(out, split), exist_ok=True)
    shards, per = [], -(-len(records) // n_shards)
    for s in range(n_shards):
        name = f"{split}/{shard_format.shard_filename(split, s, n_shards)}"
        w = ArrayRecordWriter(os.path.join(out, name), shard_format.ARRAY_RECORD_OPTIONS)
        part = range(s * per, min(len(records), (s + 1) * per))
        for i in part:
            w.write((raw or {}).get(i) or shard_format.encode_shard_record(records[i]))
        w.close()
        path = os.path.join(out, name)
        shards.append({"path": name, "records": len(part), "sha256": sha256_file(path)})
    manifest = {
        "format": shard_format.MANIFEST_FORMAT,
        "features": {"k": 1, "audio_dim": D_A, "video_dim": D_V},
        "splits": {split: {"records": len(records), "shards": shards}},
    }
    with open(os.path.join(out, shard_format.MANIFEST), "w") as f:
        json.dump(manifest, f)
    return out


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    return saved_smollm2_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def paper_shards(tmp_path_factory):
    return write_shards(str(tmp_path_factory.mktemp("paper")), [make_record(0), make_record(1)], n_shards=1)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(str(tmp_path_factory.mktemp("varied")), varied_records(31), n_shards=3)


def first_row(pipe):
    it = iter(pipe)
    b = next(it)
    it.close()
    return b


def real_tokens(b, row=0):
    return b["input_ids"][row][b["attention_mask"][row] == 1]


# --------------------------------------------------------------------------------------------------
# exact text and masks


def test_stage1_batch_text_and_loss_mask_exact(paper_shards, tok):
    pipe = ip.make_dataset(
        paper_shards, "train", "coe", tok, batch_size=2, shuffle=False, num_epochs=1,
        process_index=0, process_count=1, window_batches=1,
    )  # fmt: skip
    b = first_row(pipe)
    assert list(b["record_index"]) == [0, 1]
    expected = (
        CHAT_PREFIX
        + "Provide an empathetic response based on the given dialogue context below. Don't rush to "
        "give the response, thinking step by step.\n\nDialogue Context:\n{\n"
        "  Speaker:I paid all my bills today, I feel great!\n"
        "  Listener:Every little accomplishment counts! What bills did you have to pay?\n"
        "  Speaker:Rent and electricity. We've been struggling financially so it's such a relief to pay "
        "bills.\n"
        "}" + CHAT_SUFFIX + COE_TARGET + "<|im_end|>"
    )
    assert tok.decode(real_tokens(b)) == expected
    n = int(b["attention_mask"][0].sum())
    # next-token targets: input shifted left
    np.testing.assert_array_equal(b["target_ids"][0, : n - 1], b["input_ids"][0, 1:n])
    # the loss covers exactly the target tokens + eos, and nothing on padding
    assert tok.decode(b["target_ids"][0][b["loss_mask"][0] == 1]) == COE_TARGET + "<|im_end|>"
    assert b["loss_mask"][0, n - 1 :].sum() == 0
    assert tok.decode(b["input_ids"][0][b["response_mask"][0] == 1]).strip() == RESP
    # text stage: no placeholders, no feature rows; the content targets are present for stage 2
    assert b["aud_mask"].sum() == 0 and b["vid_mask"].sum() == 0
    assert b["speech_content_mask"][0].sum() == 5 and b["video_content_mask"][0].sum() == 9
    assert b["input_ids"].shape[1] in pipe.config.bucket_lengths()
    np.testing.assert_array_equal(b["positions"][0], np.arange(b["input_ids"].shape[1]))


def test_stage4_batch_text_masks_and_features_exact(paper_shards, tok):
    pipe = ip.make_dataset(
        paper_shards, "train", "overall", tok, batch_size=2, shuffle=False, num_epochs=1,
        process_index=0, process_count=1, window_batches=1,
    )  # fmt: skip
    b = first_row(pipe)
    expected_target = COE_TARGET + "\n" + SIGNALS
    expected = (
        CHAT_PREFIX + "Provide a multimodal empathetic response based on the given dialogue context below. "
        "Don't rush to give the response, thinking step by step.\n\nDialogue Context:\n{\n"
        "  Speaker:I paid all my bills today, I feel great!<Aud> <Vid>.\n"
        "  Listener:Every little accomplishment counts! What bills did you have to pay?<Aud> <Vid>.\n"
        "  Speaker:Rent and electricity. We've been struggling financially so it's such a relief to pay "
        "bills.<Aud> <Vid>.\n"
        "}" + CHAT_SUFFIX + expected_target + "<|im_end|>"
    )
    assert tok.decode(real_tokens(b)) == expected
    assert tok.decode(b["target_ids"][0][b["loss_mask"][0] == 1]) == expected_target + "<|im_end|>"
    # the 32 signal tokens are single tokens, in order, inside the loss
    sig_ids = [
        pipe.token_ids[t] for t in [f"<AUD{i}>" for i in range(1, 17)] + [f"<VID{i}>" for i in range(1, 17)]
    ]
    ids = list(real_tokens(b))
    start = ids.index(sig_ids[0])
    assert ids[start : start + 32] == sig_ids
    # feature rows follow the order of the placeholders; one row per <Aud>/<Vid>
    aud_pos = np.flatnonzero(b["input_ids"][0] == pipe.token_ids["<Aud>"])
    assert len(aud_pos) == 3 == b["aud_mask"][0].sum() == b["vid_mask"][0].sum()
    np.testing.assert_array_equal(b["aud_feats"][0, :3, 0], [0.0, 10.0, 20.0])
    np.testing.assert_array_equal(b["aud_feats"][1, :3, 0], [1000.0, 1010.0, 1020.0])
    np.testing.assert_array_equal(b["vid_feats"][1, :3, 0], [-1000.0, -1010.0, -1020.0])
    assert b["aud_feats"][0, 3:].sum() == 0
    # targets and labels
    rec = make_record(1)
    np.testing.assert_array_equal(b["speech_style"][1], rec["targets"]["speech_style"])
    np.testing.assert_array_equal(b["speech_content"][1, :6], rec["targets"]["speech_content"])
    assert b["speech_content_mask"][1].sum() == 6 and b["style_mask"].tolist() == [[1, 1], [1, 1]]
    assert b["emotion"].tolist() == [0, 1] and b["age"].tolist() == [3, 3] and b["gender"].tolist() == [1, 1]


def test_stage3_and_ablation_targets(tok):
    ex = build_example(make_record(0), "sac", tok)
    assert tok.decode(ex["target_ids"][ex["loss_mask"] == 1]) == SIGNALS + "<|im_end|>"
    assert ex["response_mask"].sum() == 0 and len(ex["aud_feats"]) == 3
    cfg = PipelineConfig(use_coe=False)
    ex = build_example(make_record(0), "overall", tok, cfg)
    assert tok.decode(ex["target_ids"][ex["loss_mask"] == 1]) == RESP + "\n" + SIGNALS + "<|im_end|>"
    cfg = PipelineConfig(pipeline_baseline=True)
    ex = build_example(make_record(0), "overall", tok, cfg)
    assert tok.decode(ex["target_ids"][ex["loss_mask"] == 1]) == (
        f"Emotion: content\nProfile: elderly, female, low\nResponse: {RESP}<|im_end|>"
    )
    assert len(ex["aud_feats"]) == 0 and "<Aud>" not in tok.decode(ex["input_ids"])
    prompt = build_example(make_record(0), "overall", tok, PipelineConfig(include_target=False))
    assert tok.decode(prompt["input_ids"]).endswith(CHAT_SUFFIX) and prompt["loss_mask"].sum() == 0


def _word_units(text):
    """A stand-in unit function with a known answer: pads around one id per word (len % 50 + 1)."""
    return np.array([0, *(len(w) % 50 + 1 for w in text.split()), 0], np.int32)


def test_speech_units_follow_the_reply_and_are_checked_against_its_target(tok):
    """A unit-aligned CS's batch: `speech_units` of the reply, padded to max_speech_len, row i the unit of
    target row i; a reply whose units do not match its content rows is named, never silently misaligned."""
    rec = make_record(0)
    units = _word_units(rec["response"])
    rec["targets"]["speech_content"] = np.ones((len(units), 1024), np.float32)
    cfg = PipelineConfig(speech_units=_word_units, max_speech_len=12)
    ex = build_example(rec, "ccl", tok, cfg)
    np.testing.assert_array_equal(ex["speech_units"], units[:12])
    b = collate([ex, ex], cfg, 3, audio_dim=D_A, video_dim=D_V, pad_id=0)
    assert b["speech_units"].shape == (3, 12) and b["speech_units"].dtype == np.int32
    np.testing.assert_array_equal(b["speech_units"][1], units[:12])
    assert not b["speech_units"][2].any()  # a filler row
    assert "speech_units" not in collate([build_example(rec, "ccl", tok)], PipelineConfig(), 1,
                                         audio_dim=D_A, video_dim=D_V, pad_id=0)
    rec["targets"]["speech_content"] = np.ones((len(units) + 1, 1024), np.float32)
    with pytest.raises(ValueError, match=f"{len(units)} content units but its speech_content target"):
        build_example(rec, "ccl", tok, cfg)


def test_video_units_are_the_records_stored_frame_units_and_are_refused_when_they_disagree(tok):
    """A unit-aligned video block's batch: `video_units` are the record's stored per-frame ids (targets kind
    video_units [T, 1]), int32, padded to max_video_len; a record without them, or with a count other than
    its video_content rows, is refused naming the record."""
    rec = make_record(0)
    frames = np.array([0, 0, 12, 12, 44, 7, 7, 7, 0, 0], np.float32)
    rec["targets"]["video_content"] = np.zeros((len(frames), 256), np.float32)
    rec["targets"]["video_units"] = frames[:, None]
    cfg = PipelineConfig(video_units=True, max_video_len=8)
    ex = build_example(rec, "ccl", tok, cfg)
    assert ex["video_units"].dtype == np.int32 and ex["video_units"].tolist() == [0, 0, 12, 12, 44, 7, 7, 7]
    b = collate([ex, ex], cfg, 3, audio_dim=D_A, video_dim=D_V, pad_id=0)
    assert b["video_units"].shape == (3, 8) and b["video_units"][1].tolist() == ex["video_units"].tolist()
    assert not b["video_units"][2].any()  # a filler row
    assert "video_units" not in collate([build_example(rec, "ccl", tok)], PipelineConfig(), 1,
                                        audio_dim=D_A, video_dim=D_V, pad_id=0)
    where = "test-00000-of-00001.array_record record 3"
    short = {**rec, "targets": {**rec["targets"], "video_units": frames[:-1, None]}}
    with pytest.raises(ValueError, match=f"{where}: 9 video_units but 10 video_content rows"):
        ExampleBuilder(tok, cfg, audio_dim=D_A, video_dim=D_V)(short, where=where)
    none = {**rec, "targets": {k: v for k, v in rec["targets"].items() if k != "video_units"}}
    with pytest.raises(ValueError, match=f"{where}: the video block is unit-aligned"):
        ExampleBuilder(tok, cfg, audio_dim=D_A, video_dim=D_V)(none, where=where)
    half = {**rec, "targets": {**rec["targets"], "video_units": frames[:, None] + 0.5}}
    with pytest.raises(ValueError, match="whole unit ids"):
        build_example(half, "ccl", tok, cfg)
    # A record with no video target at all (text-only shards: the reference model's dev re-measure) has no
    # frame to align: its units are empty, as its video_content is.
    text_only = {**rec, "targets": {k: v for k, v in rec["targets"].items()
                                    if k not in ("video_units", "video_content")}}
    ex = build_example(text_only, "coe", tok, cfg)
    assert ex["video_units"].shape == (0,) and ex["video_content"].shape[0] == 0


def test_k_vectors_per_placeholder(tok):
    ex = build_example(make_record(2, k=2), "overall", tok)
    text = tok.decode(ex["input_ids"])
    assert "great!<Aud><Aud> <Vid><Vid>." in text
    # rows: utterance-major, then vector index, in placeholder order
    np.testing.assert_array_equal(ex["aud_feats"][:, 0], [2000, 2001, 2010, 2011, 2020, 2021])


# --------------------------------------------------------------------------------------------------
# truncation


def test_truncation_drops_oldest_utterances_first_and_never_the_target(tok):
    hist = [(("speaker", "listener")[j % 2], f"utterance number {j} " + "blah " * 30) for j in range(8)]
    rec = make_record(5, hist=hist)
    full = build_example(rec, "overall", tok, PipelineConfig(max_len=2048))
    cfg = PipelineConfig(max_len=len(full["input_ids"]) - 60)
    counters = PipelineCounters()
    ex = build_example(rec, "overall", tok, cfg, counters=counters)
    text = tok.decode(ex["input_ids"])
    assert len(ex["input_ids"]) <= cfg.max_len
    kept = [j for j in range(8) if f"utterance number {j} " in text]
    assert kept == list(range(8 - len(kept), 8)) and 0 < len(kept) < 8  # a suffix: oldest dropped
    assert counters["dropped_utterances"] == 8 - len(kept) == ex["dropped_utterances"]
    assert counters["truncated_examples"] == 1 and counters["text_truncated"] == 0
    target = tok.decode(ex["target_ids"][ex["loss_mask"] == 1])
    assert target == COE_TARGET + "\n" + SIGNALS + "<|im_end|>"
    # the features of the dropped utterances are dropped with them
    np.testing.assert_array_equal(ex["aud_feats"][:, 0], [5000 + 10 * j for j in kept])

    # only one utterance left and still too long: its text is cut from the left
    rec = make_record(6, hist=[("speaker", "first words " + "very long " * 200 + "last words")])
    counters = PipelineCounters()
    ex = build_example(rec, "overall", tok, PipelineConfig(max_len=400), counters=counters)
    text = tok.decode(ex["input_ids"])
    assert len(ex["input_ids"]) <= 400 and "last words<Aud> <Vid>." in text and "first words" not in text
    assert counters["text_truncated"] == 1 and counters["truncated_examples"] == 1
    assert tok.decode(ex["target_ids"][ex["loss_mask"] == 1]).startswith("Firstly, the event scenario")

    # the target alone does not fit: refused and counted
    counters = PipelineCounters()
    with pytest.raises(ExampleTooLongError):
        build_example(make_record(7), "overall", tok, PipelineConfig(max_len=120), counters=counters)
    assert counters["skipped_target_too_long"] == 1


def test_placeholder_budget_drops_oldest(tok):
    counters = PipelineCounters()
    ex = build_example(
        make_record(3), "sac", tok, PipelineConfig(max_aud=2, max_vid=2), counters=counters
    )
    assert tok.decode(ex["input_ids"]).count("<Aud>") == 2 and counters["dropped_utterances"] == 1
    np.testing.assert_array_equal(ex["aud_feats"][:, 0], [3010, 3020])


def test_skipped_example_becomes_filler_row_and_is_counted(tmp_path, tok):
    recs = [make_record(i) for i in range(3)]
    recs[1] = make_record(1, resp="word " * 400)
    d = write_shards(str(tmp_path), recs, n_shards=1)
    pipe = ip.make_dataset(
        d, "train", "coe", tok, batch_size=3, max_len=256, shuffle=False, num_epochs=1,
        process_index=0, process_count=1,
    )  # fmt: skip
    (b,) = list(pipe)
    assert sorted(b["record_index"].tolist()) == [-1, 0, 2]
    filler = int(np.flatnonzero(b["record_index"] == -1)[0])
    for k in ("loss_mask", "attention_mask", "aud_mask", "speech_content_mask", "style_mask"):
        assert b[k][filler].sum() == 0
    assert b["emotion"][filler] == -1
    assert pipe.counters["skipped_target_too_long"] == 1 and pipe.counters["filler_rows"] == 1


# --------------------------------------------------------------------------------------------------
# order, slices, bucketing, resume


def test_process_slices_are_disjoint_and_cover_the_epoch(shards, tok):
    def ids(pi, **kw):
        p = ip.make_dataset(
            shards, "train", "overall", tok, batch_size=4, seed=7, num_epochs=1, process_index=pi,
            process_count=2, window_batches=2, **kw,
        )  # fmt: skip
        batches = list(p)
        assert len(batches) == len(p)
        return [int(x) for b in batches for x in b["record_index"]], len(batches)

    # evaluation mode: nothing lost, equal step counts, filler rows pad the odd record count
    (a, na), (b, nb) = ids(0, drop_remainder=False), ids(1, drop_remainder=False)
    real_a, real_b = {x for x in a if x >= 0}, {x for x in b if x >= 0}
    assert na == nb and not real_a & real_b and real_a | real_b == set(range(31))
    assert len(a) == len(b) and a.count(-1) + b.count(-1) == 2 * 4 * na - 31
    # training mode: floor(31/2) = 15 records each, 3 full batches, remainder dropped
    (a, na), (b, nb) = ids(0), ids(1)
    assert na == nb == 3 and not set(a) & set(b) and -1 not in a + b
    assert a != sorted(a)  # shuffled


def test_epochs_are_reshuffled_and_buckets_are_static(shards, tok):
    p = ip.make_dataset(
        shards, "train", "coe", tok, batch_size=3, seed=1, num_epochs=2, process_index=0, process_count=1,
        window_batches=10, max_len=512, buckets=(64, 128, 192, 256, 512),
    )  # fmt: skip
    batches = list(p)
    seen = np.bincount([int(x) for b in batches for x in b["record_index"]], minlength=31)
    # 62 slots, the last 2 dropped to keep batches full (drop_remainder): every record once or twice
    assert len(batches) == 20 and seen.sum() == 60 and set(seen.tolist()) == {1, 2}
    assert p.counters["dropped_remainder"] == 2
    order = ip._RecordOrder(31, seed=1, shuffle=True, index=0, count=1, even=True, num_epochs=2)
    e1, e2 = [order[i] for i in range(31)], [order[i] for i in range(31, 62)]
    assert sorted(e1) == sorted(e2) == list(range(31)) and e1 != e2 and e1 != sorted(e1)
    for b in batches:
        L = b["input_ids"].shape[1]
        assert L in (64, 128, 192, 256, 512)
        longest = int(b["attention_mask"].sum(1).max())
        assert longest <= L and (
            L == 64 or longest > p.config.bucket_lengths()[p.config.bucket_lengths().index(L) - 1]
        )


RESUME_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from empatheia_jax.data import input_pipeline as ip

    shards, tok_dir, state_file, out, workers = sys.argv[1:]
    p = ip.make_dataset(shards, "train", "overall", tok_dir, batch_size=4, seed=3, process_index=0,
                        process_count=1, window_batches=2, worker_count=int(workers))
    it = iter(p)
    with open(state_file) as f:
        it.set_state(json.load(f))
    batches = [next(it) for _ in range(6)]
    it.close()
    np.savez(out, **{f"{i}/{k}": v for i, b in enumerate(batches) for k, v in b.items()})
    """
)


def test_resume_in_a_new_process_gives_identical_batches(shards, tok_dir, tmp_path):
    p = ip.make_dataset(
        shards, "train", "overall", tok_dir, batch_size=4, seed=3, process_index=0, process_count=1,
        window_batches=2,
    )  # fmt: skip
    it = iter(p)
    for _ in range(3):  # stop in the middle of window 1 (2 batches per window)
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(6)]  # 36 records: crosses into the second epoch
    it.close()
    assert state["window"] == 1 and state["batch_in_window"] == 1
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(state))  # the state is plain JSON
    out = tmp_path / "resumed.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, shards, tok_dir, str(state_file), str(out), "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(out)
    for i, b in enumerate(expected):
        for k, v in b.items():
            np.testing.assert_array_equal(got[f"{i}/{k}"], v, err_msg=f"batch {i} key {k}")


def test_grain_checkpoint_handler_round_trip(shards, tok, tmp_path):
    """The orbax/grain CheckpointHandler (what the trainer's CheckpointManager uses) saves and restores it."""
    import grain
    from etils import epath

    def pipe():
        return ip.make_dataset(
            shards, "train", "sac", tok, batch_size=4, seed=5, process_index=0, process_count=1,
            window_batches=3,
        )  # fmt: skip

    it = iter(pipe())
    for _ in range(4):
        next(it)
    grain.checkpoint.CheckpointHandler().save(epath.Path(tmp_path), item=it)
    expected = [next(it)["record_index"] for _ in range(3)]
    restored = grain.checkpoint.CheckpointHandler().restore(epath.Path(tmp_path), item=iter(pipe()))
    assert [next(restored)["record_index"].tolist() for _ in range(3)] == [e.tolist() for e in expected]


def test_state_from_another_pipeline_is_refused(shards, tok):
    a = iter(
        ip.make_dataset(shards, "train", "coe", tok, batch_size=4, seed=1, process_index=0, process_count=1)
    )
    b = iter(
        ip.make_dataset(shards, "train", "coe", tok, batch_size=4, seed=2, process_index=0, process_count=1)
    )
    with pytest.raises(ValueError, match="seed"):
        b.set_state(a.get_state())


# --------------------------------------------------------------------------------------------------
# corrupt shards


def test_corrupt_record_names_shard_and_index(tmp_path, tok):
    recs = [make_record(i) for i in range(6)]
    d = write_shards(str(tmp_path), recs, n_shards=2, raw={4: b"\xc1 this is not msgpack"})
    pipe = ip.make_dataset(
        d, "train", "coe", tok, batch_size=2, shuffle=False, num_epochs=1, process_index=0, process_count=1
    )
    with pytest.raises(ShardRecordError, match=r"train-00001-of-00002\.array_record record 1"):
        list(pipe)


def test_corrupt_shard_file_is_named(tmp_path, tok):
    d = write_shards(str(tmp_path), [make_record(i) for i in range(6)], n_shards=2)
    bad = os.path.join(d, "train", "train-00001-of-00002.array_record")
    with open(bad, "r+b") as f:
        f.truncate(40)
    with pytest.raises(ShardRecordError, match=r"train-00001-of-00002\.array_record"):
        ip.make_dataset(d, "train", "coe", tok, batch_size=2, process_index=0, process_count=1)
    # a shard replaced by one with a different record count is caught against the manifest
    w = ArrayRecordWriter(bad, shard_format.ARRAY_RECORD_OPTIONS)
    w.write(shard_format.encode_shard_record(make_record(9)))
    w.close()
    with pytest.raises(ShardRecordError, match=r"train-00001-of-00002\.array_record: 1 records"):
        ip.make_dataset(d, "train", "coe", tok, batch_size=2, process_index=0, process_count=1)


# --------------------------------------------------------------------------------------------------
# global arrays


def test_make_global_batch_shards_the_batch_axis(paper_shards, tok):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    b = first_row(
        ip.make_dataset(paper_shards, "train", "sac", tok, batch_size=2, process_index=0, process_count=1)
    )
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    g = make_global_batch(b, NamedSharding(mesh, PartitionSpec("data")))
    assert g["aud_feats"].shape == b["aud_feats"].shape
    assert g["aud_feats"].sharding.spec == PartitionSpec("data", None, None)
    np.testing.assert_array_equal(np.asarray(g["input_ids"]), b["input_ids"])


def test_exported_frame_units_survive_into_the_batch(tmp_path, tok):
    """End to end: face targets exported with the demo's reply mouth -> prepare -> the pipeline of a
    unit-aligned video block: each batch row's video_units are the exported units of its reply, frame for
    frame (0-padded past the clip), aligned with its video_content rows."""
    from helpers import make_tiny_shards

    from empatheia_jax.data.targets import TargetReader

    shards = make_tiny_shards(tmp_path, counts=(("train", 2), ("test", 2)), real_targets=True,
                              mouth="replies")
    reader = TargetReader(tmp_path / "raw" / "targets")
    records = ShardReader.for_split(shards, "test")
    pipe = ip.make_dataset(shards, "test", "ccl", tok, batch_size=4, max_len=512, shuffle=False, num_epochs=1,
                           drop_remainder=False, window_batches=1, process_index=0, process_count=1,
                           video_units=True, max_video_len=400)
    seen = 0
    for batch in pipe:
        for b, i in enumerate(batch["record_index"]):
            if i < 0:
                continue
            uid = records[int(i)]["response_utt_id"]
            units = reader.get("video_units", uid)[:, 0].astype(np.int32)
            n = len(units)
            assert n == int(batch["video_content_mask"][b].sum()) and n <= 400
            np.testing.assert_array_equal(batch["video_units"][b, :n], units)
            assert not batch["video_units"][b, n:].any() and units.any()
            np.testing.assert_array_equal(batch["video_content"][b, :n], reader.get("video_content", uid))
            seen += 1
    assert seen == len(records) >= 2
