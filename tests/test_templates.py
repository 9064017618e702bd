"""D.1 templates, CoE target text and parser, added tokens. Expected strings are written by hand."""


import pytest
from helpers import saved_smollm2_tokenizer

from empatheia_jax.data import templates as tpl

HIST = [
    {"index": 0, "role": "speaker", "utterance": "I paid all my bills today, I feel great!"},
    {
        "index": 1,
        "role": "listener",
        "utterance": "Every little accomplishment counts! What bills did you have to pay?",
    },
    {
        "index": 2,
        "role": "speaker",
        "utterance": (
            "Rent and electricity. We've been struggling financially so it's such a relief to pay bills."
        ),
    },
]
COE = {
    "event_scenario": "Paying off overdue rent and electricity bills amid financial struggles.",
    "speaker_emotion": "content",
    "emotion_cause": "Relief from the burden of financial stress after successfully paying bills.",
    "goal_to_response": "Providing support and validation for the speaker's sense of accomplishment.",
}
RESP = "Sorry to hear that. Well, at least this will be a weight off your shoulders."

COE_TEXT = (
    "Firstly, the event scenario of this conversation is: Paying off overdue rent and electricity bills "
    "amid financial struggles.\n\n"
    "Secondly, the emotion of the speaker is: content\n\n"
    "Thirdly, the emotion cause is: Relief from the burden of financial stress after successfully paying "
    "bills.\n\n"
    "Fourthly, the goal to response is: Providing support and validation for the speaker's sense of "
    "accomplishment.\n\n"
    "Finally, the response is: Sorry to hear that. Well, at least this will be a weight off your shoulders."
)
SIGNALS = "".join(f"<AUD{i}>" for i in range(1, 17)) + "".join(f"<VID{i}>" for i in range(1, 17))


def test_stage1_prompt_exact():
    expected = (
        "Provide an empathetic response based on the given dialogue context below. Don't rush to give the "
        "response, thinking step by step.\n"
        "\n"
        "Dialogue Context:\n"
        "{\n"
        "  Speaker:I paid all my bills today, I feel great!\n"
        "  Listener:Every little accomplishment counts! What bills did you have to pay?\n"
        "  Speaker:Rent and electricity. We've been struggling financially so it's such a relief to pay "
        "bills.\n"
        "}"
    )
    assert tpl.format_prompt(HIST, tpl.TemplateSpec("coe")) == expected
    assert tpl.format_prompt(HIST, tpl.TemplateSpec("ccl")) == expected


def test_stage3_and_stage4_prompts_exact():
    sac = (
        "Provide a multimodal empathetic response based on the given dialogue context below.\n\n"
        "Dialogue Context:\n{\n"
        "  Speaker:<Aud> <Vid>.\n"
        "  Listener:<Aud> <Vid>.\n"
        "  Speaker:<Aud> <Vid>.\n"
        "}"
    )
    assert tpl.format_prompt(HIST, tpl.TemplateSpec("sac")) == sac
    overall = (
        "Provide a multimodal empathetic response based on the given dialogue context below. Don't rush to "
        "give the response, thinking step by step.\n\n"
        "Dialogue Context:\n{\n"
        "  Speaker:I paid all my bills today, I feel great!<Aud> <Vid>.\n"
        "  Listener:Every little accomplishment counts! What bills did you have to pay?<Aud> <Vid>.\n"
        "  Speaker:Rent and electricity. We've been struggling financially so it's such a relief to pay "
        "bills.<Aud> <Vid>.\n"
        "}"
    )
    assert tpl.format_prompt(HIST, tpl.TemplateSpec("overall")) == overall
    # k vectors per placeholder -> k consecutive placeholder tokens
    line = tpl.history_line("listener", "ok", tpl.TemplateSpec("overall"), k_aud=2, k_vid=3)
    assert line == "  Listener:ok<Aud><Aud> <Vid><Vid><Vid>.\n"
    # "w/o speech & video input" ablation of stage 4: no placeholders
    no_media = tpl.format_prompt(HIST[:1], tpl.TemplateSpec("overall", media_input=False))
    assert no_media.endswith("  Speaker:I paid all my bills today, I feel great!\n}")


