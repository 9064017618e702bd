"""Every field a training run reads, at the paper's values (Table 9/10). Other configs start from this.

Usage (big_vision pattern): `empatheia train --config configs/X.py[:ARG] --config.stage=coe --workdir DIR`,
any field overridable as `--config.optim.lr=1e-4`. ARG is a comma-separated list of ablations (`no_coe`,
`no_media`, `no_cs`, `no_sd`) and/or `pipeline` (the paper's Pipeline baseline); see `apply_arg`.
The trainer validates the resolved config (`empatheia_jax.train.config.validate`) before anything compiles.
"""

from __future__ import annotations

import ml_collections

ABLATIONS = ("no_coe", "no_media", "no_cs", "no_sd")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.stage = "coe"  # coe | ccl | sac | overall | pipeline; ccl_units: the CS from its units alone (no LLM)
    c.ablations = ml_collections.ConfigDict({name: False for name in ABLATIONS})
    # A previous stage's workdir (its latest checkpoint) or one step folder of it; "" = the backbone.
    c.init_from = ""

    c.model = ml_collections.ConfigDict()
    c.model.backbone = ""  # converted folder (converters.hf_to_flax); "" = random init from model.llm
    c.model.tokenizer = ""  # "" = the backbone folder's tokenizer
    # LlamaConfig fields: a random backbone's whole config, or overrides (dtype, remat) of a converted one.
    # attention: auto (cuDNN flash on an NVIDIA GPU where it compiles, else our einsum:
    # models/attention_choice.py) | einsum (ours) | xla | cudnn (jax.nn.dot_product_attention's kernel forced)
    c.model.llm = ml_collections.ConfigDict(
        {"dtype": "bfloat16", "param_dtype": "float32", "remat": "none", "attention": "auto"}
    )
    # Precision of every float32 dot of the run (process-wide: jax_default_matmul_precision). "float32" is
    # true f32 everywhere (as torch's CUDA matmuls); jax's "default" is TF32 on NVIDIA GPUs and one bf16 pass
    # on TPU. Set by train and load_trained, so a run is served with the numerics it trained with (docs/
    # design.md "Matmul precision"). bf16 dots are unaffected: a bfloat16 model (model.llm.dtype) loses
    # no speed. XLA:CPU ignores it, so under "bfloat16" the backbone casts its dot operands itself.
    c.model.matmul_precision = "float32"
    c.model.lora = ml_collections.ConfigDict(
        {"rank": 16, "alpha": 32.0, "targets": ("q_proj", "k_proj", "v_proj", "o_proj")}
    )
    # EmpatheiaConfig scalars (audio/video dims come from the shards' manifest, target shapes from data).
    c.model.empatheia = ml_collections.ConfigDict(
        {
            "n_signal": 16,
            "vae_d_model": 256,
            "vae_heads": 4,
            "vae_layers": 4,
            "cs_latent": 64,
            "sd_queries": 4,
            "sd_code_dim": 64,
            "sd_latent": 32,
            "vae_dropout": 0.0,
            "vae_logvar_init": -4.0,
            "fuse_dim": 256,
            # content-unit alignment of the CS's speech rows: the unit table size (Kokoro: 178 phoneme
            # token ids), 0 = the paper's position-only queries (docs/design.md "Aligned Content
            # Synchronizer")
            "cs_units": 0,
            # the same for the CS's video rows (25-fps frames): each frame's unit on its clip's Kokoro
            # timeline (targets kind video_units, from face_targets --mouth phonemes); 0 = position-only
            "cv_units": 0,
            # the leading dims of a video content row the face generator reads; the CS's video rows are 0
            # beyond them (the embedded generator: 2 of 256, face_render.CONTENT_USED); 0 = every dim
            "cv_dims": 0,
            # width of a depthwise row convolution in every CS layer, 0 = none (the paper's block)
            "cs_conv": 0,
            # read each unit-aligned CS block's units in context (convolutions + a BiLSTM, Kokoro's text
            # encoder shape) instead of one table row per unit (models/unit_context.py)
            "cs_unit_context": False,
            # the speech block's unit reader width (0 = vae_d_model): Kokoro's text encoder reads at 512
            "cs_context_width": 0,
            # the speech block's reader also reaches its output rows directly (VAEConfig.context_skip)
            "cs_context_skip": False,
            # positions per chunk of the token loss's logits (0: all at once): memory for one more
            # output projection a step (models/llama.py `token_nll`, docs/benchmarks.md "chunked")
            "ce_chunk": 0,
            # target-only logits: the token loss projects only its loss positions, at most ce_targets per
            # row of a micro-batch on average (a batch with more projects every position: exact either
            # way); 0 = every position (models/llama.py `target_nll`, docs/design.md "Target-only logits")
            "ce_targets": 0,
        }
    )

    c.data = ml_collections.ConfigDict()
    c.data.shards = ""  # data.prepare output folder
    c.data.train_split = "train"
    c.data.eval_split = "valid"
    c.data.max_len = 1024
    c.data.max_aud = 32
    c.data.max_vid = 32
    c.data.max_speech_len = 256
    c.data.max_video_len = 256
    c.data.window_batches = 8
    # the sequence lengths a batch is padded to: 0 = 128, 256, 512, ... up to max_len; N > 0 = every multiple
    # of N up to max_len (less padding, one compile per length used; ED batches: 68 % real tokens with the
    # default, 87 % with 32, docs/benchmarks.md "The coe step on the CPU")
    c.data.bucket_step = 0
    # sequence packing of the text stages (coe, pipeline): each step's examples are packed into rows of
    # pack_len tokens (>= max_len), turns kept apart by segment-aware attention; 0 = one example per row
    # (docs/design.md "Sequence packing")
    c.data.pack_len = 0
    c.data.worker_count = 0
    c.data.read_threads = 1
    # text-only shards (stage coe on EmpatheticDialogues): the shards whose features/targets the model is
    # built for, so that the later stages (on media shards) can init_from this run
    c.data.features_like = ""

    c.train = ml_collections.ConfigDict()
    c.train.batch_size = 32  # global examples per optimizer step
    c.train.grad_accum = 8  # micro-batches per step, scanned inside the jitted step (micro-batch = 32/8 = 4)
    c.train.log_every = 10
    c.train.eval_every = 0  # 0 = only at the end
    c.train.eval_batches = 0  # 0 = the whole eval split
    # Unshuffled train batches whose signal states set the SD input standardisation and feed the SD warm-up.
    c.train.calibration_batches = 16
    c.train.sd_warmup_batch_size = 32  # examples per SD warm-up step (cached states: cheap)
    c.train.nan_policy = (
        "skip"  # skip (count, keep the params) | stop (checkpoint the last good state, exit 1)
    )
    c.train.max_consecutive_nonfinite = (
        20  # skip policy: give up (checkpoint, exit 1) after this many in a row
    )
    c.train.profile_steps = ()  # e.g. (10, 15): jax.profiler trace of steps [10, 15) into WORKDIR/profile
    c.train.trace_data = (
        False  # append each step's record indices to WORKDIR/data_trace.jsonl (audits resume)
    )

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 5e-5
    c.optim.warmup_steps = 100
    c.optim.end_lr_ratio = 0.0  # cosine decays to lr * end_lr_ratio at the last step
    c.optim.weight_decay = 1e-3
    c.optim.clip_norm = 1.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    # > 0: an exponential moving average of the trained parameters (train/ema.py, decay warmed up as
    # min(ema_decay, (1+t)/(10+t))); the run's evaluation, its checkpoints' `ema` item and so export, eval,
    # chat and the next stage's init_from use the average. 0 = off.
    c.optim.ema_decay = 0.0

    # ccl_scale: "none" = eq 9 (every content dimension weighs 1), "balanced" = each dimension an equal share
    # of the mean predictor's loss, from the train targets' spread (losses.balanced_dim_weights)
    c.loss = ml_collections.ConfigDict({"alpha": 0.2, "beta": 0.3, "kl": 1e-3, "ccl_scale": "none"})

    # Per-stage schedule, picked by `stage`: steps and (optionally) lr / warmup; lr 0 / warmup -1 =
    # optim.lr / optim.warmup_steps. sd_warmup_steps: SD-only steps on the cached signal states of the
    # calibration batches before the stage's first step (stages that train the SD; sd_warmup.warmup_sd), at
    # sd_warmup_lr (0 = the stage's lr). The paper has no warm-up: 0.
    c.schedule = ml_collections.ConfigDict(
        {
            name: {"steps": 1000, "lr": 0.0, "warmup_steps": -1, "sd_warmup_steps": 0, "sd_warmup_lr": 0.0}
            for name in ("coe", "ccl", "ccl_units", "sac", "overall", "pipeline")
        }
    )

    c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})  # -1: the remaining devices

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 200
    c.checkpoint.keep = 3
    c.checkpoint.keep_best = False
    c.checkpoint.best_metric = "eval/total"
    c.checkpoint.best_mode = "min"
    c.checkpoint.async_save = True

    c.distributed = ml_collections.ConfigDict()
    c.distributed.initialize = False  # True: jax.distributed.initialize (auto-detects TPU pods / SLURM)
    c.distributed.coordinator_address = ""  # explicit values for a manual launch (e.g. localhost:1234)
    c.distributed.num_processes = 0
    c.distributed.process_id = -1
    c.distributed.cpu_collectives = ""  # "gloo" for multi-process CPU runs

    return apply_arg(c, arg)


def apply_arg(c: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
    """`file.py:no_cs,no_sd` turns ablations on; `pipeline` selects the Pipeline baseline stage."""
    for token in filter(None, (t.strip() for t in (arg or "").split(","))):
        if token in ABLATIONS:
            c.ablations[token] = True
        elif token == "pipeline":
            c.stage = "pipeline"
        else:
            raise ValueError(f"config argument {token!r}: expected one of {ABLATIONS + ('pipeline',)}")
    return c
