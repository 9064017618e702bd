"""The transformer-VAE block: KL, reparameterisation, masking, gradients, dtypes, sharding and learning.

References are independent numpy computations. XLA compilation is most of this file's cost on CPU, so the
model is tiny, every test uses the same batch shape [B, L] and the jitted forward / gradient functions
are shared between tests (one compile each).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import require

from empatheia_jax import sharding
from empatheia_jax.models.vae import TransformerVAE, VAEConfig, VAEOutput, kl_divergence

CFG = VAEConfig(
    d_in=12, d_model=32, num_queries=5, d_latent=6, d_out=7, num_heads=4, enc_layers=1, dec_layers=1,
    mlp_ratio=2.0,
)  # one layer each keeps compile time down; the default depth is checked by shapes
B, L = 32, 9
KL_W = jnp.float32(1e-3)


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _build(cfg: VAEConfig) -> TransformerVAE:
    # An rbg key halves the cost of initialising (fewer threefry kernels to compile); values are irrelevant.
    return TransformerVAE(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))


@pytest.fixture(scope="module")
def model() -> TransformerVAE:
    return _build(CFG)


@functools.partial(jax.jit, static_argnames=("graphdef", "sample"))
def _apply_jit(graphdef, state, h, mask, rng, *, sample):
    return nnx.merge(graphdef, state)(h, mask, sample=sample, rng=rng)


def run(model: TransformerVAE, h, mask, *, sample: bool = False, rng=None) -> VAEOutput:
    graphdef, state = nnx.split(model)
    return _apply_jit(graphdef, state, jnp.asarray(h), jnp.asarray(mask), rng, sample=sample)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _grad_jit(graphdef, params, h, mask, target, rng, kl_weight):
    """Gradient of mean squared error + kl_weight * KL, sampled (the training path).

    Always call it with the same argument kinds (kl_weight a float32 array, positional): one compile.
    """

    def loss(params):
        o = nnx.merge(graphdef, params)(h, mask, sample=True, rng=rng)
        return jnp.mean((o.out - target) ** 2) + kl_weight * jnp.mean(kl_divergence(o.mu, o.logvar))

    return jax.grad(loss)(params)


def _inputs(seed: int = 1):
    """h [B, L, d_in] and a mask with the interesting rows first: full, right-padded, padded both sides."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(B, L, CFG.d_in)).astype(np.float32)
    mask = np.zeros((B, L), bool)
    mask[0] = True
    mask[1, :4] = True
    mask[2, 3:7] = True
    for b in range(3, B):  # the rest: >= num_queries valid rows at a random offset
        n = rng.integers(CFG.num_queries, L + 1)
        start = rng.integers(0, L - n + 1)
        mask[b, start : start + n] = True
    return h, mask


def _np_kl(mu, logvar, mask):
    """Closed form KL(N(mu, s^2) || N(0,1)) = -log s + (s^2 + mu^2)/2 - 1/2 per dim, written differently."""
    s = np.exp(0.5 * logvar.astype(np.float64))
    per_dim = -np.log(s) + (s**2 + mu.astype(np.float64) ** 2) / 2.0 - 0.5
    per_query = per_dim.sum(-1)
    out = np.zeros(mu.shape[0])
    for b in range(mu.shape[0]):
        valid = per_query[b][mask[b]]
        out[b] = valid.mean() if valid.size else 0.0
    return out


def test_kl_matches_closed_form():
    rng = np.random.default_rng(0)
    mu = rng.normal(size=(4, 5, 6)).astype(np.float32)
    logvar = rng.normal(scale=0.7, size=(4, 5, 6)).astype(np.float32)
    mask = np.ones((4, 5), bool)
    mask[1, 3:] = False
    mask[3] = False  # no valid query -> 0
    got = np.asarray(kl_divergence(jnp.asarray(mu), jnp.asarray(logvar), jnp.asarray(mask)))
    np.testing.assert_allclose(got, _np_kl(mu, logvar, mask), rtol=1e-5, atol=1e-6)
    assert got[3] == 0.0
    full = np.asarray(kl_divergence(jnp.asarray(mu), jnp.asarray(logvar)))
    np.testing.assert_allclose(full, _np_kl(mu, logvar, np.ones((4, 5), bool)), rtol=1e-5)
    # KL is 0 exactly at the prior and positive elsewhere.
    zero = kl_divergence(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 4)))
    np.testing.assert_array_equal(np.asarray(zero), 0.0)