def test_text_is_cleaned_into_one_line():
    hist = [{"role": "speaker", "utterance": "  two\nlines <Aud> and <VID3>  here "}]
    assert tpl.format_prompt(hist, tpl.TemplateSpec("coe")).endswith("  Speaker:two lines and here\n}")
    assert tpl.clean_text("a <|im_end|> b", ["<|im_end|>"]) == "a b"
    with pytest.raises(ValueError, match="unknown dialogue role"):
        tpl.role_label("assistant")


def test_targets_exact():
    assert tpl.format_coe(COE, RESP) == COE_TEXT
    t1 = tpl.format_target(tpl.TemplateSpec("coe"), coe=COE, response=RESP)
    assert t1.text == COE_TEXT
    assert t1.text[slice(*t1.response_span)] == RESP
    t3 = tpl.format_target(tpl.TemplateSpec("sac"), coe=COE, response=RESP)
    assert t3 == tpl.Target(SIGNALS, None)
    t4 = tpl.format_target(tpl.TemplateSpec("overall"), coe=COE, response=RESP)
    assert t4.text == COE_TEXT + "\n" + SIGNALS
    assert t4.text[slice(*t4.response_span)] == RESP
    wo = tpl.format_target(tpl.TemplateSpec("overall", use_coe=False), coe=COE, response=RESP)
    assert wo.text == RESP + "\n" + SIGNALS and wo.response_span == (0, len(RESP))
    assert tpl.format_target(tpl.TemplateSpec("coe", use_coe=False), coe=COE, response=RESP).text == RESP
    assert tpl.TemplateSpec("coe", use_coe=False).instruction() == (
        "Provide an empathetic response based on the given dialogue context below."
    )
    pb = tpl.format_target(
        tpl.TemplateSpec("overall", pipeline_baseline=True),
        coe=COE,
        response=RESP,
        listener_profile={"age": "elderly", "gender": "female", "timbre": "low", "ID": 3},
    )
    assert pb.text == f"Emotion: content\nProfile: elderly, female, low\nResponse: {RESP}"
    assert pb.text[slice(*pb.response_span)] == RESP
    assert tpl.TemplateSpec("overall", n_signal=2).has_signal
    assert tpl.format_target(tpl.TemplateSpec("sac", n_signal=2)).text == "<AUD1><AUD2><VID1><VID2>"


def test_empty_coe_steps_are_omitted_with_their_ordinals_kept():
    coe = dict(COE, emotion_cause="", goal_to_response="  ")
    text = tpl.format_coe(coe, RESP)
    assert text == (
        "Firstly, the event scenario of this conversation is: Paying off overdue rent and electricity bills "
        "amid financial struggles.\n\n"
        "Secondly, the emotion of the speaker is: content\n\n"
        "Finally, the response is: Sorry to hear that. Well, at least this will be a weight off your "
        "shoulders."
    )
    assert "Thirdly" not in text and "Fourthly" not in text
    span = tpl.format_target(tpl.TemplateSpec("coe"), coe=coe, response=RESP).response_span
    assert text[slice(*span)] == RESP


@pytest.mark.parametrize(
    "coe",
    [
        COE,
        dict(COE, emotion_cause="", goal_to_response=""),
        {"event_scenario": "", "speaker_emotion": "sad", "emotion_cause": "", "goal_to_response": "x: y"},
        {k: "" for k in COE},
    ],
)
def test_parse_coe_round_trips_format_coe(coe):
    parsed = tpl.parse_coe(tpl.format_coe(coe, RESP))
    assert parsed == {**{k: v.strip() for k, v in coe.items()}, "response": RESP}
    # the stage-4 form with signal tokens and eos parses the same
    t4 = tpl.format_target(tpl.TemplateSpec("overall"), coe=coe, response=RESP).text
    assert tpl.parse_coe(t4 + "<|im_end|>") == parsed


def test_parse_coe_tolerates_generation_noise():
    noisy = (
        "firstly the event scenario of this conversation is Losing a job.\n"
        "SECONDLY, The emotion of the speaker is:sad<AUD3>\n\n"
        "Fourthly, the goal to response is:Comfort them, since the response is what matters.\n"
        "Finally, the response is:  I'm so sorry.  <AUD1><AUD2><VID1></s> trailing junk"
    )
    out = tpl.parse_coe(noisy)
    assert out == {
        "event_scenario": "Losing a job.",
        "speaker_emotion": "sad",
        "emotion_cause": "",
        "goal_to_response": "Comfort them, since the response is what matters.",
        "response": "I'm so sorry.",
    }
    # no headers at all: the bare response of the w/o-CoE ablation
    assert tpl.parse_coe("Hang in there!<AUD1>")["response"] == "Hang in there!"
    assert tpl.parse_coe("Firstly, the event scenario of this conversation is: x")["response"] == ""


