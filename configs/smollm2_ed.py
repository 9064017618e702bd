"""The reference model's first stage: SmolLM2-135M-Instruct learns the Chain of Empathy on real dialogue.

Stage coe on EmpatheticDialogues (the shipped validation csv, imported with a conversation-level dev
hold-out and prepared text-only; launch/ed_reference.py builds it), so that the emotion of CoE step 2 is
learnt from 4.7k real listener turns instead of the sample's few hundred. The model is the demo's
(`configs/smollm2_demo.py`: same backbone, LoRA and demo-sized VAEs, feature dims from the sample's shards
via data.features_like), so the later stages run on the sample with `configs/smollm2_demo.py` and
`init_from` this run, and `make demo` can chat with the result.

Schedule, picked on the dev part only (docs/benchmarks.md): batch 8, lr 2e-4 with cosine decay over 1,500
steps (the dev loss is flat after ~1,400 steps), dev loss every 200 steps, the best-dev-loss
checkpoint kept beside the latest. (The reference run ran 800 steps of a 3,000-step cosine, then
resumed with this 1,500: docs/design.md "The reference model".) Float32 weights and activations on CPU,
with bfloat16 dot operands (below); on an accelerator set `--config.model.llm.dtype=bfloat16`.
Checkpoints every 100 steps (~5-6 minutes on 2 CPU cores: 3.0-3.6 s a step), so a run longer than a
session resumes where it stopped.
"""

from __future__ import annotations

from configs import smollm2_demo

KOKORO_UNITS = 178  # Kokoro's phoneme token ids (KokoroSpeech.num_units): the CS's unit tables


def get_config(arg: str | None = None):
    c = smollm2_demo.get_config(arg)
    c.stage = "coe"
    c.data.shards = "work/ed_shards"
    c.data.features_like = "work/shards"
    c.data.train_split = "train"
    c.data.eval_split = "dev"
    # the CS's speech rows aligned to Kokoro's 178 phoneme token ids and its video frames to the unit each
    # frame shows (Kokoro's durations), so the avatar stages that init_from this run
    # (configs/smollm2_ed_avatar.py) build the same model (docs/design.md "Aligned Content Synchronizer");
    # the coe stage itself does not train the CS
    c.model.empatheia.cs_units = KOKORO_UNITS
    c.model.empatheia.cv_units = KOKORO_UNITS
    c.data.max_len = 320  # ED turns with their CoE target: ~120-300 tokens; longer histories lose old turns
    # target-only logits: the coe loss reads 26 % of a step's positions (68 a row on average, a batch's total
    # far below 128 x 8); exact, and a batch with more projects every position. Packing (data.pack_len)
    # stays off: rows of 512 gained less than buckets do.
    c.model.empatheia.ce_targets = 128
    # every batch padded to the next multiple of 32 above its longest turn instead of 256 / 320: 87 % real
    # tokens instead of 68 % (six compiled lengths instead of two)
    c.data.bucket_step = 32
    # bfloat16 operands, float32 accumulation in the backbone's dots (what a TPU does with float32 weights);
    # XLA:CPU's bf16 dot kernels are ~1.8x its float32 ones on AVX512-BF16 CPUs (llama.py "Matmul precision
    # bfloat16"). These three levers: docs/benchmarks.md "The coe step on the CPU". A CPU without AVX512-BF16
    # or AMX loses by it (0.82x of float32 on a Zen 3; the trainer warns): set
    # --config.model.matmul_precision=float32 there.
    c.model.matmul_precision = "bfloat16"
    c.train.batch_size = 8
    c.train.grad_accum = 1
    c.train.log_every = 20
    c.train.eval_every = 200
    c.train.eval_batches = 0  # the whole dev part
    c.optim.lr = 2e-4
    c.optim.warmup_steps = 50
    c.optim.end_lr_ratio = 0.1
    c.schedule.coe.steps = 1500  # ~2.5 epochs of the train part
    c.checkpoint.every = 100
    c.checkpoint.keep = 2
    c.checkpoint.keep_best = True
    c.checkpoint.best_metric = "eval/total"
    c.checkpoint.best_mode = "min"
    return c
