"""The real embedded model: SmolLM2-135M-Instruct from its GGUF, against transformers on the same weights.

The converted folder is cached across sessions (tests/helpers.py). So are transformers' reference outputs
(`refs-*.npz` next to it, keyed by the GGUF, the prompt and the torch/transformers versions): loading and
dequantizing the GGUF in torch is the slowest step here, and the reference cannot change unless one of
those keys does.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cache_root, gguf_key, gguf_path, smollm2_checkpoint

import empatheia_jax

DIALOGUE = [
    {"role": "user",
     "content": "I failed my driving test again today. Third time. I feel like such an idiot."},
]
LOGIT_TOKENS = 48
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = empatheia_jax.load_model(smollm2_checkpoint())
    return model, tokenizer


def _prompt(tokenizer) -> str:
    return tokenizer.apply_chat_template(DIALOGUE, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' fp32 logits on the first 48 prompt tokens and its 32-token greedy continuation."""
    import torch
    import transformers

    _, tokenizer = smollm2
    prompt = _prompt(tokenizer)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    key = hashlib.sha256(repr((gguf_key(), prompt, LOGIT_TOKENS, NEW_TOKENS, torch.__version__,
                               transformers.__version__)).encode()).hexdigest()[:16]
    path = cache_root() / f"refs-smollm2-{key}.npz"
    if not path.is_file():
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(gguf_path().parent), gguf_file=gguf_path().name,
                                                  dtype=torch.float32).eval()
        with torch.no_grad():
            logits = hf(torch.tensor([ids[:LOGIT_TOKENS]])).logits[0].numpy()
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, ids=np.asarray(ids), logits=logits, generated=out[0, len(ids):].numpy())
        tmp.rename(path)
    ref = np.load(path)
    assert ref["ids"].tolist() == ids
    return prompt, ref


def test_config_and_tokenizer(smollm2):
    model, tokenizer = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 1e5 and cfg.eos_token_id == 2
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.chat_template


def test_logits_match_transformers(smollm2, reference):
    model, _ = smollm2
    _, ref = reference
    assert len(ref["ids"]) >= LOGIT_TOKENS
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(model(jnp.asarray(ref["ids"][None, :LOGIT_TOKENS])))[0]
    assert ours.shape == ref["logits"].shape == (LOGIT_TOKENS, 49152)
    np.testing.assert_allclose(ours, ref["logits"], atol=1e-3, rtol=0)


def test_greedy_generate_matches_transformers(smollm2, reference):
    model, tokenizer = smollm2
    prompt, ref = reference
    ids = empatheia_jax.generate_ids(model, tokenizer, [prompt], max_new_tokens=NEW_TOKENS)[0]
    np.testing.assert_array_equal(ids, ref["generated"])
    text = empatheia_jax.generate(model, tokenizer, [prompt], max_new_tokens=NEW_TOKENS)[0]
    assert text == tokenizer.decode(ref["generated"], skip_special_tokens=True) and text.strip()


def test_every_tokenizer_loader_reads_the_converted_folder_quietly(smollm2):
    """The converted folder's config.json is ours, not an HF config: the training, pipeline and load_model
    paths (one loader, `templates.load_tokenizer`) all read its tokenizer without transformers parsing
    that file (which printed a rope_scaling FutureWarning into every demo stage)."""
    import warnings

    from empatheia_jax.data.templates import load_tokenizer

    folder = smollm2_checkpoint()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = [load_tokenizer(folder), load_tokenizer(str(folder)), empatheia_jax.load_model(folder)[1]]
    for tok in loaded:
        assert tok.get_vocab() == smollm2[1].get_vocab() and tok.chat_template == smollm2[1].chat_template


def test_the_direct_tokenizer_read_is_autotokenizers_and_imports_no_torch(tmp_path, monkeypatch):
    """`load_tokenizer` reads our own folders with transformers' generic class instead of AutoTokenizer
    (whose registry imports torch: seconds of every command). It must be the tokenizer AutoTokenizer gives:
    the same ids for text with special and added tokens, the same chat prompt, special ids and decoding. A
    folder with an HF model config still goes through AutoTokenizer."""
    import json
    import shutil
    import subprocess
    import sys

    from transformers import AutoTokenizer, PretrainedConfig

    from empatheia_jax.data.templates import extend_tokenizer, load_tokenizer

    saved = tmp_path / "saved"
    AutoTokenizer.from_pretrained(str(gguf_path().parent), gguf_file=gguf_path().name).save_pretrained(saved)
    texts = ["I lost my dog <Aud> <Vid>!\n<|im_start|>assistant", "naïve café 🤗  two  spaces\n\n",
             "[SPEECH_0]"]
    chat = [*DIALOGUE, {"role": "assistant", "content": "That sounds so frustrating."}]
    for folder in (saved, smollm2_checkpoint()):
        ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder, config=PretrainedConfig())
        assert type(ours) is type(auto)
        assert extend_tokenizer(ours) == extend_tokenizer(auto)
        assert [ours(t)["input_ids"] for t in texts] == [auto(t)["input_ids"] for t in texts]
        prompts = [t.apply_chat_template(chat, tokenize=False) for t in (ours, auto)]
        assert prompts[0] == prompts[1]
        specials = ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id")
        assert [getattr(ours, s) for s in specials] == [getattr(auto, s) for s in specials]
        ids = ours(texts[0])["input_ids"]
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)

    code = ("import sys; from empatheia_jax.data.templates import load_tokenizer; "
            f"load_tokenizer({str(saved)!r}); assert 'torch' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]

    # An HF model folder (its config.json may pick a model-specific class) goes through AutoTokenizer.
    hf_model = tmp_path / "hf_model"
    shutil.copytree(saved, hf_model)
    (hf_model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 49152}))
    read = []
    original = AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, path, **kw: read.append(path) or original(cls, path, **kw)))
    load_tokenizer(saved)
    assert read == []
    load_tokenizer(hf_model)
    assert read == [str(hf_model)]


def test_a_gguf_tokenizer_with_other_special_tokens_is_refused():
    """transformers 5.17 reads this GGUF with eos <|im_start|>: a model trained on that conversion learns
    another end token (docs/design.md "The GGUF tokenizer check"). The pinned transformers reads it right;
    a wrong eos is named."""
    from transformers import AutoTokenizer

    from empatheia_jax.weights.hf_names import ConversionError
    from empatheia_jax.weights.hf_to_flax import check_gguf_special_tokens

    path = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    check_gguf_special_tokens(path, tok)
    tok.eos_token = "<|im_start|>"
    with pytest.raises(ConversionError, match=r"eos_token '<\|im_start\|>' \(id 1\), the GGUF says id 2 "
                                              r"\('<\|im_end\|>'\)"):
        check_gguf_special_tokens(path, tok)