def test_parse_pipeline_output_and_strip_signal_tokens():
    pb = tpl.format_target(
        tpl.TemplateSpec("coe", pipeline_baseline=True),
        coe=COE,
        response=RESP,
        listener_profile={"age": "young", "gender": "male", "timbre": "mid"},
    ).text
    assert tpl.parse_pipeline_output(pb + "<|im_end|>") == {
        "emotion": "content",
        "age": "young",
        "gender": "male",
        "timbre": "mid",
        "response": RESP,
    }
    assert tpl.strip_signal_tokens("hi <AUD1><aud16><VID2> <Aud> <Vid>") == "hi"


def test_added_tokens_order():
    toks = tpl.added_tokens(16)
    assert toks[:4] == ["<Aud>", "<Vid>", "<AUD1>", "<AUD2>"]
    assert toks[17] == "<AUD16>" and toks[18] == "<VID1>" and toks[-1] == "<VID16>"
    assert len(toks) == 34 and len(tpl.added_tokens(4)) == 10


def test_chat_formats_without_tokenizer():
    assert tpl.format_chat("P", kind="plain") == "P\n"
    v = tpl.chat_format(None, "auto")
    assert v.name == "vicuna" and v.wrap("P").endswith("USER: P ASSISTANT:") and v.target_prefix == " "
    with pytest.raises(ValueError):
        tpl.chat_format(None, "chat_template")


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory):
    return saved_smollm2_tokenizer(tmp_path_factory)


def test_extend_tokenizer_idempotent_and_chat_wrap(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    n0 = len(tok)
    ids = tpl.extend_tokenizer(tok, 16)
    assert list(ids) == tpl.added_tokens(16)
    assert list(ids.values()) == list(range(n0, n0 + 34))
    assert tpl.extend_tokenizer(tok, 16) == ids and len(tok) == n0 + 34
    enc = tok("x<Aud> <Vid>.<AUD16><VID1>", add_special_tokens=False)["input_ids"]
    assert ids["<Aud>"] in enc and ids["<AUD16>"] in enc and ids["<VID1>"] in enc
    assert tpl.format_chat("PROMPT", tok) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nPROMPT<|im_end|>\n<|im_start|>assistant\n"
    )


def test_emotion_step_prefix_ends_where_the_step_2_word_begins():
    """Label scoring conditions on the generated text through the step-2 header; a generation that skipped
    step 2 gets the canonical header after its step 1; a bare reply has nothing to condition on."""
    full = tpl.format_coe({"event_scenario": "I lost my dog", "speaker_emotion": "sad"}, "So sorry.")
    head = "Firstly, the event scenario of this conversation is: I lost my dog\n\n" \
           "Secondly, the emotion of the speaker is:"
    assert tpl.emotion_step_prefix(full) == head
    assert tpl.emotion_step_prefix(full.replace("is: sad", "is sad")) == head[:-1]  # no colon: none added
    step_1 = "Firstly, the event scenario of this conversation is: I lost my dog"
    assert tpl.emotion_step_prefix(step_1 + "\n\nFinally, the response is: x") == head
    assert tpl.emotion_step_prefix(step_1) == head
    assert tpl.emotion_step_prefix("I am so sorry to hear that.") is None


def test_response_header_end_is_where_the_reply_begins():
    """Reply sampling keeps the generated text through the step-5 header: not the step-4 "goal to response"
    header, not "the response is" inside a sentence, nothing for a bare reply."""
    full = tpl.format_coe({"event_scenario": "I lost my dog", "speaker_emotion": "sad",
                           "goal_to_response": "comfort"}, "So sorry.")
    end = tpl.response_header_end(full)
    assert full[:end].endswith("Finally, the response is:") and full[end:].strip() == "So sorry."
    assert tpl.response_header_end(full.split("\n\nFinally")[0]) is None  # step 4 is not step 5
    assert tpl.response_header_end("I think the response is: wait and see") is None  # inside a sentence
    assert tpl.response_header_end("So sorry to hear that.") is None
