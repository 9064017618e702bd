"""Fits the emotion head (`eval.emotion_head`) of a trained model and chooses its combination with step 2.

    # 1. the probe: fitted on the train part, its regularisation chosen on the dev part
    python -m empatheia_jax.eval.fit_emotion_head probe --ckpt EXPORT --shards SHARDS [--backbone DIR]
    # 2. an eval of the dev part with that head and --score_emotions writes predictions_<template>.jsonl
    empatheia eval --ckpt EXPORT --shards SHARDS --split dev --template coe --score_emotions --report R
    # 3. the combination's weights, chosen on those dev predictions, written into the head
    python -m empatheia_jax.eval.fit_emotion_head weights --head EXPORT/emotion_head.safetensors \\
        --predictions R/predictions_coe.jsonl

Both steps print what they chose and the dev figures it was chosen by, and `--json` writes them. Exit status
0, or 2 with one `error:` line for a bad file, folder or split.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.data import schema
from empatheia_jax.data.parse import emotion_class
from empatheia_jax.eval import emotion_head as eh


def fit_probe_of(ckpt: str, shards: str, *, train_split: str = "train", dev_split: str = "dev",
                 template: str | None = "coe", backbone: str | None = None, batch_size: int = 8,
                 progress: bool = True, features: str | None = None) -> tuple[eh.EmotionHead, dict[str, Any]]:
    """(the probe, its summary) for the model at `ckpt`: features of every record of both splits read by the
    model (`dialogue_summaries`), the probe fitted on the train split's labelled records for each C
    of `emotion_head.C_GRID`, kept at the best dev accuracy. `features` (.npz) keeps the features: read
    when it holds those of the same checkpoint, shards, splits and template, else written."""
    source = {"ckpt": str(Path(ckpt).resolve()), "shards": str(Path(shards).resolve()), "template": template,
              "splits": [train_split, dev_split]}
    read = _cached_features(features, source) if features else None
    if read is None:
        from empatheia_jax.eval.generation_pass import dialogue_summaries
        from empatheia_jax.serve.load import load_trained

        model, tokenizer, config, _ = load_trained(ckpt, backbone=backbone)
        read = {s: dialogue_summaries(model, tokenizer, shards, s, template=template, batch_size=batch_size,
                                      max_len=int(config.data.max_len), progress=progress)
                for s in (train_split, dev_split)}
        if features:
            _save_features(features, source, read)
    for s, r in read.items():
        if not np.any(r["emotion_fine"] >= 0):
            raise eh.EmotionHeadError(f"{shards} split {s}: no record has an ED emotion label (emotion_fine)")
    train = read[train_split]["emotion_fine"] >= 0
    dev = read[dev_split]["emotion_fine"] >= 0
    head, by_c = eh.fit_head(read[train_split]["features"][train], read[train_split]["emotion_fine"][train],
                             read[dev_split]["features"][dev], read[dev_split]["emotion_fine"][dev])
    summary = {"c": head.c, "dev_accuracy_by_c": {f"{c:g}": a for c, a in by_c.items()},
               "emotion32_acc_head": by_c[head.c], "train_records": int(train.sum()),
               "dev_records": int(dev.sum()), "template": template, "shards": str(shards)}
    return head, summary


def _save_features(path: str, source: dict[str, Any], read: dict[str, dict[str, np.ndarray]]) -> None:
    arrays = {f"{s}/{k}": v for s, r in read.items() for k, v in r.items()}
    tmp = Path(f"{path}.tmp.npz")
    np.savez(tmp, source=np.asarray(json.dumps(source)), **arrays)
    tmp.replace(path)  # whole or absent


def _cached_features(path: str, source: dict[str, Any]) -> dict[str, dict[str, np.ndarray]] | None:
    """The features saved at `path` when they were read from `source`; None when there are none (or they
    are another model's or data's: recomputed then)."""
    if not Path(path).is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            if json.loads(str(f["source"])) != source:
                print(f"{path}: features of another checkpoint or data; reading them again", file=sys.stderr)
                return None
            out: dict[str, dict[str, np.ndarray]] = {}
            for key in f.files:
                if key != "source":
                    split, name = key.split("/", 1)
                    out.setdefault(split, {})[name] = f[key]
            return out
    except (ValueError, OSError, KeyError) as e:
        raise eh.EmotionHeadError(f"{path}: not a features file ({e})") from e


def choose_head_weights(head: eh.EmotionHead, predictions: list[dict[str, Any]],
                        emotion_map: schema.EmotionMap | None = None
                        ) -> tuple[eh.EmotionHead, dict[str, Any]]:
    """(the head with the combination weights that are most often right on `predictions`, the summary):
    `predictions` are an eval's of the dev part with this head and --score_emotions. With the shards'
    `emotion_map`, the summary also has the combined decision's class accuracy (emotion_acc_combined); with at
    least CV_FOLDS labelled records, its cross-fitted accuracy (emotion32_acc_combined_cv)."""
    a = eh.prediction_arrays(predictions)
    labelled = a["gold"] >= 0
    if not labelled.any():
        raise eh.EmotionHeadError("no prediction has a gold ED label (labels.emotion_fine)")
    if not any("emotion_fine_scored" in p for p in predictions):
        raise eh.EmotionHeadError("the predictions were not scored: evaluate with --score_emotions")
    chosen_on = tuple(a[k][labelled] for k in ("head", "scored", "free", "gold"))
    (hw, fw), table = eh.choose_weights(*chosen_on)
    scored = np.asarray([p.get("emotion_fine_scored", -1) for p in predictions])  # the eval's own: -1 = wrong
    alone = {name: float(np.mean(pred[labelled] == a["gold"][labelled])) for name, pred in (
        ("free", a["free"]), ("scored", scored), ("head", a["head"].argmax(-1)))}
    summary = {"head_weight": hw, "free_weight": fw, "emotion32_acc_combined": table[(hw, fw)],
               "alone": alone, "records": int(labelled.sum()),
               "scored_records": int((~np.isnan(a["scored"][labelled]).all(-1)).sum()),
               "table": {f"{h:g},{f:g}": acc for (h, f), acc in table.items()}}
    if labelled.sum() >= eh.CV_FOLDS:  # the figure to expect on records the choice never saw
        summary["emotion32_acc_combined_cv"] = eh.cross_fitted_accuracy(*chosen_on)
    if emotion_map is not None:
        fine = eh.combine(a["head"], a["scored"], a["free"], hw, fw)
        gold = np.asarray([p.get("labels", {}).get("emotion", -1) for p in predictions])
        coarse = np.asarray([-1 if (c := emotion_class(schema.ED_EMOTIONS_32[f], emotion_map)) is None else c
                             for f in fine])
        summary["emotion_acc_combined"] = float(np.mean(coarse[gold >= 0] == gold[gold >= 0]))
    return head.with_weights(hw, fw), summary


def _read_predictions(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise eh.EmotionHeadError(f"{path} line {n}: not JSON ({e.msg})") from e
    if not rows:
        raise eh.EmotionHeadError(f"{path}: no predictions")
    return rows


def _user_errors() -> tuple[type[BaseException], ...]:
    from empatheia_jax.data.splits import ShardsError
    from empatheia_jax.train.checkpoint import CheckpointError
    from empatheia_jax.train.stages import TemplateError

    return OSError, eh.EmotionHeadError, ShardsError, CheckpointError, TemplateError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    probe = sub.add_parser("probe", help="fit the probe (train part) and its C (dev part)")
    probe.add_argument("--ckpt", required=True, help="a training workdir or an export folder")
    probe.add_argument("--shards", required=True, help="shards with the train and dev splits")
    probe.add_argument("--train_split", default="train")
    probe.add_argument("--dev_split", default="dev")
    probe.add_argument("--template", default="coe", help="the prompt the model reads (eval's --template)")
    probe.add_argument("--backbone", default=None, help="the converted backbone, when the export's moved")
    probe.add_argument("--batch_size", type=int, default=8)
    probe.add_argument("--out", default=None, help=f"the head file (default: CKPT/{eh.FILE_NAME})")
    probe.add_argument("--features", default=None, help="an .npz that keeps the features read: a second fit "
                       "on the same checkpoint and data reads them instead of running the model")
    weights = sub.add_parser("weights", help="choose the combination's weights on dev predictions")
    weights.add_argument("--head", required=True, help="the head file; the weights are written into it")
    weights.add_argument("--predictions", required=True, help="eval --report's predictions_<template>.jsonl "
                         "of the dev part, evaluated with this head and --score_emotions")
    weights.add_argument("--shards", default=None, help="the shards evaluated: their emotion map gives the "
                         "combined decision's class accuracy")
    for p in (probe, weights):
        p.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    from empatheia_jax import logs

    logs.configure()
    try:
        if args.step == "probe":
            head, summary = fit_probe_of(args.ckpt, args.shards, train_split=args.train_split,
                                         dev_split=args.dev_split, template=args.template,
                                         backbone=args.backbone, batch_size=args.batch_size,
                                         features=args.features)
            out = args.out or str(Path(args.ckpt) / eh.FILE_NAME)
        else:
            emap = None
            if args.shards:
                from empatheia_jax.data.shard_format import load_manifest
                from empatheia_jax.data.splits import emotion_map_of

                try:
                    emap = emotion_map_of(load_manifest(args.shards))
                except ValueError as e:  # a manifest that is not one
                    raise eh.EmotionHeadError(str(e)) from e
            head, summary = choose_head_weights(eh.EmotionHead.load(args.head),
                                                _read_predictions(args.predictions), emap)
            out = args.head
        head.save(out)
    except _user_errors() as e:  # a bad file, folder, checkpoint or split: one line, no traceback
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    shown = {k: v for k, v in summary.items() if k not in ("table",)}
    print(json.dumps(shown, indent=1))
    print(f"emotion head: {out}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
