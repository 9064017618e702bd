"""`empatheia_jax.serve.chat` (with `serve.history`, `serve.prompt`, `serve.outputs`): the prompt equals
training's, the heads read the generated sequence exactly where teacher forcing reads it, output files
round-trip, and bad inputs are named.

A tiny random Empatheia (2 layers, d=32) around the real SmolLM2 tokenizer, with the lite encoder on the
media of the tiny shards (`helpers.make_tiny_shards`). The reference for the features is an independent
right-padded, teacher-forced forward of the final sequence with features encoded straight from the files.
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

from empatheia_jax.data.encoders import get_encoder
from empatheia_jax.data.examples import build_example
from empatheia_jax.data.pipeline_config import PipelineConfig
from empatheia_jax.data.shard_reader import ShardReader
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.serve import chat
from empatheia_jax.serve.decoding import Decoding, ReplySampling
from empatheia_jax.serve.history import ChatInputError, load_history
from empatheia_jax.serve.outputs import format_result, read_outputs, write_outputs
from empatheia_jax.serve.prompt import build_prompt, encoder_from_manifest

ROWS = TINY_ROWS
HEADS = ("speech_content", "video_content", "speech_style", "video_style")
pytestmark = pytest.mark.usefixtures("exact_matmuls")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_tiny_shards(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def media(shards):
    return shards.parent / "raw" / "media"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_smollm2_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def model(tok, shards) -> Empatheia:
    return tiny_empatheia(tok, shards)


def _history(media):
    return [
        {"role": "speaker", "utterance": "test1 line 0: I feel disgusted",
         "audio": str(media / "diatest1utt0_7.wav"), "video": str(media / "diatest1utt0_7.mp4")},
        {"role": "listener", "utterance": "test1 line 1: Oh no, tell me more.", "audio": None, "video": None},
    ]


def _ask(model, tok, media, max_new_tokens=5, written=None):
    return chat.respond(model, tok, text="test1 line 2: I feel disgusted", audio=media / "diatest1utt2_7.wav",
                        video=media / "diatest1utt2_7.mp4", history=_history(media), encoder="lite",
                        decoding=Decoding(max_new_tokens=max_new_tokens), compiler_options=FAST,
                        written=written)


@pytest.fixture(scope="module")
def forced(model, tok, media):
    """The untrained model's reply (it writes no signal tokens, so they are forced)."""
    return _ask(model, tok, media)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST)
def _teacher_forced(graphdef, state, batch):
    out = nnx.merge(graphdef, state)(batch, train=False)
    return {k: out[k] for k in (*HEADS, "emotion_logits", "age_logits", "gender_logits", "timbre_logits",
                                "r_s_positions")}


