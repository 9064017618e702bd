"""Loss terms against independent numpy references, masks honoured, and the stage combinations of eqs 8-13."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from empatheia_jax.train import losses
from empatheia_jax.train.losses import LossWeights, combine


def _np_log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_token_cross_entropy_matches_numpy_on_target_tokens_only():
    rng = np.random.default_rng(0)
    b, t, v = 2, 5, 11
    logits = rng.normal(size=(b, t, v)).astype(np.float32) * 3
    ids = rng.integers(0, v, size=(b, t)).astype(np.int32)
    mask = np.array([[0, 1, 1, 0, 0], [1, 1, 1, 1, 0]], np.int32)
    ids[0, 4] = 10_000  # an out-of-range pad id at a masked position must not matter
    mean, n = losses.token_cross_entropy(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(mask))
    lp = _np_log_softmax(logits)
    picked = [-lp[i, j, ids[i, j]] for i in range(b) for j in range(t) if mask[i, j]]
    assert int(n) == 6
    np.testing.assert_allclose(float(mean), np.mean(picked), rtol=1e-5)
    # Changing logits/targets at masked positions changes nothing; at a target position it does.
    logits2, ids2 = logits.copy(), ids.copy()
    logits2[0, 0] += 50.0
    ids2[1, 4] = 3
    same, _ = losses.token_cross_entropy(jnp.asarray(logits2), jnp.asarray(ids2), jnp.asarray(mask))
    assert float(same) == float(mean)
    logits2[0, 1, ids[0, 1]] += 5.0
    lower, _ = losses.token_cross_entropy(jnp.asarray(logits2), jnp.asarray(ids2), jnp.asarray(mask))
    assert float(lower) < float(mean)
    # No target token: 0, not NaN; bf16 logits give a float32 loss.
    zero, n0 = losses.token_cross_entropy(jnp.asarray(logits), jnp.asarray(ids), jnp.zeros((b, t), jnp.int32))
    assert float(zero) == 0.0 and int(n0) == 0
    bf, _ = losses.token_cross_entropy(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(mask))
    assert bf.dtype == jnp.float32
    np.testing.assert_allclose(float(bf), float(mean), rtol=2e-2)


def test_masked_squared_l2_is_a_mean_over_valid_rows():
    rng = np.random.default_rng(1)
    pred = rng.normal(size=(2, 4, 3)).astype(np.float32)
    target = rng.normal(size=(2, 4, 3)).astype(np.float32)
    mask = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], bool)
    got = float(losses.masked_squared_l2(jnp.asarray(pred), jnp.asarray(target), jnp.asarray(mask)))
    rows = [np.sum((pred[i, j].astype(np.float64) - target[i, j]) ** 2) for i in range(2) for j in range(4)
            if mask[i, j]]
    np.testing.assert_allclose(got, sum(rows) / 3, rtol=1e-6)
    target2 = target.copy()
    target2[0, 3] = np.nan  # padding may hold anything
    target2[1, 1:] = 1e30
    same = losses.masked_squared_l2(jnp.asarray(pred), jnp.asarray(target2), jnp.asarray(mask))
    assert float(same) == got
    grad = jax.grad(lambda p: losses.masked_squared_l2(p, jnp.asarray(target2), jnp.asarray(mask)))(
        jnp.asarray(pred)
    )
    assert np.isfinite(np.asarray(grad)).all() and not np.asarray(grad)[~mask].any()
    none = losses.masked_squared_l2(jnp.asarray(pred), jnp.asarray(target), jnp.zeros((2, 4), bool))
    assert float(none) == 0.0


def test_dim_weights_weigh_each_dimension_and_balanced_weights_share_the_mean_loss_equally():
    """masked_squared_l2's dim_weight against numpy; balanced_dim_weights keeps the mean predictor's loss at
    eq 9's (the summed variance), gives every dimension the same share of it, caps a quiet dimension at
    1/BALANCE_FLOOR, and refuses what is not a variance."""
    rng = np.random.default_rng(7)
    pred = rng.normal(size=(2, 4, 3)).astype(np.float32)
    target = rng.normal(size=(2, 4, 3)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    w = np.array([0.5, 2.0, 10.0], np.float32)
    got = float(losses.masked_squared_l2(jnp.asarray(pred), jnp.asarray(target), jnp.asarray(mask),
                                         dim_weight=tuple(float(x) for x in w)))
    want = np.sum(((pred - target) ** 2 * w)[mask]) / mask.sum()
    np.testing.assert_allclose(got, want, rtol=1e-6)

    rows = rng.normal(size=(5000, 4)) * np.array([0.3, 1.0, 3.0, 0.5]) + 2.0  # spreads as t_en vs d_en
    var = rows.var(0)
    bw = losses.balanced_dim_weights(var)
    shares = bw * var
    np.testing.assert_allclose(shares, var.sum() / 4, rtol=1e-6)  # equal shares ...
    np.testing.assert_allclose(shares.sum(), var.sum(), rtol=1e-6)  # ... of eq 9's mean-predictor loss
    mean_pred = np.broadcast_to(rows.mean(0), rows.shape)
    balanced = float(losses.masked_squared_l2(jnp.asarray(mean_pred[None], jnp.float32),
                                              jnp.asarray(rows[None], jnp.float32), jnp.ones((1, 5000), bool),
                                              dim_weight=tuple(bw.tolist())))
    np.testing.assert_allclose(balanced, var.sum(), rtol=1e-4)
    capped = losses.balanced_dim_weights(np.array([0.0, 1.0, 1.0, 2.0]))  # a constant dimension
    assert capped[0] == pytest.approx(1.0 / losses.BALANCE_FLOOR) and capped[1] == pytest.approx(1.0)
    assert np.all(losses.balanced_dim_weights(np.zeros(3)) == 1.0)
    for bad in (np.array([1.0, -1.0]), np.array([np.nan, 1.0]), np.zeros((2, 2))):
        with pytest.raises(ValueError, match="variance must be"):
            losses.balanced_dim_weights(bad)
    weights = LossWeights(ccl_dims=(("speech_content", (1.0, 2.0)),))
    assert weights.dim_weight("speech_content") == (1.0, 2.0) and weights.dim_weight("video_content") is None
    assert hash(weights) == hash(LossWeights(ccl_dims=(("speech_content", (1.0, 2.0)),)))


def test_squared_l2_per_example():
    rng = np.random.default_rng(2)
    pred = rng.normal(size=(3, 5)).astype(np.float32)
    target = rng.normal(size=(3, 5)).astype(np.float32)
    mask = np.array([1, 0, 1], np.int32)
    got = float(losses.squared_l2(jnp.asarray(pred), jnp.asarray(target), jnp.asarray(mask)))
    want = (np.sum((pred[0] - target[0]) ** 2) + np.sum((pred[2] - target[2]) ** 2)) / 2
    np.testing.assert_allclose(got, want, rtol=1e-6)
    target[1] += 100.0
    assert float(losses.squared_l2(jnp.asarray(pred), jnp.asarray(target), jnp.asarray(mask))) == got


def test_classification_ce_sign_and_ignore():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 7)).astype(np.float32)
    labels = np.array([2, -1, 6, 0], np.int32)
    got = float(losses.classification_ce(jnp.asarray(logits), jnp.asarray(labels)))
    lp = _np_log_softmax(logits)
    want = -np.mean([lp[0, 2], lp[2, 6], lp[3, 0]])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got > 0
    # The ignored example's logits do not matter; raising the right logit lowers the loss.
    logits2 = logits.copy()
    logits2[1] = 100.0 * rng.normal(size=7)
    assert float(losses.classification_ce(jnp.asarray(logits2), jnp.asarray(labels))) == pytest.approx(got)
    logits2[0, 2] += 2.0
    assert float(losses.classification_ce(jnp.asarray(logits2), jnp.asarray(labels))) < got
    # Its gradient descends towards the right class (the paper's sign would ascend).
    g = jax.grad(lambda x: losses.classification_ce(x, jnp.asarray(labels)))(jnp.asarray(logits))
    assert float(g[0, 2]) < 0 and float(g[1].sum()) == 0.0
    all_unknown = losses.classification_ce(jnp.asarray(logits), jnp.full((4,), -1, jnp.int32))
    assert float(all_unknown) == 0.0


def test_kl_term_is_the_vae_kl_averaged_over_examples():
    rng = np.random.default_rng(4)
    mu = rng.normal(size=(3, 4, 2)).astype(np.float32)
    logvar = rng.normal(size=(3, 4, 2)).astype(np.float32) * 0.5
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    per_query = 0.5 * np.sum(mu.astype(np.float64) ** 2 + np.exp(logvar) - 1 - logvar, -1)
    want = (per_query[0].mean() + per_query[1, 0]) / 2  # the example without a valid query is left out
    got = float(losses.kl_term(jnp.asarray(mu), jnp.asarray(logvar), jnp.asarray(mask)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(
        float(losses.kl_term(jnp.asarray(mu), jnp.asarray(logvar))), per_query.mean(), rtol=1e-5
    )


TERMS = {
    losses.EMP: 2.0, losses.SIGNAL_CE: 0.7, losses.CCL_SPEECH: 3.0, losses.CCL_VIDEO: 5.0,
    losses.SAL_SPEECH: 0.25, losses.SAL_VIDEO: 0.5, losses.CLS_EMOTION: 1.5, losses.CLS_AGE: 0.1,
    losses.CLS_GENDER: 0.2, losses.CLS_TIMBRE: 0.3, losses.KL: 4.0,
}


def test_combine_by_hand():
    w = LossWeights(alpha=0.2, beta=0.3, kl=0.01)
    t = {k: jnp.float32(v) for k, v in TERMS.items()}
    ccl, sal, cls = 3.0 + 5.0, 0.25 + 0.5, 1.5 + 0.1 + 0.2 + 0.3
    expected = {
        "coe": 2.0,
        "ccl": ccl + 0.01 * 4.0,
        "sac": sal + cls + 0.7 + 0.01 * 4.0,
        "overall": 2.0 + 0.2 * ccl + 0.3 * (sal + cls) + 0.01 * 4.0,
    }
    for stage, want in expected.items():
        total, metrics = combine(t, stage, w)
        np.testing.assert_allclose(float(total), want, rtol=1e-6, err_msg=stage)
        assert float(metrics["total"]) == float(total)
        for name, value in TERMS.items():  # every term is reported, used by the stage or not
            np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-6)
        np.testing.assert_allclose(float(metrics["ccl"]), ccl, rtol=1e-6)
        np.testing.assert_allclose(float(metrics["sac"]), sal + cls, rtol=1e-6)
    # alpha and beta act exactly where eq 13 puts them.
    base, _ = combine(t, "overall", LossWeights(alpha=0.0, beta=0.0, kl=0.0))
    np.testing.assert_allclose(float(base), 2.0, rtol=1e-6)
    only_a, _ = combine(t, "overall", LossWeights(alpha=1.0, beta=0.0, kl=0.0))
    np.testing.assert_allclose(float(only_a) - 2.0, ccl, rtol=1e-6)
    only_b, _ = combine(t, "overall", LossWeights(alpha=0.0, beta=1.0, kl=0.0))
    np.testing.assert_allclose(float(only_b) - 2.0, sal + cls, rtol=1e-6)
    default, _ = combine(t, "overall")
    np.testing.assert_allclose(float(default), 2.0 + 0.2 * ccl + 0.3 * (sal + cls) + 1e-3 * 4.0, rtol=1e-6)


def test_combine_is_strict():
    t = dict(TERMS)
    for stage, needed in losses.STAGE_TERMS.items():
        for name in needed:
            partial = {k: v for k, v in t.items() if k != name}
            with pytest.raises(KeyError, match=name):
                combine(partial, stage)
    assert combine({losses.EMP: 1.0}, "coe")[0] == 1.0  # a stage needs only its own terms
    with pytest.raises(KeyError, match="unknown"):
        combine({**t, "ccl_speach": 1.0}, "overall")
    with pytest.raises(ValueError, match="stage"):
        combine(t, "stage5")


def test_combine_under_jit_and_grad():
    def f(x):
        terms = {k: x * v for k, v in TERMS.items()}
        return combine(terms, "overall")[0]

    g = jax.jit(jax.grad(f))(jnp.float32(1.0))
    ccl, sal, cls = 8.0, 0.75, 2.1
    np.testing.assert_allclose(float(g), 2.0 + 0.2 * ccl + 0.3 * (sal + cls) + 1e-3 * 4.0, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# Global counts (gradient accumulation)
# ----------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _accumulate(fn, count_fn, count_idx, args):
    """The whole batch of 4 vs 4 micro-batches of 1 (vmapped, so one compile per function)."""
    micro = [a.reshape(4, 1, *a.shape[1:]) for a in args]
    count = count_fn(args[count_idx])

    def part(x, *rest, count=count):
        return fn(x, *rest, count=count)

    full, g_full = jax.value_and_grad(lambda x: fn(x, *args[1:]))(args[0])
    return {
        "full": full, "g_full": g_full, "count": count,
        "micro_counts": jax.vmap(count_fn)(micro[count_idx]),
        "parts": jax.vmap(part)(*micro),
        "g_parts": jax.vmap(jax.grad(part))(*micro).reshape(args[0].shape),
        "naive": jnp.mean(jax.vmap(fn)(*micro)),  # the mean of local means: what accumulation must not do
        # Example 1 has no valid item: alone with a count of 0 (a whole batch without items).
        "empty": part(*(m[1] for m in micro), count=jnp.int32(0)),
        "g_empty": jax.grad(part)(*(m[1] for m in micro), count=jnp.int32(0)),
    }


def _check_additive(fn, args, count_fn, count_idx):
    r = _accumulate(fn, count_fn, count_idx, tuple(jnp.asarray(a) for a in args))
    assert int(r["count"]) == int(np.sum(r["micro_counts"]))  # counts are additive
    parts = np.asarray(r["parts"])
    assert parts[1] == 0.0 and np.isfinite(parts).all()  # the empty micro-batch adds exactly 0
    np.testing.assert_allclose(parts.sum(), float(r["full"]), rtol=1e-5)
    assert abs(float(r["naive"]) - float(r["full"])) > 1e-3 * abs(float(r["full"]))  # the check can fail
    np.testing.assert_allclose(np.asarray(r["g_parts"]), np.asarray(r["g_full"]), rtol=1e-5, atol=1e-7)
    assert float(r["empty"]) == 0.0
    assert np.isfinite(np.asarray(r["g_empty"])).all() and not np.asarray(r["g_empty"]).any()


def _ce_mean(logits, ids, mask, count=None):
    return losses.token_cross_entropy(logits, ids, mask, count=count)[0]


def test_mean_functions_with_a_global_count_add_up_over_micro_batches():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, 5, 11)).astype(np.float32) * 2
    ids = rng.integers(0, 11, size=(4, 5)).astype(np.int32)
    tok_mask = np.array([[1, 1, 0, 0, 0], [0] * 5, [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]], np.int32)
    _check_additive(_ce_mean, (logits, ids, tok_mask), losses.masked_count, 2)

    pred = rng.normal(size=(4, 6, 3)).astype(np.float32)
    target = rng.normal(size=(4, 6, 3)).astype(np.float32)
    row_mask = np.array([[1] * 6, [0] * 6, [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]], bool)
    _check_additive(losses.masked_squared_l2, (pred, target, row_mask), losses.masked_count, 2)

    ex_mask = np.array([1, 0, 1, 1], np.int32)
    _check_additive(losses.squared_l2, (pred[:, 0], target[:, 0], ex_mask), losses.masked_count, 2)

    labels = np.array([2, -1, 6, -1], np.int32)
    cls_logits = rng.normal(size=(4, 7)).astype(np.float32)
    _check_additive(losses.classification_ce, (cls_logits, labels), losses.label_count, 1)

    mu = rng.normal(size=(4, 6, 2)).astype(np.float32)
    logvar = rng.normal(size=(4, 6, 2)).astype(np.float32) * 0.5
    _check_additive(losses.kl_term, (mu, logvar, row_mask), losses.kl_count, 2)
    # Without a mask the denominator is the number of examples; a Python int count works.
    whole = losses.kl_term(jnp.asarray(mu), jnp.asarray(logvar))
    split = losses.kl_term(jnp.asarray(mu[:1]), jnp.asarray(logvar[:1]), count=4) + losses.kl_term(
        jnp.asarray(mu[1:]), jnp.asarray(logvar[1:]), count=4)
    np.testing.assert_allclose(float(split), float(whole), rtol=1e-6)
    # The counts accept extra leading axes ([A, m, ...]) with the same totals.
    assert int(losses.kl_count(row_mask.reshape(2, 2, 6))) == int(losses.kl_count(row_mask)) == 3
    assert int(losses.label_count(labels.reshape(2, 2))) == 2
    assert int(losses.masked_count(tok_mask.reshape(2, 2, 5))) == 9