def test_shapes_and_dtypes(model):
    h, mask = _inputs()
    out = run(model, h, mask)
    assert out.out.shape == (B, CFG.num_queries, CFG.d_out)
    for a in (out.mu, out.logvar, out.z):
        assert a.shape == (B, CFG.num_queries, CFG.d_latent)
    for a in (out.out, out.mu, out.logvar, out.z):
        assert a.dtype == jnp.float32
        assert np.isfinite(np.asarray(a)).all()


def test_reparameterisation_uses_documented_eps(model):
    h, mask = _inputs()
    key = jax.random.key(42)
    out = run(model, h, mask, sample=True, rng=key)
    eps_key, _ = jax.random.split(key)
    eps = np.asarray(jax.random.normal(eps_key, out.mu.shape, jnp.float32))
    expected = np.asarray(out.mu) + np.exp(0.5 * np.asarray(out.logvar)) * eps
    np.testing.assert_allclose(np.asarray(out.z), expected, rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(out.z), np.asarray(out.mu))
    # Another key gives another sample; the same key the same one.
    other = run(model, h, mask, sample=True, rng=jax.random.key(43))
    again = run(model, h, mask, sample=True, rng=key)
    assert not np.allclose(np.asarray(other.z), np.asarray(out.z))
    np.testing.assert_array_equal(np.asarray(again.z), np.asarray(out.z))
    with pytest.raises(ValueError, match="rng"):
        model(jnp.asarray(h), jnp.asarray(mask), sample=True)


def test_eval_is_mu_and_deterministic(model):
    h, mask = _inputs()
    a = run(model, h, mask)
    b = run(model, h, mask)
    np.testing.assert_array_equal(np.asarray(a.z), np.asarray(a.mu))
    np.testing.assert_array_equal(np.asarray(a.out), np.asarray(b.out))


def test_masked_positions_do_not_matter(model):
    h, mask = _inputs()
    base = run(model, h, mask)
    h2 = h.copy()
    h2[~mask] = np.random.default_rng(5).normal(size=(int((~mask).sum()), CFG.d_in)) * 100
    h2[1, -1] = np.nan  # even NaN/inf padding must not leak
    h2[2, 0] = np.inf
    changed = run(model, h2, mask)
    np.testing.assert_array_equal(np.asarray(changed.out), np.asarray(base.out))
    np.testing.assert_array_equal(np.asarray(changed.mu), np.asarray(base.mu))
    graphdef, params = nnx.split(model)
    target = jnp.ones((B, CFG.num_queries, CFG.d_out))
    grads = _grad_jit(graphdef, params, jnp.asarray(h2), jnp.asarray(mask), target, jax.random.key(0), KL_W)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))  # nor the gradients
    # A valid position does matter (the check above can fail), and only in its own example.
    h3 = h.copy()
    h3[1, 2] += 1.0
    moved = run(model, h3, mask)
    assert not np.allclose(np.asarray(moved.out[1]), np.asarray(base.out[1]))
    np.testing.assert_array_equal(np.asarray(moved.out[0]), np.asarray(base.out[0]))


def test_padding_side_does_not_matter(model):
    """Positions count valid rows: left and right padding of the same rows give the same result."""
    h, _ = _inputs()
    rows = h[0, :5]
    hh = np.zeros_like(h)
    mask = np.zeros((B, L), bool)
    hh[0, :5], mask[0, :5] = rows, True  # right-padded
    hh[1, 4:], mask[1, 4:] = rows, True  # left-padded
    hh[2, :5], mask[2, :5] = rows[::-1], True  # same rows, reversed order
    out = np.asarray(run(model, hh, mask).out)
    np.testing.assert_allclose(out[1], out[0], rtol=1e-5, atol=1e-5)
    # Order matters (the block is not a bag of rows), so row i can follow input row i.
    assert not np.allclose(out[2], out[0], atol=1e-4)


