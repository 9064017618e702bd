"""The reference model's voice and face: the Content Synchronizer on every ED reply (ccl_units, then ccl).

The sample's 64 training dialogues gave the CS 10-40 steps and it learnt the mean row (docs/design.md
"Aligned Content Synchronizer"). ED's 4.8k training replies carry content targets without any media:
Kokoro's t_en ++ d_en of each reply's phonemes (`converters.styletts2_targets --responses-only`) and the face
generator's mouth track laid on Kokoro's predicted durations (`converters.face_targets --mouth phonemes
--responses-only`); launch/ed_reference.py exports them and prepares the text-only shards with them.

The CS's speech rows are aligned to the reply's Kokoro phoneme tokens (`cs_units`, 178 ids) and its video
frames to the unit each frame shows (`cv_units`), as in `configs/smollm2_ed.py`; here each block also reads
its units in context (`cs_unit_context`: convolutions + a BiLSTM, Kokoro's text-encoder shape), the first
learnt predictor heard better than a table of unit means (docs/benchmarks.md "units read in context"); the
speech block's reader is 512 wide (`cs_context_width`), Kokoro's own width, at which a reader alone was heard
at WER 0.162 where the block's 128 (64 per LSTM direction) gave the first reference CS 0.220; and its
features reach the output rows straight (`cs_context_skip`), since every other path to a row passes a
128-wide layer, and the gold rows on their best 128 principal directions are heard at WER 0.306 (0.155 on
256). That CS design differs from the coe run's, so `init_from` a coe run (or the committed reference
export, --coe_from of launch/ed_reference.py) starts the CS fresh and keeps everything else.

Two stages, because what is heard is learnt from the units and a ccl step is mostly the frozen LLM's
forward (4-5 s at batch 8 on 2 cores):
- ccl_units: the CS from its units alone, no LLM (`Empatheia.content_from_units`). 1,500 steps at batch 8
  (12k examples, ~2.5 epochs of the train replies), chosen on the dev curve of a 6,000-step schedule of
  the same design: dev ccl_speech 202 / 172 / 157 / 149 / 142 at steps 250-1,250 with the lr still near its
  peak, already under the first reference CS's 155.6 after 6,000 steps, and heard at WER 0.124 at step 750
  (docs/benchmarks.md "The third reference run"). 1,500 steps with the whole cosine decay fit one CPU
  session (~40 min) where 6,000 took three.
- ccl: the same CS with r^t, `init_from` ccl_units. The encoders' cross-attention to r^t starts silent, so
  step 0 is ccl_units' function; 100 steps at a quarter of the lr let r^t in (a ccl step is 4-5 s).
Both: lr with cosine decay, dev loss every 250 steps, the best-dev-loss checkpoint kept.
"""

from __future__ import annotations

from configs import smollm2_ed


def reference_cs(c):
    """The reference model's CS design, set on config `c`: every stage that trains or loads it builds the
    same blocks (this config's, and the sample stages' `configs/smollm2_ed_sample.py`)."""
    e = c.model.empatheia
    e.cs_units = e.cv_units = smollm2_ed.KOKORO_UNITS
    e.cs_unit_context = True
    e.cs_context_width = 512
    # ... whose features also reach the rows directly: past the block's 128-wide stacks (docs/benchmarks.md
    # "How wide a row must come from": gold rows on their best 128 directions are heard at WER 0.31)
    e.cs_context_skip = True
    return c


def get_config(arg: str | None = None):
    c = reference_cs(smollm2_ed.get_config(arg))
    c.stage = "ccl"
    c.data.shards = "work/ed_avatar_shards"
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 50
    c.schedule.ccl_units.steps = 1500
    c.schedule.ccl_units.warmup_steps = 100
    c.schedule.ccl.steps = 100
    c.schedule.ccl.lr = 2.5e-4
    c.train.eval_every = 250
    c.checkpoint.every = 250
    return c
