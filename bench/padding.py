"""How much of a training step is padding: real tokens / padded positions of a config's train batches, for
sort windows (`data.window_batches`) and bucket steps (`data.bucket_step`) side by side.

A pipeline statistic, not a timing: the batches are the trainer's own (`pipelines.make_train_pipeline` on the
model `init.build_model` builds), so the figure is the share of a step's positions that are not pad.

    python bench/padding.py --config configs/smollm2_ed.py --override model.backbone=work/smollm2 \
        --override data.shards=ED_TEXT_SHARDS 8 64 64:16          # WINDOW_BATCHES[:BUCKET_STEP] ...
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from memory_plan import load_config  # noqa: E402

from empatheia_jax.train import config as config_lib  # noqa: E402
from empatheia_jax.train import init, pipelines  # noqa: E402


def padding_row(config, stage, model, tokenizer, batches: int) -> dict:
    """`batches` train batches: real tokens over positions, and how many of each length (one compile each)."""
    real = positions = n = 0
    lengths: collections.Counter = collections.Counter()
    for batch in pipelines.make_train_pipeline(config, stage, model, tokenizer):
        mask = batch["attention_mask"]
        real, positions, n = real + int(mask.sum()), positions + mask.size, n + 1
        lengths[mask.shape[1]] += 1
        if n == batches:
            break
    return {"batches": n, "real_fraction": real / positions, "positions_per_batch": positions / n,
            "lengths": dict(sorted(lengths.items()))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a config file, path.py[:arg]")
    parser.add_argument("--override", action="append", default=[], help="KEY=VALUE, as --config.KEY=VALUE")
    parser.add_argument("--batches", type=int, default=0, help="batches per row (0: one epoch)")
    parser.add_argument("rows", nargs="+", help="WINDOW_BATCHES[:BUCKET_STEP] (bucket step: the config's)")
    args = parser.parse_args(argv)
    config = load_config(args.config, None, args.override)
    stage = config_lib.resolve_stage(config)
    manifest = init.model_manifest(config)
    model, tokenizer = init.build_model(config, manifest)
    # one epoch by default: the train split's records over the batch size (the remainder dropped)
    records = manifest["splits"][config.data.train_split]["records"]
    batches = args.batches or records // config.train.batch_size
    print("| window_batches | bucket_step | real tokens / padded positions | positions per batch | lengths |")
    print("|---|---|---|---|---|")
    default_step = int(config.data.bucket_step)
    for row in args.rows:
        window, _, step = row.partition(":")
        config.data.window_batches = int(window)
        config.data.bucket_step = int(step) if step else default_step
        r = padding_row(config, stage, model, tokenizer, batches)
        print(f"| {window} | {config.data.bucket_step} | {r['real_fraction']:.3f} "
              f"| {r['positions_per_batch']:,.0f} | {len(r['lengths'])} ({r['batches']} batches) |",
              flush=True)


if __name__ == "__main__":
    main()
