"""The committed reference model (`empatheia_jax/resources/reference`): it loads over the converted SmolLM2,
and `empatheia eval` re-measures the figures its card records for the first 16 ED dev records.

The dev part is rebuilt here exactly as `launch/ed_reference.py` builds it (the shipped ED csv, the
card's conversation-level hold-out, text-only shards), and the eval runs with the script's flags in a
process without the suite's XLA flags: optimisation level 0 changes float bits, and on 16 records one flipped
greedy choice is 6.25 points. The card's `ci_subset` figures must come back within 1 point, i.e. exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, smollm2_checkpoint

from empatheia_jax import reference

CSV = REPO / "data" / "ed" / "empathetic_dialogues_validation.csv"
SUBSET = 16  # launch/ed_reference.py CI_SUBSET: 203 s alone on a 2-core Zen 3 (32: 488 s inside the suite)


@pytest.fixture(scope="module")
def card() -> dict:
    return reference.card()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return env


def _run(*args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", *args], env=_env(), cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_the_card_describes_these_weights(card):
    meta = json.loads((reference.path() / "empatheia_config.json").read_text())
    assert card["model"]["step"] == meta["step"] and meta["stored_dtype"] == "bfloat16"
    assert card["ci_subset"]["max_examples"] == SUBSET and card["eval"]["metrics"]["num_examples"] > 800
    assert any("CC BY-NC" in line for line in card["license"])


def test_the_card_names_the_sha256_of_every_weight_file(card):
    """The card's figures describe exactly these bytes: every *.safetensors of the export, none missing or
    added, with the sha256 card.json records."""
    from empatheia_jax.eval.model_card import weight_digests

    got = weight_digests(reference.path())
    assert set(got) == {"adapter_model.safetensors", "heads.safetensors", "emotion_head.safetensors"}
    assert card["weights"] == got


def test_it_scores_its_card_on_the_first_16_dev_records(card, tmp_path):
    # The dev part as launch/ed_reference.py makes it (its --holdout default), then its subset eval.
    _run("data.import_ed", "--csv", str(CSV), "--out", str(tmp_path / "raw"), "--split", "train",
         "--holdout", "dev:0.15")
    _run("data.prepare", "--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "shards"), "--text-only")
    out = tmp_path / "subset.json"
    _run("empatheia_jax.cli", "eval", "--ckpt", str(reference.path()), "--backbone",
         str(smollm2_checkpoint()), "--data", str(tmp_path / "shards"), "--split", "dev", "--template", "coe",
         "--max_examples", str(SUBSET), "--no_repeat_ngram_size", "4", "--score_emotions", "--json", str(out))
    got, want = json.loads(out.read_text())["trained"], card["ci_subset"]["metrics"]
    assert got["num_examples"] == want["num_examples"] == SUBSET
    # the free and scored step 2, the emotion head alone and its combination with them (the card's headline)
    for key in ("emotion32_acc_scored", "emotion_acc_scored", "emotion32_acc_text", "emotion_acc_text",
                "emotion32_acc_head", "emotion_acc_head", "emotion32_acc_combined", "emotion_acc_combined"):
        assert abs(got[key] - want[key]) <= 0.01, (key, got[key], want[key])
    assert abs(got["eval_loss"] - want["eval_loss"]) < 1e-3
    assert got["repetition_rate"] <= want["repetition_rate"] + 0.02


# A reply the avatar must say so that a person understands it: read as written (`written=`, the way
# training's teacher forcing reads the gold reply), voiced by the model's own CS through Kokoro, in a pinned
# avatar and in the SD's own predicted style S^s, and heard by a recogniser we did not write. The committed
# reference before the ED-trained CS was heard as "Thank you so much for watching, ..." (WER 1.27). The
# unpinned run is what shows the SD's part: spoken in a zero, random or 3x-scaled style instead, the same
# rows are heard at WER 0.87-5.9. (No control here zeroes the LLM's states: the committed CS speech block's
# cross-attention to r^t has a zero output projection, so its rows come from the reply's units alone and
# zeroing r^t gives bit-identical audio; zeroing r^s moves S^s by 1.6 % and Whisper still hears WER 0.)
SPEAKER = "My dog got really sick last week and I had to take him to the vet at night."
REPLY = "Oh no, I am so sorry to hear that. Is he feeling any better now?"
WER_GOAL = 0.15  # issue 29's goal for spoken replies; gold Kokoro speech of sample replies: 0.00-0.11


def test_its_avatar_says_a_reply_that_whisper_hears(tmp_path):
    from empatheia_jax.data import templates
    from empatheia_jax.serve import turn
    from empatheia_jax.serve.avatar import parse_listener

    model, tokenizer, config, meta = reference.load(smollm2_checkpoint())
    replier = turn.replier_from_loaded(model, tokenizer, config, meta, "the reference model")
    coe = templates.format_coe({"event": "the speaker's dog got sick", "emotion": "anxious"}, REPLY)
    for name, listener in (("pinned", parse_listener("young,female,mid")), ("predicted", None)):
        done = turn.run_turn(replier, text=SPEAKER, out=tmp_path / name, render="speech", hear=True,
                             listener=listener, written=coe)
        assert done.result.reply == REPLY
        assert done.heard["speech_wer"] < WER_GOAL, (name, done.heard)
        pinned = [n for n in done.speech_notes if "pinned" in n]
        assert bool(pinned) == (listener is not None), (name, done.speech_notes)
