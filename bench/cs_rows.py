"""What the Content Synchronizer's block can learn of Kokoro's content rows from the phoneme units alone.

    python bench/cs_rows.py --raw RUN/ed/raw --targets RUN/ed/targets [--conv 0,5] [--steps 600] [--context]
        [--batch 8] [--lr 1e-3] [--json OUT]

Kokoro's content rows (t_en ++ d_en) are a deterministic function of the reply's phoneme tokens: a CNN +
BiLSTM text encoder and PL-BERT over the whole sequence. A unit-aligned CS (`cs_units`) is told the tokens,
so how well its block maps a token sequence to the rows bounds what it can say, whatever r^t adds. This
trains the real block (`models.vae.TransformerVAE`, the CS's shape of `configs/base.py`) on the ED train
replies with no memory (its cross-attention has nothing to read), once per `--conv` width (0 = the block as
the paper has it, k = a depthwise row convolution of width k in every layer, `VAEConfig.conv_kernel`), with
the ccl loss (`--scale`: eq 9, or `loss.ccl_scale=balanced`) and schedule of `configs/smollm2_ed_avatar.py`,
and reports per variant the dev row L2 (eq 9's measure; `bench/cs_oracles.py` gives the unit-mean oracle's)
and the corpus WER / CER of `--replies` dev replies spoken from the predicted rows in their gold voice and
heard by Whisper tiny.en (`asr`); with `--mix` also of the rows whose t_en half (or d_en half) is gold,
to tell which half the errors heard are in.

    python bench/cs_rows.py --video --raw RAW --targets TARGETS [--steps 600] [--json OUT]

`--video` trains the CS's video block instead (the face generator's video_content rows, one per 25-fps
frame, of targets exported with `converters.face_targets --mouth phonemes`, which also writes each frame's
unit, video_units): once unit-aligned to the frame units (`cv_units`), once position-only (the paper's
block), same steps, and reports the dev row L2 against the mean predictor's (the mean train row at each
frame index, eval's baseline) and the unit-mean oracle's, and the per-clip Pearson correlation of the
predicted mouth opening (dim 0) with the gold mouth track, averaged over dev clips (what lip sync needs:
the mouth moving when the gold one does).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _load(raw: Path, targets: Path, split: str, q: int, limit: int | None = None):
    """(texts, uids, units [N, q] int32, rows [N, q, 1024] float16, mask [N, q] bool) of a split's replies."""
    from converters.styletts2_targets import speech_jobs
    from empatheia_jax.data.targets import TargetReader
    from empatheia_jax.generators import kokoro
    from empatheia_jax.generators.kokoro_speech import KokoroSpeech

    reader = TargetReader(targets)
    jobs = speech_jobs(raw, [split], responses_only=True)[:limit]
    units = np.zeros((len(jobs), q), np.int32)
    rows = np.zeros((len(jobs), q, kokoro.CONTENT_DIM), np.float16)
    mask = np.zeros((len(jobs), q), bool)
    for i, job in enumerate(jobs):
        r = reader.get("speech_content", job.uid)[:q]
        u = KokoroSpeech.content_units(job.text)[:q]
        units[i, : len(u)], rows[i, : len(r)], mask[i, : len(r)] = u, r, True
    return [j.text for j in jobs], [j.uid for j in jobs], units, rows, mask


def _load_video(raw: Path, targets: Path, split: str, q: int, limit: int | None = None):
    """(texts, uids, frame units [N, q] int32, video_content rows [N, q, 256] float32, mask [N, q] bool) of
    a split's replies that have video_units (face_targets --mouth phonemes)."""
    from converters.styletts2_targets import speech_jobs
    from empatheia_jax.data.targets import TargetReader

    reader = TargetReader(targets)
    jobs = [j for j in speech_jobs(raw, [split], responses_only=True) if ("video_units", j.uid) in reader]
    jobs = jobs[:limit]
    dim = reader.dim("video_content")
    units = np.zeros((len(jobs), q), np.int32)
    rows = np.zeros((len(jobs), q, dim), np.float32)
    mask = np.zeros((len(jobs), q), bool)
    for i, job in enumerate(jobs):
        r = reader.get("video_content", job.uid)[:q]
        u = reader.get("video_units", job.uid)[:q, 0].astype(np.int32)
        units[i, : len(u)], rows[i, : len(r)], mask[i, : len(r)] = u, r, True
    return [j.text for j in jobs], [j.uid for j in jobs], units, rows, mask


