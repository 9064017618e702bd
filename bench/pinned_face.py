"""Does the frame probe read the pinned listener's profile: the face `chat --listener` draws, with the
corpus's identity of each profile (`FaceRenderer.avatar_style`) and with each stock identity instead.

    python bench/pinned_face.py --shards SHARDS [--split test] [--json OUT]

SHARDS have face-generator video targets (the sample's `make demo` shards). Eval's probe (`VideoEval`,
fitted on train gold clips) reads every labelled record of the split drawn with its gold mouth track on the
pinned avatar of its listener profile, in the expression its gold avatar shows: the `video_pinned_*_acc`
rows of a model whose content and emotion were exactly the gold ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", required=True)
    ap.add_argument("--split", default="test")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from empatheia_jax.data.ed import PROFILE_COMBOS
    from empatheia_jax.eval.video import VideoEval
    from empatheia_jax.generators.face_render import FaceRenderer

    ve = VideoEval(args.shards, args.split, examples=0, progress=False)
    idx = sorted(ve.labels)

    def rows(identity: int | None) -> dict[str, float]:
        drawn = {}
        for i in idx:
            who = {k: ve.labels[i][k] for k in ("age", "gender", "timbre")}
            if identity is not None:
                who["ID"] = identity
            drawn[i] = (ve.gold_controls[i][0], FaceRenderer.avatar_style(who, ve.labels[i]["emotion"])[0])
        return ve._style_rows(drawn)

    out = {"records": len(idx), "gold avatars": ve.gold_rows(), "corpus identity": rows(None),
           "stock identities": {pid: rows(pid) for pid in range(len(PROFILE_COMBOS))}}
    print(f"{len(idx)} {args.split} records; probe accuracy (age / gender / timbre / emotion)")
    for name in ("gold avatars", "corpus identity"):
        print(f"{name:>16}: " + " / ".join(f"{v:.3f}" for v in out[name].values()))
    ages = [r["video_age_acc"] for r in out["stock identities"].values()]
    print(f"{'stock identities':>16}: age {min(ages):.3f}-{max(ages):.3f} over {len(ages)} "
          f"(ID 0: {ages[0]:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