def test_fully_masked_rows_are_finite(model):
    h, mask = _inputs()
    mask[1] = False
    out = run(model, h, mask)
    for a in (out.out, out.mu, out.logvar):
        assert np.isfinite(np.asarray(a)).all()
    other = run(model, h * 3.0 + 1.0, mask)
    np.testing.assert_array_equal(np.asarray(other.out[1]), np.asarray(out.out[1]))
    graphdef, params = nnx.split(model)
    target = jnp.ones((B, CFG.num_queries, CFG.d_out))
    grads = _grad_jit(graphdef, params, jnp.asarray(h), jnp.asarray(mask), target, jax.random.key(0), KL_W)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_gradients_reach_queries_and_heads(model):
    h, mask = _inputs()
    graphdef, params = nnx.split(model)
    target = jnp.ones((B, CFG.num_queries, CFG.d_out))
    args = (graphdef, params, jnp.asarray(h), jnp.asarray(mask), target, jax.random.key(1))
    grads = _grad_jit(*args, KL_W)
    for name, g in (
        ("queries", grads["queries"]),
        ("mu_head", grads["mu_head"]["kernel"]),
        ("logvar_head", grads["logvar_head"]["kernel"]),
        ("in_ffn", grads["in_ffn"]["fc1"]["kernel"]),
        ("encoder cross-attention", grads["encoder"]["layers"][0]["cross_attn"]["key"]["kernel"]),
        ("z_ffn", grads["z_ffn"]["fc1"]["kernel"]),
    ):
        assert np.abs(np.asarray(g[...])).max() > 0, f"no gradient reaches {name}"
    # Without the KL, logvar can only get a gradient through the sampled z the decoder reads: this is
    # what shows the decoder decodes mu + sigma*eps, not mu.
    recon_only = _grad_jit(*args, jnp.float32(0.0))
    assert np.abs(np.asarray(recon_only["logvar_head"]["kernel"][...])).max() > 0


def test_every_parameter_has_logical_axes_known_to_the_rules(model):
    rules = dict(sharding.LOGICAL_RULES)
    params = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert leaves
    for path, var in leaves:
        names = var.get_metadata().get("out_sharding")
        where = jax.tree_util.keystr(path)
        assert names is not None and len(names) == var.ndim, f"{where}: axes {names} for shape {var.shape}"
        assert all(n in rules for n in names), f"{where}: {names} not all in LOGICAL_RULES"
        assert var.dtype == jnp.float32


def _with_config(model: TransformerVAE, cfg: VAEConfig) -> TransformerVAE:
    """The same parameters under another config of equal shapes (bf16 compute, dropout)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: _build(cfg)))
    return nnx.merge(graphdef, nnx.state(model))


def test_bf16_compute_keeps_fp32_params_and_outputs(model):
    h, mask = _inputs()
    bf16 = _with_config(model, CFG.replace(dtype="bfloat16"))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
    a = run(model, h, mask)
    b = run(bf16, h, mask)
    for x in (b.out, b.mu, b.logvar, b.z):
        assert x.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(b.out), np.asarray(a.out), atol=0.1, rtol=0.1)
    assert not np.array_equal(np.asarray(b.out), np.asarray(a.out))  # bf16 really was used


def test_unused_output_dims_are_exactly_zero_and_get_no_gradient(model):
    """d_used=k: the first k dims of every row are the full block's, the rest exactly 0 (a generator that
    reads k control dims), and the output projection's unused columns learn nothing."""
    h, mask = _inputs()
    k = 2
    used = _with_config(model, CFG.replace(d_used=k))
    full, cut = run(model, h, mask), run(used, h, mask)
    np.testing.assert_array_equal(np.asarray(cut.out[..., :k]), np.asarray(full.out[..., :k]))
    assert np.abs(np.asarray(full.out[..., k:])).min() > 0 and not np.asarray(cut.out[..., k:]).any()
    graphdef, params = nnx.split(used)
    target = jnp.ones((B, CFG.num_queries, CFG.d_out))
    grads = _grad_jit(graphdef, params, jnp.asarray(h), jnp.asarray(mask), target, jax.random.key(1), KL_W)
    kernel = np.asarray(grads["out_proj"]["kernel"][...])
    assert np.abs(kernel[:, :k]).max() > 0 and not kernel[:, k:].any()


