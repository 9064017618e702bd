"""The reference model's voice and face: stage ccl (the Content Synchronizer) on every ED reply.

The sample's 64 training dialogues gave the CS 10-40 steps and it learnt the mean row (docs/design.md
"Aligned Content Synchronizer"). ED's 4.8k training replies carry content targets without any media:
Kokoro's t_en ++ d_en of each reply's phonemes (`converters.styletts2_targets --responses-only`) and the face
generator's mouth track laid on Kokoro's predicted durations (`converters.face_targets --mouth phonemes
--responses-only`); launch/ed_reference.sh exports them and prepares the text-only shards with them.

The CS's speech rows are aligned to the reply's Kokoro phoneme tokens (`cs_units`, 178 ids) and its video
frames to the unit each frame shows (`cv_units`): the model of `configs/smollm2_ed.py` (which sets the same),
so `init_from` its coe run chains into this stage, as does the committed reference export (COE_FROM in
launch/ed_reference.sh: the CS starts fresh, everything else is the export's). Only the CS trains (the LLM
is frozen), so a step is one forward of the backbone and a small backward.

Schedule: batch 8, lr 1e-3 with cosine decay over 3,000 steps (~5 epochs of the 4.8k train replies), dev
loss every 250 steps, the best-dev-loss checkpoint kept. Why 3,000 and not the 1,500 first chosen: the
real block trained from the units alone is heard at WER 0.45 after 600 steps and 0.258 after 1,200
(docs/benchmarks.md "The avatar's words"), so the fit, not the design, bounds what is heard; the unit-aligned
video block likewise is still below the mean predictor after 300 steps.
"""

from __future__ import annotations

from configs import smollm2_ed


def get_config(arg: str | None = None):
    c = smollm2_ed.get_config(arg)
    c.stage = "ccl"
    c.data.shards = "work/ed_avatar_shards"
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 50
    c.schedule.ccl.steps = 3000
    c.train.eval_every = 250
    c.checkpoint.every = 250
    return c
