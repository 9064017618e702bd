"""The reference model's stages on the sample (stage sac after the ED stages, `launch/ed_reference.py`).

The demo's config (`configs/smollm2_demo.py`: the sample's shards, schedule and learning rates) with the
Content Synchronizer the ED stages trained (`smollm2_ed_avatar.reference_cs`), so that `init_from` the ED
stages loads every CS weight and the stage trains what it names on top of them.
"""

from __future__ import annotations

from configs import smollm2_demo, smollm2_ed_avatar


def get_config(arg: str | None = None):
    return smollm2_ed_avatar.reference_cs(smollm2_demo.get_config(arg))
