"""How the reply is decoded after the greedy Chain of Empathy: greedy, one draw, or the consensus of k draws
(`serve.reply_choice`), scored against the gold replies on the same turns. Chooses `--reply_candidates` and
measures it without re-running the greedy CoE.

    python bench/reply_decoding.py draw --ckpt EXPORT --shards SHARDS --predictions PRED.jsonl --out D.jsonl
        [--split dev] [--start 0] [--stop N] [--samples 16] [--temperature 0.7] [--top_p 0.95] [--seed 0]
        [--batch 16] [--max_new 48] [--no_repeat_ngram_size 0]
    python bench/reply_decoding.py score D.jsonl [D2.jsonl ...] [--k 1 4 8 16] [--with_greedy]
        [--greedy_votes 1 2] [--json OUT]

`draw`: for the split's records [start, stop) (sorted by prompt length, batches of `--batch`), the prefix is
the eval prompt (as `empatheia eval --template coe` builds it) + the greedy CoE of an eval's predictions
(`text_greedy`, else `text`) through the step-5 header, re-tokenised; `--samples` replies are drawn per
prefix from one prefill (`generate_tokens(num_samples=)`), seeded per batch (seed + the batch's offset).
Writes one JSON line per record: record_index, gold, speaker_turn, greedy (the greedy reply), samples.
`score`: files drawn with other seeds on the same records are joined (their samples appended, in file
order; an eval's predictions file with `reply_candidates` reads as a draw file); rows for the greedy reply,
the first draw, and the consensus of the first k draws (`--with_greedy`: also with the greedy reply as one
more candidate; `--greedy_votes W`: the greedy reply adds W times its agreement with each draw to
that draw's score, never chosen itself), each with the
eval's reply rows (`metrics.text.reply_metrics`: BLEU-1/2, ROUGE-L, question, reuse and duplicate rates,
Dist, words, repetition) and the gold replies' own engagement rows as the reference.

The eval draws from the prefix in token space (`reply_choice.reply_header_tokens`) after decoding the CoE
in the same run; here the CoE text is re-tokenised, which can split a word differently at the header: the
figures are the eval's up to that and the seeds.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from tqdm import tqdm  # noqa: E402


def draw(args: argparse.Namespace) -> None:
    from empatheia_jax.data import templates as tpl
    from empatheia_jax.data.examples import ExampleBuilder
    from empatheia_jax.data.parse import parse_generation
    from empatheia_jax.data.pipeline_config import PipelineConfig, pipeline_config_fields
    from empatheia_jax.data.shard_reader import ShardReader
    from empatheia_jax.eval import generation_pass as gp
    from empatheia_jax.serve.generation import eos_token_ids, generate_tokens
    from empatheia_jax.serve.load import load_trained
    from empatheia_jax.train.stages import eval_stage

    model, tok, _, _ = load_trained(args.ckpt)
    preds = [json.loads(line) for line in Path(args.predictions).read_text().splitlines() if line.strip()]
    greedy = {p["record_index"]: p.get("text_greedy", p["text"]) for p in preds}
    cfg = model.config
    stage = eval_stage(cfg, "coe")
    pcfg = PipelineConfig(stage=stage.template_stage, max_len=1024, include_target=False,
                          **pipeline_config_fields(cfg, stage, None))
    reader = ShardReader.for_split(args.shards, args.split)
    builder = ExampleBuilder(tok, pcfg, audio_dim=cfg.audio_dim, video_dim=cfg.video_dim)
    if cfg.has_media and pcfg.template_spec().has_media:
        sys.exit("reply_decoding: the model splices media here; this bench reads text-only shards (ED dev)")
    eos = eos_token_ids(model.llm, tok)
    stop = len(reader) if args.stop is None else min(args.stop, len(reader))
    kept = [e for e in gp._window_prompts(reader, builder, args.start, stop) if e["record_index"] in greedy]
    n, size = args.samples, args.batch
    with open(args.out, "w") as f:
        for b0 in tqdm(range(0, len(kept), size), desc="draw replies"):
            chunk = kept[b0 : b0 + size]
            rows = chunk + [chunk[-1]] * (size - len(chunk))
            prefixes = []
            for e in rows:
                text = greedy[e["record_index"]]
                end = tpl.response_header_end(text)
                prefixes.append(e["input_ids"].tolist()
                                + tok.encode(text if end is None else text[:end], add_special_tokens=False))
            gen = generate_tokens(model.llm, prefixes, args.max_new, args.temperature, args.top_p,
                                  seed=b0 + args.seed, eos_ids=eos, pad_token_id=builder.pad_id,
                                  no_repeat_ngram_size=args.no_repeat_ngram_size, num_samples=n)
            for r, e in enumerate(chunk):
                samples = [tok.decode(gen.new_tokens[r * n + j, : gen.num_new[r * n + j]],
                                      skip_special_tokens=True).strip() for j in range(n)]
                f.write(json.dumps({"record_index": e["record_index"], "gold": e["gold_reply"],
                                    "speaker_turn": e["speaker_turn"],
                                    "greedy": parse_generation(greedy[e["record_index"]])["reply"],
                                    "samples": samples}) + "\n")
            f.flush()


def _as_draws(line: dict) -> dict:
    """A line of `draw`'s output as is; a line of an eval's predictions file (`empatheia eval
    --reply_candidates K --report`) as one: its drawn candidates are the samples (a turn whose text had no
    step-5 header kept its greedy reply, which then stands for every draw)."""
    if "samples" in line:
        return line
    from empatheia_jax.data.parse import parse_generation

    greedy = parse_generation(line.get("text_greedy", line["text"]))["reply"]
    return {"record_index": line["record_index"], "gold": line["gold_reply"],
            "speaker_turn": line["speaker_turn"], "greedy": greedy,
            "samples": line.get("reply_candidates") or [line["reply"]],
            "kept": "reply_candidates" not in line}


def score(args: argparse.Namespace) -> None:
    import numpy as np

    from empatheia_jax.eval.metrics import text as mt
    from empatheia_jax.serve.reply_choice import agreement, consensus_index

    records: dict[int, dict] = {}
    for path in args.draws:
        for line in Path(path).read_text().splitlines():
            d = _as_draws(json.loads(line))
            if d["record_index"] in records:
                records[d["record_index"]]["samples"] += d["samples"]
            else:
                records[d["record_index"]] = d
    recs = [records[i] for i in sorted(records)]
    golds, turns = [r["gold"] for r in recs], [r["speaker_turn"] for r in recs]
    have = min((len(r["samples"]) for r in recs if not r.get("kept")), default=1)
    for r in recs:
        if r.get("kept"):  # no header: the greedy reply was kept, whatever the draws
            r["samples"] = r["samples"] * have
    table = {"greedy": mt.reply_metrics([r["greedy"] for r in recs], golds, turns),
             "first draw": mt.reply_metrics([r["samples"][0] for r in recs], golds, turns)}
    for k in args.k:
        if 1 < k <= have:
            picks = [r["samples"][consensus_index(r["samples"][:k])] for r in recs]
            table[f"consensus of {k}"] = mt.reply_metrics(picks, golds, turns)
            pool = [r["samples"][:k] + [r["greedy"]] for r in recs]  # the greedy reply last
            if args.with_greedy:  # the greedy reply as one more candidate (ties go to the draws)
                table[f"consensus of {k} + greedy"] = mt.reply_metrics([c[consensus_index(c)] for c in pool],
                                                                       golds, turns)
            agree = [agreement(c) for c in pool] if args.greedy_votes else []
            for w in args.greedy_votes:  # the greedy reply votes with weight w but is never chosen
                picks = [c[int(np.argmax(a[:k, :k].sum(1) + w * a[:k, k]))] for c, a in zip(pool, agree,
                                                                                               strict=True)]
                table[f"consensus of {k}, greedy votes x{w:g}"] = mt.reply_metrics(picks, golds, turns)
    table["gold"] = mt.reply_engagement(golds, turns)
    cols = ("reply_bleu1", "reply_bleu2", "reply_rouge_l", "question_rate", "reuse_rate", "duplicate_rate",
            "dist2_corpus", "reply_words", "repetition_rate")
    print(f"{len(recs)} turns, {have} draws each")
    print("| reply | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, m in table.items():
        print(f"| {name} | " + " | ".join(f"{m[c]:.4f}" if c in m else "-" for c in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"turns": len(recs), "draws": have, "rows": table}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("draw")
    d.add_argument("--ckpt", required=True)
    d.add_argument("--shards", required=True)
    d.add_argument("--predictions", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--split", default="dev")
    d.add_argument("--start", type=int, default=0)
    d.add_argument("--stop", type=int, default=None)
    d.add_argument("--samples", type=int, default=16)
    d.add_argument("--temperature", type=float, default=0.7)
    d.add_argument("--top_p", type=float, default=0.95)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--batch", type=int, default=16)
    d.add_argument("--max_new", type=int, default=48)
    d.add_argument("--no_repeat_ngram_size", type=int, default=0,
                   help="the eval's repetition control (the reference recipe's eval: 4)")
    s = sub.add_parser("score")
    s.add_argument("draws", nargs="+")
    s.add_argument("--k", type=int, nargs="+", default=[4, 8, 16])
    s.add_argument("--json", default=None)
    s.add_argument("--greedy_votes", type=float, nargs="*", default=[],
                   help="also rows where the greedy reply adds its agreement with each draw, times W, to the "
                        "draw's consensus score without being a candidate")
    s.add_argument("--with_greedy", action="store_true",
                   help="also rows for the consensus of k draws and the greedy reply as one more candidate")
    args = ap.parse_args()
    draw(args) if args.cmd == "draw" else score(args)


if __name__ == "__main__":
    main()