def _mouth_sync(pred: np.ndarray, gold: np.ndarray, mask: np.ndarray, mouth: int = 0) -> float:
    """Mean over clips of the Pearson correlation of the predicted and gold mouth opening over the clip's
    frames (a constant prediction counts 0: it does not move with the speech)."""
    rs = []
    for p, g, m in zip(pred[..., mouth], gold[..., mouth], mask, strict=True):
        p, g = p[m].astype(np.float64), g[m].astype(np.float64)
        if len(p) < 3 or g.std() == 0:
            continue
        rs.append(0.0 if p.std() == 0 else float(np.corrcoef(p, g)[0, 1]))
    return float(np.mean(rs)) if rs else float("nan")


def _row_l2(pred: np.ndarray, gold: np.ndarray, mask: np.ndarray) -> float:
    return float(np.square(pred.astype(np.float32) - gold.astype(np.float32))[mask].sum(-1).mean())


def _video(args) -> dict:
    """The `--video` comparison (module docstring)."""
    from empatheia_jax.generators.kokoro_speech import KokoroSpeech

    train = _load_video(args.raw, args.targets, "train", args.rows)
    dev = _load_video(args.raw, args.targets, "dev", args.rows, args.dev)
    units, rows, mask = train[2], train[3], train[4]
    n = mask.sum(0)
    mean_rows = np.where(n[:, None] > 0, np.einsum("nqd,nq->qd", rows, mask) / np.maximum(n, 1)[:, None],
                         rows[mask].mean(0))
    unit_sum = np.zeros((KokoroSpeech.num_units, rows.shape[-1]))
    np.add.at(unit_sum, units[mask], rows[mask].astype(np.float64))
    unit_n = np.bincount(units[mask], minlength=KokoroSpeech.num_units)[:, None]
    unit_mean = (unit_sum / np.maximum(unit_n, 1)).astype(np.float32)
    _, _, du, dr, dm = dev
    mean_pred = np.broadcast_to(mean_rows, dr.shape)
    out = {}
    for name, pred in (("mean_predictor", mean_pred), ("unit_mean", unit_mean[du])):
        out[name] = {"row_l2": _row_l2(pred, dr, dm), "mouth_sync": _mouth_sync(pred, dr, dm)}
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    weight = np.ones(rows.shape[-1], np.float32)
    for name, aligned in (("cv_units", True), ("position_only", False)):
        preds, _ = _train(0, train, dev, args.steps, args.batch, args.seed, weight, aligned=aligned)
        out[name] = {"row_l2": _row_l2(preds, dr, dm), "mouth_sync": _mouth_sync(preds, dr, dm)}
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    out["_meta"] = {"train_replies": len(train[0]), "dev_replies": len(dev[0]), "frames": args.rows,
                    "steps": args.steps, "batch": args.batch}
    return out