def test_dropout_only_when_sampling(model):
    h, mask = _inputs()
    dropped = _with_config(model, CFG.replace(dropout=0.3))
    a = run(model, h, mask)
    b = run(dropped, h, mask)
    np.testing.assert_array_equal(np.asarray(b.out), np.asarray(a.out))  # eval: no dropout
    s = run(dropped, h, mask, sample=True, rng=jax.random.key(0))
    assert not np.allclose(np.asarray(s.mu), np.asarray(a.mu))  # training: dropout acted in the encoder
    plain = run(model, h, mask, sample=True, rng=jax.random.key(0))
    np.testing.assert_allclose(np.asarray(plain.mu), np.asarray(a.mu), rtol=1e-6, atol=1e-6)


def test_per_example_keys_give_an_example_the_same_noise_in_any_batch(model):
    """With keys [B] example b's eps and dropout come from keys[b] alone: the same in a batch of 1 or B."""
    h, mask = _inputs()
    dropped = _with_config(model, CFG.replace(dropout=0.3))  # dropout acts too, per example
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(B))
    big = run(dropped, h, mask, sample=True, rng=keys)
    eps = (np.asarray(big.z) - np.asarray(big.mu)) / np.exp(0.5 * np.asarray(big.logvar))
    for b in (0, 1, 2, 5):
        alone = run(dropped, h[b : b + 1], mask[b : b + 1], sample=True, rng=keys[b : b + 1])
        for name in ("out", "mu", "logvar", "z"):
            np.testing.assert_allclose(np.asarray(getattr(alone, name))[0], np.asarray(getattr(big, name))[b],
                                       rtol=1e-5, atol=1e-5, err_msg=f"{name} of example {b}")
        # The documented draw: eps[b] = normal(split(keys[b])[0], (Q, d_latent)).
        want = jax.random.normal(jax.random.split(keys[b])[0], (CFG.num_queries, CFG.d_latent))
        np.testing.assert_allclose(eps[b], np.asarray(want), rtol=1e-4, atol=1e-4)
    assert not np.allclose(eps[0], eps[3])  # examples get different noise
    assert not np.allclose(np.asarray(big.mu), np.asarray(run(model, h, mask).mu))  # dropout acted
    with pytest.raises(ValueError, match="per-example keys"):
        dropped(jnp.asarray(h[:4]), jnp.asarray(mask[:4]), sample=True, rng=keys[:3])


def test_key_helpers_accept_raw_and_per_example_keys():
    from empatheia_jax.models import vae

    raw, typed = jax.random.PRNGKey(3), jax.random.key(3)
    np.testing.assert_array_equal(vae.normal_draw(raw, (2, 3)), jax.random.normal(typed, (2, 3)))
    keys = jax.random.split(typed, 4)
    sub = vae.split_keys(keys, 3)
    assert sub.shape == (3, 4)
    for b in range(4):
        np.testing.assert_array_equal(jax.random.key_data(sub[:, b]),
                                      jax.random.key_data(jax.random.split(keys[b], 3)))
        np.testing.assert_array_equal(jax.random.key_data(vae.fold_in_keys(keys, 5)[b]),
                                      jax.random.key_data(jax.random.fold_in(keys[b], 5)))
    np.testing.assert_array_equal(vae.split_keys(jax.random.key_data(keys)).shape, (2, 4))  # raw [B, 2]
    with pytest.raises(ValueError, match="batch of keys"):
        vae.as_key(jax.random.split(typed, (2, 2)))