def _reference(model, result, media) -> dict[str, np.ndarray]:
    """Right-padded, teacher-forced forward of the final sequence; features encoded from the files."""
    enc = get_encoder("lite")
    files = ["diatest1utt0_7", "diatest1utt2_7"]  # the utterances with media, in order
    aud = np.concatenate([enc.encode_audio(media / f"{f}.wav") for f in files])
    vid = np.concatenate([enc.encode_video(media / f"{f}.mp4") for f in files])
    n, length = len(result.input_ids), 256
    ids = np.full((1, length), 0, np.int32)
    ids[0, :n] = result.input_ids
    attn = np.zeros((1, length), np.int32)
    attn[0, :n] = 1
    resp = np.zeros((1, length), np.int32)
    resp[0, :n] = result.response_mask
    batch = {"input_ids": ids, "attention_mask": attn, "response_mask": resp,
             "positions": np.arange(length, dtype=np.int32)[None], "aud_feats": aud[None],
             "aud_mask": np.ones((1, len(aud)), np.int32), "vid_feats": vid[None],
             "vid_mask": np.ones((1, len(vid)), np.int32)}
    graphdef, state = nnx.split(model)
    out = _teacher_forced(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()})
    return {k: np.asarray(v[0]) for k, v in out.items()}


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _check_against_teacher_forcing(model, result, media):
    ref = _reference(model, result, media)
    cfg = model.config
    p = result.prompt_length
    sig = [int(np.flatnonzero(result.input_ids == s)[0]) for s in cfg.signal_ids]
    np.testing.assert_array_equal(ref["r_s_positions"], sig[: cfg.n_signal])  # all present, after the prompt
    assert min(sig) >= p
    for k in HEADS:
        assert result.features[k].shape == ref[k].shape
        np.testing.assert_allclose(result.features[k], ref[k], rtol=1e-4, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(result.emotion_probs, _softmax(ref["emotion_logits"]), rtol=1e-4, atol=1e-6)
    assert result.emotion == result.emotion_classes[int(np.argmax(ref["emotion_logits"]))]
    for name in ("age", "gender", "timbre"):
        np.testing.assert_allclose(result.profile[f"{name}_probs"], _softmax(ref[f"{name}_logits"]),
                                   rtol=1e-4, atol=1e-6)


def test_prompt_is_the_training_template_with_the_shards_features(model, tok, shards, media):
    rec = ShardReader.for_split(shards, "test")[2]  # three history utterances, all with media
    utts = [{"role": u["role"], "utterance": u["utterance"], "audio": media / f"{u['utt_id']}.wav",
             "video": media / f"{u['utt_id']}.mp4"} for u in rec["history"]]
    prompt = build_prompt(model.config, tok, utts, encoder=get_encoder("lite"))
    cfg = PipelineConfig(stage="overall", include_target=False, n_signal=4, max_speech_len=ROWS,
                         max_video_len=ROWS)
    ex = build_example(rec, "overall", tok, cfg)
    assert prompt.ids == ex["input_ids"].tolist()
    np.testing.assert_allclose(prompt.aud_feats, ex["aud_feats"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(prompt.vid_feats, ex["vid_feats"], rtol=1e-6, atol=1e-6)

    # Mixed media: no placeholder without a feature; one modality gets only its own placeholder.
    feats = [(np.ones((1, 96), np.float32), np.ones((1, 526), np.float32)), (None, None),
             (np.ones((1, 96), np.float32), None)]
    mixed = build_prompt(model.config, tok, utts, features=feats)
    text = tok.decode(mixed.ids)
    assert "  Speaker:test1 line 0: I feel disgusted<Aud> <Vid>.\n" in text
    assert "  Listener:test1 line 1: Oh no, tell me more.\n" in text
    assert "  Speaker:test1 line 2: I feel disgusted<Aud>.\n}" in text
    assert mixed.aud_feats.shape == (2, 96) and mixed.vid_feats.shape == (1, 526)
    assert any("only one of speech/video" in n for n in mixed.notes)
    # Too long: the oldest utterances go first, the latest stays.
    short = build_prompt(model.config, tok, utts, features=feats, max_len=len(mixed.ids) - 5)
    assert short.dropped_utterances == 1
    assert short.aud_feats.shape == (1, 96) and short.vid_feats.shape == (0, 526)
    with pytest.raises(ValueError, match="latest utterance alone"):
        build_prompt(model.config, tok, utts, features=feats, max_len=40)


def test_forced_signal_tokens_and_features_equal_a_teacher_forced_forward(model, tok, media, forced):
    r = forced
    cfg = model.config
    assert r.signal_tokens_forced and any("signal tokens" in n for n in r.notes)
    gen = r.input_ids[r.prompt_length :]
    nl = tok("\n", add_special_tokens=False)["input_ids"]
    # 5 generated tokens, then a newline, <AUD1..4><VID1..4> and the end token.
    assert gen[5:].tolist() == [*nl, *cfg.signal_ids, tok.eos_token_id]
    assert r.text == tok.decode(gen[:5].tolist(), skip_special_tokens=False)
    latest = {"role": "speaker", "utterance": "test1 line 2: I feel disgusted",
              "audio": str(media / "diatest1utt2_7.wav"), "video": str(media / "diatest1utt2_7.mp4")}
    prompt = build_prompt(cfg, tok, [*_history(media), latest], encoder=get_encoder("lite"))
    assert r.input_ids[: r.prompt_length].tolist() == prompt.ids
    # r^t = the reply's tokens: the generated text (no CoE headers in a random model's output).
    assert r.response_mask[: r.prompt_length].sum() == 0 and r.response_mask[r.prompt_length :][:5].all()
    assert " ".join(tok.decode(r.input_ids[r.response_mask == 1].tolist()).split()) == r.reply
    assert r.features["speech_content"].shape == (ROWS, 1024) and r.features["speech_style"].shape == (256,)
    _check_against_teacher_forcing(model, r, media)


def _rig_to_emit(model: Empatheia, chain: dict[int, int]) -> None:
    """Greedy decoding follows `chain` (input token -> next token): O(1) random embeddings, and an lm_head
    whose column for `next` points along the embedding of `input` (tiny layers barely move the residual)."""
    cfg = model.config.llm
    key = jax.random.key(7)
    emb = jax.random.normal(key, (cfg.vocab_size, cfg.hidden_size))
    extra = jax.random.normal(jax.random.fold_in(key, 1), (cfg.extra_vocab, cfg.hidden_size))
    model.llm.embed_tokens.embedding[...] = emb
    model.llm.embed_extra[...] = extra
    table = np.concatenate([np.asarray(emb), np.asarray(extra)])
    head = np.zeros((cfg.hidden_size, cfg.total_vocab), np.float32)
    for src, dst in chain.items():
        head[:, dst] += 8.0 * table[src] / np.linalg.norm(table[src])
    model.llm.lm_head.kernel[...] = jnp.asarray(head[:, : cfg.vocab_size])
    model.llm.lm_head_extra[...] = jnp.asarray(head[:, cfg.vocab_size :])


def test_generated_signal_tokens_are_not_forced_and_features_equal_teacher_forcing(model, tok, media):
    chat_model, model = model, nnx.clone(model)  # rigged below; the module's model stays as it is
    cfg = model.config
    last = tok("\n", add_special_tokens=False)["input_ids"][-1]  # the chat template's last prompt token
    words = tok(" Oh dear", add_special_tokens=False)["input_ids"]
    seq = [last, *words, *cfg.signal_ids, tok.eos_token_id]
    _rig_to_emit(model, dict(zip(seq[:-1], seq[1:], strict=True)))
    r = _ask(model, tok, media, max_new_tokens=16)
    assert r.input_ids[r.prompt_length :].tolist() == seq[1:]  # generated as rigged: nothing appended
    assert not r.signal_tokens_forced
    assert r.reply == "Oh dear"
    assert r.response_mask[r.prompt_length :].tolist() == [1] * len(words) + [0] * (len(seq) - 1 - len(words))
    _check_against_teacher_forcing(model, r, media)
    # The same reply given as `written` reaches the heads as the generated one did (the same tokens, reply and
    # features), and it is read, not generated: the untrained model, which writes other words, reads it too.
    written = tok.decode(seq[1:-1], skip_special_tokens=False)  # " Oh dear<AUD1>...<VID4>"
    w = _ask(model, tok, media, written=written)
    assert w.input_ids.tolist() == r.input_ids.tolist() and w.reply == "Oh dear"
    for name, value in r.features.items():
        np.testing.assert_allclose(w.features[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    untrained = _ask(chat_model, tok, media, written=written)
    assert untrained.input_ids.tolist() == r.input_ids.tolist() and untrained.reply == "Oh dear"


def test_outputs_round_trip(forced, tmp_path):
    npz, js = write_outputs(forced, tmp_path / "out" / "reply.npz")
    assert (npz.name, js.name) == ("reply.npz", "reply.json")
    arrays, meta = read_outputs(tmp_path / "out" / "reply")
    for k in HEADS:
        np.testing.assert_array_equal(arrays[k], forced.features[k])
    np.testing.assert_array_equal(arrays["emotion_probs"], forced.emotion_probs)
    assert int(arrays["emotion_id"]) == forced.emotion_classes.index(forced.emotion)
    for name, vocab in (("age", ("child", "young", "middle-aged", "elderly")), ("gender", ("male", "female")),
                        ("timbre", ("low", "mid", "high"))):
        assert int(arrays[f"{name}_id"]) == vocab.index(forced.profile[name])
        np.testing.assert_array_equal(arrays[f"{name}_probs"], forced.profile[f"{name}_probs"])
        assert meta["profile"][name] == forced.profile[name]
    np.testing.assert_array_equal(arrays["input_ids"], forced.input_ids)
    np.testing.assert_array_equal(arrays["response_mask"], forced.response_mask)
    assert (meta["text"], meta["coe"], meta["reply"], meta["emotion"]) == (
        forced.text, forced.coe, forced.reply, forced.emotion)
    assert meta["signal_tokens_forced"] is True and meta["notes"] == forced.notes
    assert meta["speech_content_units"] == forced.speech_content_units
    assert "Reply: " + forced.reply in format_result(forced)


def _write(path, obj) -> str:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def test_history_errors_name_the_file_and_the_entry(tmp_path, media):
    ok = {"role": "speaker", "utterance": "hi"}
    (tmp_path / "a.wav").write_bytes(b"RIFF")
    second = {"role": "listener", "utterance": "yes", "audio": "a.wav"}
    h = load_history(_write(tmp_path / "h.json", [ok, second]))
    assert h[1]["audio"] == str(tmp_path / "a.wav") and h[0]["video"] is None  # relative to the file
    cases = [
        ("{not json", "h1.json: invalid JSON"),
        ({"role": "speaker"}, "h2.json: expected a JSON list"),
        ([ok, {"role": "assistant", "utterance": "x"}], r"h3.json: entry 1: role must be one of"),
        ([{"role": "speaker", "utterance": 3}], "h4.json: entry 0: utterance must be a string"),
        ([ok, ok, {"role": "speaker", "utterance": "x", "wav": "a.wav"}],
         r"h5.json: entry 2: unknown key\(s\) \['wav'\]"),
    ]
    for i, (content, message) in enumerate(cases, 1):
        with pytest.raises(ValueError, match=message):
            load_history(_write(tmp_path / f"h{i}.json", content))
    with pytest.raises(FileNotFoundError, match=r"h6.json: entry 1: video file .*missing.mp4 does not exist"):
        load_history(_write(tmp_path / "h6.json", [ok, {"role": "speaker", "utterance": "x",
                                                             "video": "missing.mp4"}]))
    with pytest.raises(FileNotFoundError, match="history file .*nothere.json does not exist"):
        load_history(tmp_path / "nothere.json")


def test_missing_or_unreadable_media_is_named(model, tok, tmp_path, media):
    with pytest.raises(FileNotFoundError, match=r"audio file .*nope\.wav does not exist"):
        chat.respond(model, tok, text="hello", audio=tmp_path / "nope.wav")
    bad = tmp_path / "bad.wav"
    bad.write_text("not a wav")
    with pytest.raises(ValueError, match=r"cannot read audio file .*bad\.wav"):
        chat.respond(model, tok, text="hello", audio=bad, video=media / "diatest1utt2_7.mp4")


SPOKEN = "I lost my job today and I really do not know what to do next."


def test_audio_only_turn_is_transcribed_into_the_prompt(model, tok, tmp_path, media):
    """The latest utterance as speech alone (Kokoro's gold voice of SPOKEN, no text): Whisper tiny.en's
    transcript becomes its text, word for word (WER < 0.15), in the prompt the model reads, next to the
    utterance's <Aud> <Vid>; OUT.json records it with its confidence."""
    import soundfile as sf

    from empatheia_jax.data import templates as tpl
    from empatheia_jax.data.encoders import asr
    from empatheia_jax.generators.kokoro import SAMPLE_RATE
    from empatheia_jax.generators.kokoro_voices import gold_speech

    wav = tmp_path / "spoken.wav"
    sf.write(wav, gold_speech(SPOKEN, {"age": "young", "gender": "female", "timbre": "mid"}, "empathetic")[0],
             SAMPLE_RATE)
    result = chat.respond(model, tok, text="", audio=wav, video=media / "diatest1utt2_7.mp4",
                          history=_history(media), encoder="lite", decoding=Decoding(max_new_tokens=3),
                          compiler_options=FAST)
    [heard] = result.input_transcripts
    assert heard["utterance_index"] == 2 and 0.0 < heard["confidence"] <= 1.0
    assert asr.word_error_rate([SPOKEN], [heard["transcript"]]) < 0.15, heard
    prompt = tok.decode(result.input_ids[: result.prompt_length])
    assert f"  Speaker:{tpl.clean_text(heard['transcript'])}<Aud> <Vid>.\n}}" in prompt, prompt
    assert "Listener:test1 line 1: Oh no, tell me more." in prompt  # the typed history is untouched
    first_line = format_result(result).splitlines()[0]
    assert first_line.startswith(f"heard (Whisper tiny.en, utterance 2): {heard['transcript']!r}")
    _, js = write_outputs(result, tmp_path / "out")
    assert json.loads(js.read_text())["input_transcripts"] == [heard]


def test_an_utterance_without_text_or_audio_is_refused_by_name(model, tok, media):
    video = media / "diatest1utt2_7.mp4"
    with pytest.raises(ChatInputError, match=r"^the latest utterance \(--text/--audio/--video\) has no "
                       r"text and no audio to transcribe"):
        chat.respond(model, tok, text="  ", video=video, encoder="lite", decoding=Decoding(max_new_tokens=2))
    silent = [_history(media)[0], {"role": "listener", "utterance": "", "video": str(video)}]
    with pytest.raises(ChatInputError, match=r"^history: entry 1 has no text and no audio"):
        chat.respond(model, tok, text="hello", history=silent, encoder="lite",
                     decoding=Decoding(max_new_tokens=2))


def test_encoder_from_manifest_rebuilds_the_shards_encoder(shards):
    enc = encoder_from_manifest(shards)
    manifest = json.loads((shards / "manifest.json").read_text())
    assert enc.name == "lite" and enc.config() == manifest["encoder"]["config"]
    feats = manifest["features"]
    assert (enc.audio_dim, enc.video_dim) == (feats["audio_dim"], feats["video_dim"])
    entry = {"name": "lite", "config": dict(manifest["encoder"]["config"], n_mels=20, audio_dim=56)}
    assert encoder_from_manifest(entry).audio_dim == 56  # constructor arguments come from the config
    tampered = {"name": "lite", "config": dict(manifest["encoder"]["config"], version=99)}
    with pytest.raises(ValueError, match="differs .* in \\['version'\\]"):
        encoder_from_manifest(tampered)


def test_unit_aligned_video_block_runs_after_the_reply_is_timed_by_its_speech(tmp_path_factory, shards,
                                                                             media):
    """With cv_units the video block reads the frame units of the reply's own content units laid on the
    durations Kokoro speaks the predicted rows with (predicted S^s, speed 1: the bridge's voice): as many
    frames as that audio lasts, and C^v equals a teacher-forced forward given exactly those units."""
    from empatheia_jax.generators import face_render
    from empatheia_jax.generators.kokoro_speech import KokoroSpeech

    tok = load_smollm2_tokenizer(tmp_path_factory)  # a fresh one: from_llm extends it in place
    model = tiny_empatheia(tok, shards, cv_units=KokoroSpeech.num_units)
    r = chat.respond(model, tok, text="test1 line 2: I feel disgusted", audio=media / "diatest1utt2_7.wav",
                     video=media / "diatest1utt2_7.mp4", history=_history(media), encoder="lite",
                     decoding=Decoding(max_new_tokens=5), compiler_options=FAST, speech_targets="kokoro",
                     video_targets="face_render")
    rows = min(r.speech_content_units, ROWS)
    assert rows >= 3, r.reply
    speaker = KokoroSpeech()
    content, style = r.features["speech_content"], r.features["speech_style"]
    frames = speaker.frame_units(content, style, rows, 1.0, KokoroSpeech.content_units(r.reply)[:rows])
    audio = speaker.speak(content, style, rows, 1.0)
    assert len(frames) == face_render.frame_count(len(audio), speaker.sample_rate)
    assert any("video rows timed by" in n for n in r.notes)
    # the reference: the whole forward with those frame units in the batch
    enc = get_encoder("lite")
    files = ["diatest1utt0_7", "diatest1utt2_7"]
    aud = np.concatenate([enc.encode_audio(media / f"{f}.wav") for f in files])
    vid = np.concatenate([enc.encode_video(media / f"{f}.mp4") for f in files])
    n, length = len(r.input_ids), 256
    batch = {"input_ids": np.zeros((1, length), np.int32), "attention_mask": np.zeros((1, length), np.int32),
             "response_mask": np.zeros((1, length), np.int32),
             "positions": np.arange(length, dtype=np.int32)[None], "aud_feats": aud[None],
             "aud_mask": np.ones((1, len(aud)), np.int32), "vid_feats": vid[None],
             "vid_mask": np.ones((1, len(vid)), np.int32), "video_units": np.zeros((1, ROWS), np.int32)}
    batch["input_ids"][0, :n], batch["attention_mask"][0, :n] = r.input_ids, 1
    batch["response_mask"][0, :n] = r.response_mask
    batch["video_units"][0, : min(len(frames), ROWS)] = frames[:ROWS]
    graphdef, state = nnx.split(model)
    ref = _teacher_forced(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()})
    np.testing.assert_allclose(r.features["video_content"], np.asarray(ref["video_content"][0]), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(r.features["speech_content"], np.asarray(ref["speech_content"][0]),
                               rtol=1e-4, atol=1e-5)
    # other frame units give another C^v: the block reads them
    batch["video_units"][0, :] = 0
    other = _teacher_forced(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()})
    assert np.abs(np.asarray(other["video_content"][0]) - r.features["video_content"]).max() > 1e-3


def test_warm_up_compiles_every_program_a_text_turn_needs(model, tok, tmp_path):
    """After `Replier.warm_up` (what `empatheia serve` runs at start), text turns of any prompt length
    within the budget, short or after a long history, compile nothing; the warm-up itself did compile."""
    from jax._src import dispatch

    from empatheia_jax.serve import turn
    from empatheia_jax.serve.generation import bucket

    compiles = []

    def count(event, duration, **kwargs):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        replier = turn.Replier(model=model, tokenizer=tok, max_len=200, encoder=get_encoder("lite"),
                               compiler_options=FAST)
        warmed = replier.warm_up(Decoding(max_new_tokens=5))
        assert warmed[-1] == bucket(200) and warmed == sorted(warmed) and len(warmed) >= 2, warmed
        assert compiles, "the warm-up compiled nothing: the counter does not see compiles"
        compiles.clear()
        long_history = [{"role": "speaker" if i % 2 == 0 else "listener",
                         "utterance": f"line {i}: I keep thinking about what happened at work today."}
                        for i in range(8)]
        lengths = []
        for i, history in enumerate(([], long_history[:3], long_history)):
            done = turn.run_turn(replier, text="I lost my keys again.", history=history,
                                 out=tmp_path / f"t{i}", decoding=Decoding(max_new_tokens=5))
            lengths.append(done.result.prompt_length)
        assert len({bucket(n) for n in lengths}) >= 2, (lengths, warmed)  # more than one prompt bucket
        assert compiles == [], f"{len(compiles)} compile(s) during turns of prompt lengths {lengths}"
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


def test_reply_sampling_keeps_the_consensus_drawn_after_the_greedy_coe(model, tok, media, monkeypatch):
    """`respond(decoding=Decoding(reply_sampling=))`: the greedy CoE (rigged) is kept through its step-5
    header and the reply is the consensus of the drawn candidates (rigged: the last one agrees most with the
    others), drawn from prompt + header with the turn's media spliced exactly as the greedy prompt had
    them."""
    from empatheia_jax.data import templates as tpl
    from empatheia_jax.serve import generation, reply_choice

    coe = tpl.format_coe({"event_scenario": "a bad smell", "speaker_emotion": "disgusted"}, "oh no")
    drafts = ["Oh no.", "So sorry, what did you smell?", "Oh no, I am so sorry, what did you smell there?"]
    calls = []

    def rigged(rows, pad):
        width = max(len(r) for r in rows)
        new = np.array([r + [pad] * (width - len(r)) for r in rows], np.int32)
        return new, np.array([len(r) for r in rows])

    def greedy(llm, prompts, max_new_tokens, temperature=0.0, top_p=1.0, **kw):
        calls.append(("greedy", prompts, kw["inputs_embeds"]))
        ids, mask = generation.left_pad(prompts, kw["pad_token_id"])
        new, n = rigged([tok(coe + tok.eos_token, add_special_tokens=False)["input_ids"]], kw["pad_token_id"])
        return generation.Generation(np.concatenate([ids, new], 1), np.concatenate([mask, new > -1], 1),
                                     ids.shape[1], n)

    def drawn(llm, prompts, max_new_tokens, temperature=0.0, top_p=1.0, **kw):
        calls.append(("drawn", prompts, kw["inputs_embeds"]))
        k = kw["num_samples"]
        ids, mask = generation.left_pad(prompts, kw["pad_token_id"])
        new, n = rigged([tok(d + tok.eos_token, add_special_tokens=False)["input_ids"] for d in drafts],
                        kw["pad_token_id"])
        return generation.Generation(np.concatenate([np.repeat(ids, k, 0), new], 1),
                                     np.concatenate([np.repeat(mask, k, 0), new > -1], 1), ids.shape[1], n)

    monkeypatch.setattr(chat, "generate_tokens", greedy)
    monkeypatch.setattr(reply_choice, "generate_tokens", drawn)
    r = chat.respond(model, tok, text="test1 line 2: I feel disgusted", audio=media / "diatest1utt2_7.wav",
                     video=media / "diatest1utt2_7.mp4", history=_history(media), encoder="lite",
                     compiler_options=FAST,
                     decoding=Decoding(max_new_tokens=64,
                                       reply_sampling=ReplySampling(temperature=1.0, candidates=3)))
    assert r.reply == drafts[2]
    assert r.coe["event_scenario"] == "a bad smell" and r.emotion_text == "disgusted"
    (_, prompts, g_embeds), (_, prefixes, d_embeds) = calls
    prompt, prefix = prompts[0], prefixes[0]
    header = tok(coe[: tpl.response_header_end(coe)], add_special_tokens=False)["input_ids"]
    assert prefix[: len(prompt)] == prompt and tok.decode(prefix[len(prompt):]) == tok.decode(header)
    # The prompt's embeddings, media spliced, are the same in both calls (each left-padded to its bucket).
    p, q = np.asarray(g_embeds)[0], np.asarray(d_embeds)[0]
    start = q.shape[0] - len(prefix)
    np.testing.assert_allclose(q[start : start + len(prompt)], p[p.shape[0] - len(prompt):], atol=1e-6)