def _train(conv: int, data, dev, steps: int, batch: int, seed: int, weight: np.ndarray, aligned: bool = True,
           context: bool = False, lr: float = 1e-3):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tqdm import tqdm

    from configs import base
    from empatheia_jax.generators.kokoro_speech import KokoroSpeech
    from empatheia_jax.models.vae import TransformerVAE, VAEConfig, kl_divergence

    e = base.get_config().model.empatheia
    _, _, units, rows, mask = data
    q = units.shape[1]
    cfg = VAEConfig(d_in=8, d_model=e.vae_d_model, num_queries=q, d_latent=e.cs_latent, d_out=rows.shape[-1],
                    num_heads=e.vae_heads, enc_layers=e.vae_layers, dec_layers=e.vae_layers,
                    num_units=KokoroSpeech.num_units if aligned else 0, conv_kernel=conv,
                    unit_context=context)
    model = TransformerVAE(cfg, rngs=nnx.Rngs(seed))
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(50, steps // 2), steps)
    opt = nnx.Optimizer(model, optax.adamw(sched, weight_decay=0.0), wrt=nnx.Param)
    graph, state = nnx.split((model, opt))

    def loss_fn(m, u, r, k, key):
        h = jnp.zeros((u.shape[0], 1, 8))
        o = m(h, jnp.zeros((u.shape[0], 1), bool), sample=True, rng=key, units=u if aligned else None)
        per_row = jnp.sum(jnp.square(o.out - r) * weight, -1)
        l2 = jnp.sum(jnp.where(k, per_row, 0.0)) / jnp.sum(k)
        return l2 + 1e-3 * jnp.mean(kl_divergence(o.mu, o.logvar, k)), l2

    @jax.jit
    def step(state, u, r, k, key):
        m, o = nnx.merge(graph, state)
        (_, l2), grads = nnx.value_and_grad(loss_fn, has_aux=True)(m, u, r, k, key)
        o.update(m, grads)
        return nnx.state((m, o)), l2

    @jax.jit
    def predict(state, u):
        m, _ = nnx.merge(graph, state)
        return m(jnp.zeros((u.shape[0], 1, 8)), jnp.zeros((u.shape[0], 1), bool), sample=False,
                 units=u if aligned else None).out

    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    what = f"conv {conv}" + ("" if aligned else ", position-only") + (", unit context" if context else "")
    for i in tqdm(range(steps), desc=what, unit="step"):
        idx = rng.choice(len(units), batch, replace=False)
        batch_rows = rows[idx].astype(np.float32)
        state, _ = step(state, units[idx], batch_rows, mask[idx], jax.random.fold_in(key, i))
    _, _, du, dr, dm = dev
    preds = np.concatenate([np.asarray(predict(state, du[s:s + 32])) for s in range(0, len(du), 32)])
    return preds, _half_l2(preds, dr, dm)


def _half_l2(pred: np.ndarray, gold: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """Eq 9's row L2 over the valid rows, whole and per half (t_en, d_en)."""
    sq = np.square(pred.astype(np.float32) - gold.astype(np.float32))[mask]
    half = sq.shape[-1] // 2
    return {"row_l2": float(sq.sum(-1).mean()), "row_l2_t_en": float(sq[:, :half].sum(-1).mean()),
            "row_l2_d_en": float(sq[:, half:].sum(-1).mean())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/cs_rows.py", description=__doc__.split("\n")[0])
    ap.add_argument("--raw", required=True, type=Path)
    ap.add_argument("--targets", required=True, type=Path)
    ap.add_argument("--conv", default="0,5", help="row-convolution widths to compare (0 = none)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rows", type=int, default=256, help="rows the CS predicts (max_speech_len)")
    ap.add_argument("--dev", type=int, default=256, help="dev replies whose row L2 is measured")
    ap.add_argument("--replies", type=int, default=24, help="dev replies spoken and heard")
    ap.add_argument("--scale", choices=("none", "balanced"), default="none",
                    help="the loss's per-dimension weights, as config loss.ccl_scale")
    ap.add_argument("--mix", action="store_true",
                    help="also speak each prediction's t_en with the gold d_en and the other way round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (warm-up 50 steps, cosine)")
    ap.add_argument("--context", action="store_true",
                    help="read the units in context (VAEConfig.unit_context: convolutions + a BiLSTM)")
    ap.add_argument("--video", action="store_true",
                    help="train the video block: unit-aligned to the frame units vs position-only")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--save", type=Path, default=None,
                    help="a folder for each variant's dev predictions (npz); the heard replies are printed")
    args = ap.parse_args(argv)
    if args.video:
        t0 = time.perf_counter()
        out = _video(args)
        out["_meta"]["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(out["_meta"]))
        if args.json:
            args.json.write_text(json.dumps(out, indent=1) + "\n")
        return 0
    from cs_oracles import halves, hear  # the bench folder is this script's sys.path[0]
    from tqdm import tqdm

    from empatheia_jax.data.encoders import asr
    from empatheia_jax.data.targets import TargetReader
    from empatheia_jax.generators import kokoro
    from empatheia_jax.generators.kokoro_speech import KokoroSpeech
    from empatheia_jax.train import losses

    t0 = time.perf_counter()
    train = _load(args.raw, args.targets, "train", args.rows)
    dev = _load(args.raw, args.targets, "dev", args.rows, args.dev)
    weight = np.ones(kokoro.CONTENT_DIM, np.float32)
    if args.scale == "balanced":  # loss.ccl_scale=balanced: each dimension an equal share of the mean's loss
        rows, mask = train[3], train[4]
        n = mask.sum()
        mean = np.einsum("nqd,nq->d", rows, mask, dtype=np.float64) / n
        sq = np.einsum("nqd,nq->d", rows.astype(np.float32) ** 2, mask, dtype=np.float64) / n
        weight = losses.balanced_dim_weights(np.maximum(sq - mean**2, 0.0))
    reader = TargetReader(args.targets)
    # the per-unit mean of the train rows (bench/cs_oracles.py's unit_mean), its L2 on the same dev rows
    units, rows, mask = train[2], train[3], train[4]
    unit_sum = np.zeros((KokoroSpeech.num_units, rows.shape[-1]))
    np.add.at(unit_sum, units[mask], rows[mask].astype(np.float64))
    unit_n = np.bincount(units[mask], minlength=KokoroSpeech.num_units)[:, None]
    unit_mean = (unit_sum / np.maximum(unit_n, 1)).astype(np.float32)
    out = {"unit_mean": _half_l2(unit_mean[dev[2]], dev[3], dev[4])}
    print(f"unit_mean: {json.dumps(out['unit_mean'])}", flush=True)
    for conv in (int(c) for c in args.conv.split(",")):
        name = (f"conv{conv}" + ("_balanced" if args.scale == "balanced" else "")
                + ("_context" if args.context else ""))
        preds, l2 = _train(conv, train, dev, args.steps, args.batch, args.seed, weight, context=args.context,
                           lr=args.lr)
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            np.savez(args.save / f"{name}.npz", pred=preds.astype(np.float16), uid=np.array(dev[1]),
                     units=dev[2], mask=dev[4])
        # which half of a row the errors that are heard sit in: the predicted t_en with the gold d_en
        # (which drives the durations and the prosody), and the other way round
        mixes = {"": lambda p, g: p, "_gold_d_en": halves, "_gold_t_en": lambda p, g: halves(g, p)}
        refs, heard = [], {m: [] for m in (mixes if args.mix else [""])}
        for i in tqdm(range(min(args.replies, len(preds))), desc=f"conv {conv}: speak, hear", unit="reply"):
            n = int(dev[4][i].sum())
            gold, style = dev[3][i, :n].astype(np.float32), reader.get("speech_style", dev[1][i])
            refs.append(dev[0][i])
            for m in heard:
                heard[m].append(hear(mixes[m](preds[i, :n], gold), style))
            if args.save:
                print(f"  {dev[0][i]!r} -> {heard[''][-1]!r}", flush=True)
        out[name] = dict(l2)
        for m, said in heard.items():
            out[name].update({f"speech_wer{m}": asr.word_error_rate(refs, said),
                                       f"speech_cer{m}": asr.char_error_rate(refs, said)})
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    out["_meta"] = {"train_replies": len(train[0]), "dev_rows_of": len(dev[0]), "heard": args.replies,
                    "steps": args.steps, "batch": args.batch, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out["_meta"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