def test_sharded_forward_matches_single_device(model):
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    h, mask = _inputs()
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, sharding.state_shardings(state, mesh))
    kernel = state["encoder"]["layers"][0]["self_attn"]["query"]["kernel"][...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    with jax.set_mesh(mesh):
        got = _apply_jit(graphdef, state, jnp.asarray(h), jnp.asarray(mask), None, sample=False).out
    want = run(model, h, mask).out
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_config_is_validated():
    with pytest.raises(ValueError, match="num_heads"):
        CFG.replace(num_heads=5)
    with pytest.raises(ValueError, match="dropout"):
        CFG.replace(dropout=1.0)
    with pytest.raises(ValueError, match="dtype"):
        CFG.replace(dtype="int8")
    with pytest.raises(ValueError, match="enc_layers"):
        CFG.replace(enc_layers=0)
    with pytest.raises(ValueError, match=r"d_used=8 must be in \[0, d_out=7\]"):
        CFG.replace(d_used=8)


def test_default_depth_builds_four_layer_stacks():
    cfg = VAEConfig(d_in=12, d_model=32, num_queries=5, d_latent=6, d_out=7, num_heads=4)
    abstract = nnx.eval_shape(lambda: _build(cfg))
    assert len(abstract.encoder.layers) == 4 and len(abstract.decoder.layers) == 4
    assert abstract.queries.shape == (5, 32)


def test_learns_a_synthetic_row_mapping(model):
    """Target row i is a fixed nonlinear function of the i-th valid input row (padding varies per example).

    The bar is the best constant predictor (per-row mean target), not only the initial loss, so fitting
    output biases is not enough to pass. Adam, 300 steps, the sampled (training) path with a KL term.
    """
    h, mask = _inputs(seed=2)
    mask[1, :5] = True  # every example needs >= num_queries valid rows to define its targets
    mask[2, 3:8] = True
    rng = np.random.default_rng(0)
    w = rng.normal(size=(CFG.d_in, CFG.d_out)).astype(np.float32) / np.sqrt(CFG.d_in)
    target = np.stack([np.tanh(2.0 * h[b][mask[b]][: CFG.num_queries] @ w) for b in range(B)])
    constant = float(np.mean(np.sum((target - target.mean(0)) ** 2, -1)))

    def rec_loss(m):
        return float(np.mean(np.sum((np.asarray(run(m, h, mask).out) - target) ** 2, -1)))

    graphdef, params = nnx.split(model)  # arrays are immutable: training here leaves the fixture as it is
    opt = optax.adam(3e-3)

    @jax.jit
    def update(grads, opt_state, params):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    before = rec_loss(model)
    opt_state = opt.init(params)
    hj, mj, tj = jnp.asarray(h), jnp.asarray(mask), jnp.asarray(target)
    for i in range(300):
        grads = _grad_jit(graphdef, params, hj, mj, tj, jax.random.fold_in(jax.random.key(0), i), KL_W)
        params, opt_state = update(grads, opt_state, params)
    after = rec_loss(nnx.merge(graphdef, params))
    assert after <= 0.5 * before and after <= 0.5 * constant, (before, constant, after)


def test_unit_aligned_rows_learn_what_their_unit_says():
    """A unit-aligned block (num_units > 0) is told per example which unit each output row stands for, as
    the aligned Content Synchronizer is told each row's phoneme. Targets here are a fixed table of the
    row's unit (random per example and row) and h carries nothing about them: the aligned block learns the
    table far below the best constant, and a call without units is refused, not silently unaligned."""
    n_units = 11
    cfg = CFG.replace(num_units=n_units)
    aligned = _build(cfg)
    rng = np.random.default_rng(3)
    h, mask = _inputs(seed=4)
    units = rng.integers(0, n_units, size=(B, cfg.num_queries)).astype(np.int32)
    table = rng.normal(size=(n_units, cfg.d_out)).astype(np.float32)
    target = table[units]
    constant = float(np.mean(np.sum((target - target.mean((0, 1))) ** 2, -1)))
    hj, mj, uj, tj = (jnp.asarray(a) for a in (h, mask, units, target))

    def loss(params, graphdef, key):
        out = nnx.merge(graphdef, params)(hj, mj, sample=True, rng=key, units=uj)
        return jnp.mean(jnp.sum((out.out - tj) ** 2, -1)) + KL_W * jnp.mean(kl_divergence(out.mu, out.logvar))

    graphdef, params = nnx.split(aligned)
    opt = optax.adam(3e-3)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, key):
        grads = jax.grad(loss)(params, graphdef, key)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for i in range(150):
        params, opt_state = step(params, opt_state, jax.random.fold_in(jax.random.key(1), i))
    out = jax.jit(lambda p: nnx.merge(graphdef, p)(hj, mj, sample=False, units=uj).out)(params)
    after = float(jnp.mean(jnp.sum((out - tj) ** 2, -1)))
    assert after <= 0.1 * constant, (constant, after)

    with pytest.raises(ValueError, match="aligns its 5 rows to content units"):
        aligned(hj, mj, sample=False)
    with pytest.raises(ValueError, match="without unit alignment"):
        _build(CFG)(hj, mj, sample=False, units=uj)
    with pytest.raises(ValueError, match="num_units=-1"):
        CFG.replace(num_units=-1)


