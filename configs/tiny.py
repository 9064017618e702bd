"""A tiny random backbone for tests: 2 layers, d=32, fp32, one-layer VAEs; seconds per step on a CPU.

Needs `model.tokenizer` (a tokenizer folder, e.g. the SmolLM2 one; the vocabulary size follows it) and
`data.shards`.
"""

from __future__ import annotations

from configs import base


def get_config(arg: str | None = None):
    c = base.get_config()
    c.model.llm = {
        "vocab_size": 0,  # 0 = len(tokenizer)
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1024,
        "dtype": "float32",
        "param_dtype": "float32",
        "remat": "none",
    }
    c.model.lora.rank = 4
    c.model.lora.alpha = 8.0
    c.model.empatheia.update(
        {
            "n_signal": 4,
            "vae_d_model": 16,
            "vae_heads": 2,
            "vae_layers": 1,
            "cs_latent": 8,
            "sd_queries": 2,
            "sd_code_dim": 8,
            "sd_latent": 4,
            "fuse_dim": 16,
        }
    )
    c.data.max_len = 256
    c.data.max_aud = c.data.max_vid = 8
    c.data.max_speech_len = 16
    c.data.max_video_len = 16
    c.data.window_batches = 2
    c.train.batch_size = 8
    c.train.grad_accum = 1
    c.train.log_every = 1
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 2
    for s in c.schedule.values():
        s.steps = 6
    c.checkpoint.every = 2
    c.checkpoint.async_save = False
    return base.apply_arg(c, arg)
