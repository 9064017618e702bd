"""`eval.emotion_head`: the probe against scikit-learn's own fit, the combined decision against a hand
computation on rigged inputs, the weight choice, the file round trip and its errors, and
`fit_emotion_head weights` on a rigged predictions file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from empatheia_jax.data import schema
from empatheia_jax.eval import emotion_head as eh
from empatheia_jax.eval import fit_emotion_head

K = len(schema.ED_EMOTIONS_32)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def test_combined_decision_equals_a_hand_computation():
    """Three rows: the head alone, the scored step alone and the free step each pick a different label; the
    combination is argmax(hw * head + log_softmax(scored) + fw * [free]); a NaN scored row votes without."""
    head = np.full((3, K), np.log(0.5 / (K - 1)))
    head[:, 4] = np.log(0.5)  # the head: label 4 at p=0.5, the rest share 0.5
    scored = np.zeros((3, K))
    scored[0, 7] = 3.0  # scored step: label 7 (raw log-likelihoods; only their softmax counts)
    scored[1] = scored[0] - 50.0  # the same preference, shifted: softmax is shift-invariant
    scored[2] = np.nan  # no step 2 to score
    free = np.array([9, 9, -1])

    def by_hand(hw, fw):
        out = []
        for r in range(3):
            s = np.zeros(K) if np.isnan(scored[r]).all() else _log_softmax(scored[r])
            total = hw * head[r] + s
            if free[r] >= 0:
                total[free[r]] += fw
            out.append(int(np.argmax(total)))
        return out

    # log_softmax(scored)[7] - [4] = 3; head[4] - head[7] = log(0.5) - log(0.5/31) = log 31 = 3.43
    for hw, fw in [(0.0, 0.0), (0.5, 0.0), (1.0, 0.0), (2.0, 0.0), (0.0, 4.0), (1.0, 3.2), (0.5, 10.0)]:
        got = eh.combine(head, scored, free, hw, fw).tolist()
        assert got == by_hand(hw, fw), (hw, fw)
    assert eh.combine(head, scored, free, 0.0, 0.0).tolist()[:2] == [7, 7]  # the scored step alone
    assert eh.combine(head, scored, free, 1.0, 0.0).tolist() == [4, 4, 4]  # log 31 > 3: the head wins
    assert eh.combine(head, scored, free, 0.5, 0.0).tolist()[:2] == [7, 7]  # 1.71 < 3
    assert eh.combine(head, scored, free, 0.0, 4.0).tolist()[:2] == [9, 9]  # the free step's bonus wins
    with pytest.raises(ValueError, match="differ"):
        eh.combine(head, scored[:2], free, 1.0, 1.0)


def test_choose_weights_takes_the_most_accurate_pair_and_the_smaller_on_ties():
    rng = np.random.default_rng(0)
    n = 40
    gold = rng.integers(0, K, n)
    head = _log_softmax(rng.normal(size=(n, K)))
    head[np.arange(n)[:20], gold[:20]] += 6.0  # the head knows the first half
    scored = rng.normal(size=(n, K))
    scored[np.arange(n)[20:], gold[20:]] += 2.0  # the scored step knows the second half, less surely
    free = np.full(n, -1)
    (hw, fw), table = eh.choose_weights(head, scored, free, gold)
    assert table[(hw, fw)] == max(table.values())
    for w, acc in table.items():
        assert acc == pytest.approx(np.mean(eh.combine(head, scored, free, *w) == gold))
    assert table[(hw, fw)] > max(table[(0.0, 0.0)], table[(4.0, 0.0)])  # both experts beat either alone
    assert fw == 0.0  # no free step: every free weight ties; the smallest is kept


def test_the_cross_fitted_figure_judges_each_record_by_weights_it_did_not_choose():
    """Four records the free step gets right against a head that leans away by 0.1 nats, one the head gets
    right by 5 nats against the free step (gold 2 throughout, nothing scored). Chosen on all five, the
    weights (0.25, 0.5) get every record right; the fold of the fifth record chooses on the other four alone,
    whose first perfect pair in grid order is (0, 0.5), and that pair gets the fifth wrong: 4 of 5."""
    head = np.full((5, K), -10.0)
    head[:4, 3], head[:4, 2] = -1.0, -1.1
    head[4, 2], head[4, 3] = -1.0, -6.0
    scored = np.full((5, K), np.nan)
    free, gold = np.array([2, 2, 2, 2, 3]), np.full(5, 2)
    (hw, fw), table = eh.choose_weights(head, scored, free, gold)
    assert (hw, fw) == (0.25, 0.5) and table[(hw, fw)] == 1.0
    assert eh.choose_weights(head[:4], scored[:4], free[:4], gold[:4])[0] == (0.0, 0.5)
    assert eh.cross_fitted_accuracy(head, scored, free, gold) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="fewer than 5 folds"):
        eh.cross_fitted_accuracy(head[:4], scored[:4], free[:4], gold[:4])


def test_the_probe_is_sklearns_multinomial_fit_with_unseen_labels_ruled_out():
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(1)
    labels = np.array([2, 5, 11])
    centres = rng.normal(scale=3.0, size=(3, 6))
    y = np.repeat(labels, 30)
    x = centres[np.repeat(np.arange(3), 30)] + rng.normal(size=(90, 6)) + 10.0  # off-centre: scaled
    head = eh.fit_probe(x, y, c=0.5)
    logp = head.log_probs(x)
    np.testing.assert_allclose(np.exp(logp).sum(-1), 1.0, atol=1e-9)
    z = (x - x.mean(0)) / x.std(0)
    want = LogisticRegression(C=0.5, max_iter=2000).fit(z, y).predict_proba(z)
    np.testing.assert_allclose(np.exp(logp[:, labels]), want, atol=1e-6)
    assert (logp[:, np.setdiff1d(np.arange(K), labels)] < -25).all()  # never seen: never chosen
    with pytest.raises(ValueError, match="single label"):
        eh.fit_probe(x[:30], y[:30], c=1.0)
    with pytest.raises(ValueError, match="ED emotion index"):
        eh.fit_probe(x, np.where(y == 2, 40, y), c=1.0)
    with pytest.raises(eh.EmotionHeadError, match="reads 6 features"):
        head.log_probs(x[:, :4])


def test_fit_head_keeps_the_c_with_the_best_dev_accuracy():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(200, 20))
    y = (x[:, 0] > 0).astype(int) * 3 + (x[:, 1] > 0)  # labels 0, 1, 3, 4 from two features
    head, by_c = eh.fit_head(x[:120], y[:120], x[120:], y[120:], grid=(1e-4, 0.1, 1.0))
    for c, acc in by_c.items():
        assert acc == pytest.approx(np.mean(eh.fit_probe(x[:120], y[:120], c).log_probs(x[120:]).argmax(-1)
                                            == y[120:]))
    assert by_c[head.c] == max(by_c.values()) and by_c[head.c] > 0.7
    assert head.c == min(c for c, a in by_c.items() if a == max(by_c.values()))


def test_the_head_file_round_trips_and_refuses_what_is_not_a_head(tmp_path):
    rng = np.random.default_rng(3)
    head = eh.fit_probe(rng.normal(size=(40, 5)), rng.integers(0, 4, 40), c=1.0).with_weights(0.5, 2.0)
    path = tmp_path / eh.FILE_NAME
    head.save(path)
    back = eh.EmotionHead.load(path)
    assert (back.c, back.head_weight, back.free_weight) == (1.0, 0.5, 2.0)
    x = rng.normal(size=(7, 5))
    np.testing.assert_allclose(back.log_probs(x), head.log_probs(x), atol=1e-4)  # stored float32
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage")
    with pytest.raises(eh.EmotionHeadError, match="not a readable safetensors"):
        eh.EmotionHead.load(bad)
    from safetensors.numpy import save_file

    save_file({"coef": np.zeros((K, 3), np.float32)}, str(bad))
    with pytest.raises(eh.EmotionHeadError, match="not an emotion head"):
        eh.EmotionHead.load(bad)
    tensors = {k: np.asarray(getattr(head, k), np.float32) for k in ("mean", "scale", "coef", "intercept")}
    save_file(tensors, str(bad), metadata={"emotion_head": json.dumps({"c": 1.0, "labels": ["sad"]})})
    with pytest.raises(eh.EmotionHeadError, match="32 ED emotions"):
        eh.EmotionHead.load(bad)


def test_fit_emotion_head_weights_chooses_on_the_dev_predictions(tmp_path, capsys):
    """`fit_emotion_head weights`: reads an eval's predictions (rigged here), writes the chosen weights into
    the head file, and says what each decision alone scores; a file without head fields is one error line."""
    rng = np.random.default_rng(4)
    head = eh.fit_probe(rng.normal(size=(40, 5)), rng.integers(0, 4, 40), c=1.0)
    path = tmp_path / eh.FILE_NAME
    head.save(path)
    n = 30
    gold = rng.integers(0, K, n)
    head_lp = _log_softmax(rng.normal(size=(n, K)))
    head_lp[np.arange(15), gold[:15]] += 5.0
    scored = rng.normal(size=(n, K))
    scored[np.arange(15, n), gold[15:]] += 4.0
    preds = [{"record_index": i, "labels": {"emotion_fine": int(gold[i])}, "emotion_fine": int(gold[i]) if
              i % 3 == 0 else -1, "emotion_head_logprobs": head_lp[i].round(4).tolist(),
              "emotion_fine_scored": -1 if i == 7 else int(np.argmax(scored[i])),
              **({"emotion_label_logprobs": scored[i].round(4).tolist()} if i != 7 else {})}
             for i in range(n)]
    file = tmp_path / "predictions_coe.jsonl"
    file.write_text("".join(json.dumps(p) + "\n" for p in preds))
    summary_path = tmp_path / "weights.json"
    assert fit_emotion_head.main(["weights", "--head", str(path), "--predictions", str(file),
                                  "--json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    a = eh.prediction_arrays(preds)
    assert np.isnan(a["scored"][7]).all() and not np.isnan(a["scored"][6]).any()
    (hw, fw), table = eh.choose_weights(a["head"], a["scored"], a["free"], a["gold"])
    assert (summary["head_weight"], summary["free_weight"]) == (hw, fw)
    assert summary["emotion32_acc_combined"] == pytest.approx(table[(hw, fw)])
    assert summary["emotion32_acc_combined_cv"] == pytest.approx(eh.cross_fitted_accuracy(
        a["head"], a["scored"], a["free"], a["gold"]))
    assert summary["scored_records"] == n - 1
    assert summary["alone"]["free"] == pytest.approx(np.mean(a["free"] == gold))
    assert summary["alone"]["head"] == pytest.approx(np.mean(head_lp.argmax(-1) == gold))
    scored_choice = [p["emotion_fine_scored"] for p in preds]  # row 7 unscored (-1): wrong, as eval counts it
    assert summary["alone"]["scored"] == pytest.approx(np.mean(np.asarray(scored_choice) == gold))
    back = eh.EmotionHead.load(path)
    assert (back.head_weight, back.free_weight) == (hw, fw)
    np.testing.assert_allclose(back.coef, head.coef, atol=1e-6)  # the probe itself is unchanged
    unscored = [{k: v for k, v in p.items() if "scored" not in k and k != "emotion_label_logprobs"}
                for p in preds]
    file.write_text("".join(json.dumps(p) + "\n" for p in unscored))
    assert fit_emotion_head.main(["weights", "--head", str(path), "--predictions", str(file)]) == 2
    assert "evaluate with --score_emotions" in capsys.readouterr().err
    file.write_text(json.dumps({"record_index": 0, "labels": {}}) + "\n")
    assert fit_emotion_head.main(["weights", "--head", str(path), "--predictions", str(file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "emotion_head_logprobs" in err and "Traceback" not in err