def test_row_convolution_is_a_zero_padded_depthwise_convolution():
    """conv_kernel=k adds, in every layer, a depthwise convolution over the query rows ('same' length, zero
    padding at both ends), checked against a numpy sum of shifted rows; its axes are in the rules table and
    a block without it has none."""
    cfg = CFG.replace(conv_kernel=3)
    block = _build(cfg)
    conv = block.encoder.layers[0].conv
    rng = np.random.default_rng(5)
    kernel = rng.normal(size=conv.kernel.shape).astype(np.float32)
    bias = rng.normal(size=conv.bias.shape).astype(np.float32)
    conv.kernel[...] = jnp.asarray(kernel)
    conv.bias[...] = jnp.asarray(bias)
    x = rng.normal(size=(2, 6, cfg.d_model)).astype(np.float32)
    padded = np.pad(x, ((0, 0), (1, 1), (0, 0)))
    want = sum(padded[:, j:j + 6] * kernel[j] for j in range(3)) + bias
    np.testing.assert_allclose(np.asarray(conv(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)
    abstract = nnx.eval_shape(lambda: _build(cfg))
    assert all(hasattr(layer, "conv") for layer in [*abstract.encoder.layers, *abstract.decoder.layers])
    assert not hasattr(nnx.eval_shape(lambda: _build(CFG)).encoder.layers[0], "conv")
    rules = dict(sharding.LOGICAL_RULES)
    assert all(n in rules for n in conv.kernel.get_metadata()["out_sharding"])
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=f"conv_kernel={bad} must be 0"):
            CFG.replace(conv_kernel=bad)


def test_unit_context_equals_torch_convolutions_and_bidirectional_lstm():
    """`unit_context` reads the unit rows as Kokoro's text encoder reads phonemes: residual width-5
    convolutions (LayerNorm over channels, LeakyReLU 0.2), then x + a bidirectional LSTM; a reader wider
    than the rows (`context_width`) does so between x @ widen and @ narrow, added to x. Checked against
    torch's own Conv1d, layer_norm and nn.LSTM(bidirectional) given the same weights (torch's gate order
    i, f, g, o; its two biases summed in ours); then, inside a block, row i's query moves when a
    neighbour's unit changes (a table alone keeps it), and the config refuses it without units."""
    torch = require("torch", "the reference convolutions and LSTM")
    from empatheia_jax.models.unit_context import CONV_LAYERS, CONV_WIDTH, UnitContext

    d, q = 8, 7
    rng = np.random.default_rng(11)
    x = rng.normal(size=(2, q, d)).astype(np.float32)
    # at the rows' width, and at a reader width of its own between a widening and a narrowing projection
    for width in (d, 12):
        with nnx.use_eager_sharding(False):  # as the block builds it: placement comes at jit time
            ctx = UnitContext(d, width=width, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
        if width != d:  # a wide reader starts as the identity: its narrowing projection is 0
            np.testing.assert_array_equal(np.asarray(ctx(jnp.asarray(x))), x)
        for var in (ctx.conv_bias, ctx.norm_scale, ctx.norm_bias, ctx.lstm_bias,
                    *((ctx.narrow,) if width != d else ())):
            var[...] = jnp.asarray(rng.normal(size=var.shape).astype(np.float32) * 0.5)
        got = np.asarray(ctx(jnp.asarray(x)))

        names = ("conv", "conv_bias", "norm_scale", "norm_bias", "lstm_in", "lstm_rec", "lstm_bias",
                 *(("widen", "narrow") if width != d else ()))
        p = {k: torch.from_numpy(np.asarray(getattr(ctx, k)[...]).copy()) for k in names}
        with torch.no_grad():
            h = torch.from_numpy(x) @ p["widen"] if width != d else torch.from_numpy(x)
            for layer in range(CONV_LAYERS):
                y = torch.nn.functional.conv1d(h.transpose(1, 2), p["conv"][layer].permute(2, 1, 0),
                                               p["conv_bias"][layer], padding=CONV_WIDTH // 2).transpose(1, 2)
                y = torch.nn.functional.layer_norm(y, (width,), p["norm_scale"][layer], p["norm_bias"][layer],
                                                   1e-5)
                h = h + torch.nn.functional.leaky_relu(y, 0.2)
            lstm = torch.nn.LSTM(width, width // 2, batch_first=True, bidirectional=True)
            for direction, suffix in ((0, ""), (1, "_reverse")):
                getattr(lstm, f"weight_ih_l0{suffix}").copy_(p["lstm_in"][direction].T)
                getattr(lstm, f"weight_hh_l0{suffix}").copy_(p["lstm_rec"][direction].T)
                getattr(lstm, f"bias_ih_l0{suffix}").copy_(p["lstm_bias"][direction])
                getattr(lstm, f"bias_hh_l0{suffix}").zero_()
            want = h + lstm(h)[0]
            want = (torch.from_numpy(x) + want @ p["narrow"] if width != d else want).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    cfg = CFG.replace(num_units=11, unit_context=True)
    block = _build(cfg)
    units = np.zeros((1, cfg.num_queries), np.int32) + 3
    moved = units.copy()
    moved[0, 3] = 7  # row 2's neighbour
    for blk, should_move in ((block, True), (_build(CFG.replace(num_units=11)), False)):
        q0, q1 = (np.asarray(blk._queries(jnp.asarray(u))[0]) for u in (units, moved))
        assert (np.abs(q0[0, 2] - q1[0, 2]).max() > 1e-6) == should_move
    with pytest.raises(ValueError, match="unit_context=True needs num_units > 0"):
        CFG.replace(unit_context=True)
    with pytest.raises(ValueError, match="context_width=12 is the unit_context reader's"):
        CFG.replace(num_units=11, context_width=12)
    wide = _build(CFG.replace(num_units=11, unit_context=True, context_width=12))
    assert wide.unit_context.widen.shape == (CFG.d_model, 12)


def test_context_skip_adds_the_readers_features_to_the_rows_through_a_map_that_starts_at_0():
    """`context_skip`: a row is no longer only a linear function of the d_model-wide decoder output. The
    block starts exactly as the same block without it; with the map's weights set, its rows are those rows
    plus read @ W + b, read being the reader's own features (`UnitContext.read`, wider than d_model here);
    the map gets a gradient from the first step, and the config refuses it without a reader."""
    cfg = CFG.replace(num_units=11, unit_context=True, context_width=12)
    skip = cfg.replace(context_skip=True)
    plain, block = _build(cfg), _build(skip)
    assert block.context_out.kernel.shape == (12, cfg.d_out)
    h, mask = _inputs()
    units = jnp.asarray(np.random.default_rng(5).integers(0, 11, (B, cfg.num_queries)).astype(np.int32))
    run = nnx.jit(lambda m: m(jnp.asarray(h), jnp.asarray(mask), sample=False, units=units).out)
    base = np.asarray(run(plain))
    np.testing.assert_array_equal(np.asarray(run(block)), base)  # same init keys, the map at 0
    rng = np.random.default_rng(6)
    w = rng.normal(size=(12, cfg.d_out)).astype(np.float32)
    b = rng.normal(size=cfg.d_out).astype(np.float32)
    block.context_out.kernel[...], block.context_out.bias[...] = jnp.asarray(w), jnp.asarray(b)
    rows = jnp.take(block.unit_embed[...], units, axis=0)
    read = np.asarray(block.unit_context.read(rows)[1])
    assert read.shape == (B, cfg.num_queries, 12)
    np.testing.assert_allclose(np.asarray(run(block)), base + read @ w + b, rtol=1e-4, atol=1e-4)
    block.context_out.kernel[...] = jnp.zeros((12, cfg.d_out))
    grad = nnx.grad(lambda m: jnp.sum(run(m) ** 2))(block)
    assert float(jnp.abs(grad.context_out.kernel[...]).max()) > 0
    with pytest.raises(ValueError, match="context_skip=True sends the unit_context reader"):
        CFG.replace(num_units=11, context_skip=True)
