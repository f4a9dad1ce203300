"""msd_jax models and views: NumPy reference forwards and the masking properties.

The NumPy reference of the transformer literally deletes masked tokens from the sequence, so
agreement with it shows that masking removes a modality from attention (not just zeroes it).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import param_shardings
from msd_jax import models, step
from msd_jax.views import VIEWS, MultimodalBatch, keep_only, patchify, stack_views, view

B, T, P, D, C, VOCAB = 4, 5, 3, 6, 3, 13


def random_batch(seed: int, b=B, t=T, p=P) -> MultimodalBatch:
    rng = np.random.default_rng(seed)
    text_mask = rng.random((b, t)) < 0.7
    image_mask = rng.random((b, p)) < 0.7
    if t:
        text_mask[:, 0] = True
    if p:
        image_mask[:, 0] = True
    return MultimodalBatch(
        text_ids_bt=jnp.asarray(rng.integers(0, VOCAB, (b, t)), jnp.int32),
        text_mask_bt=jnp.asarray(text_mask),
        image_bpd=jnp.asarray(rng.normal(size=(b, p, D)), jnp.float32),
        image_mask_bp=jnp.asarray(image_mask),
        label_b=jnp.asarray(rng.integers(0, C, (b,)), jnp.int32),
    )


def with_numpy_params(config, seed: int, std: float = 0.5):
    """The model of `config` with every parameter ~ N(0, std^2) from NumPy.

    (No jax.random: compiling threefry init kernels would dominate these tests' run time.)
    """
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: models.build_model(config, rngs=nnx.Rngs(0)))
    )
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda a: jnp.asarray(rng.normal(scale=std, size=a.shape), a.dtype), abstract
    )
    return nnx.merge(graphdef, params)


def transformer() -> models.MultimodalTransformer:
    config = models.transformer_config(
        "tiny", num_classes=C, vocab_size=VOCAB, max_text_len=T, max_patches=P, patch_dim=D
    )
    return with_numpy_params(config, seed=0)


def mlp() -> models.MLPFusion:
    config = models.MLPConfig(
        num_classes=C, vocab_size=VOCAB, max_patches=P, patch_dim=D, text_embed_size=8,
        hidden_sizes=(16,),
    )  # fmt: skip
    return with_numpy_params(config, seed=1)


@functools.cache
def jitted(kind: str):
    """(model, forward(batch), view_logits(batch)), jitted once per model for the module."""
    model = transformer() if kind == "transformer" else mlp()
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    views_fn = jax.jit(lambda s, x: nnx.merge(graphdef, s).view_logits(x))
    return (
        model,
        lambda x: np.asarray(forward(state, x)),
        lambda x: np.asarray(views_fn(state, x)),
    )


def _np(x):
    return np.asarray(x[...], np.float64)


def _layer_norm(x, norm):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-6) * _np(norm.scale) + _np(norm.bias)


def _gelu(x):  # jax.nn.gelu's default tanh approximation
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def np_transformer_logits(model, batch: MultimodalBatch, b: int) -> np.ndarray:
    """Sample b: [CLS] + unmasked text + unmasked patches only, then a dense transformer."""
    types = _np(model.type_embedding)
    rows = [_np(model.cls_embedding) + types[0]]
    for t in np.flatnonzero(np.asarray(batch.text_mask_bt[b])):
        token = int(batch.text_ids_bt[b, t])
        rows.append(_np(model.token_embedding)[token] + _np(model.text_position)[t] + types[1])
    for p in np.flatnonzero(np.asarray(batch.image_mask_bp[b])):
        patch = np.asarray(batch.image_bpd[b, p], np.float64) @ _np(model.patch_kernel)
        rows.append(patch + _np(model.patch_bias) + _np(model.image_position)[p] + types[2])
    x = np.stack(rows)
    for block in model.blocks:
        y = _layer_norm(x, block.attention_norm)
        q, k, v = np.einsum("le,nehk->nlhk", y, _np(block.qkv_kernel))
        q, v = q + _np(block.q_bias), v + _np(block.v_bias)
        scores = np.einsum("qhk,shk->hqs", q, k) / np.sqrt(q.shape[-1])
        attn = np.exp(scores - scores.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        out = np.einsum("hqs,shk->qhk", attn, v)
        x = x + np.einsum("qhk,hke->qe", out, _np(block.out_kernel)) + _np(block.out_bias)
        y = _gelu(_layer_norm(x, block.mlp_norm) @ _np(block.up_kernel) + _np(block.up_bias))
        x = x + y @ _np(block.down_kernel) + _np(block.down_bias)
    pooled = _layer_norm(x[0], model.final_norm)
    return pooled @ _np(model.head_kernel) + _np(model.head_bias)


def np_mlp_logits(model, batch: MultimodalBatch, b: int) -> np.ndarray:
    text_mask = np.asarray(batch.text_mask_bt[b])
    image_mask = np.asarray(batch.image_mask_bp[b])
    tokens = _np(model.token_embedding)[np.asarray(batch.text_ids_bt[b])[text_mask]]
    text = tokens.mean(0) if text_mask.any() else np.zeros(tokens.shape[1])
    image = np.asarray(batch.image_bpd[b], np.float64) * image_mask[:, None]
    h = np.concatenate([text, image.ravel(), [text_mask.any(), image_mask.any()]])
    for kernel, bias in zip(model.kernels, model.biases, strict=True):
        h = _gelu(h @ _np(kernel) + _np(bias))
    return h @ _np(model.head_kernel) + _np(model.head_bias)


@pytest.mark.parametrize("kind", ["transformer", "mlp"])
def test_views_match_numpy_reference(kind):
    reference = np_transformer_logits if kind == "transformer" else np_mlp_logits
    model, forward, view_logits = jitted(kind)
    batch = random_batch(0)
    with jax.default_matmul_precision("highest"):
        packed_bvc = view_logits(batch)
        for v, name in enumerate(VIEWS):
            single_bc = forward(view(batch, name))
            expected = np.stack([reference(model, view(batch, name), b) for b in range(B)])
            assert np.abs(expected).max() > 0.1  # a meaningful scale for the tolerances
            np.testing.assert_allclose(single_bc, expected, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(packed_bvc[:, v], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["transformer", "mlp"])
def test_masked_modality_has_no_influence(kind):
    _, forward, view_logits = jitted(kind)
    batch = random_batch(1)
    other = random_batch(2)
    new_image = batch.replace(image_bpd=other.image_bpd)
    new_text = batch.replace(text_ids_bt=other.text_ids_bt)

    base = view_logits(batch)
    with_new_image, with_new_text = view_logits(new_image), view_logits(new_text)
    np.testing.assert_array_equal(with_new_image[:, 1], base[:, 1])  # text-only
    np.testing.assert_array_equal(with_new_text[:, 2], base[:, 2])  # image-only

    def changed_per_sample(a_bc, b_bc):
        return np.abs(a_bc - b_bc).max(axis=-1).min()

    assert changed_per_sample(with_new_image[:, 0], base[:, 0]) > 1e-3  # full sees the image
    assert changed_per_sample(with_new_text[:, 0], base[:, 0]) > 1e-3  # full sees the text
    assert changed_per_sample(with_new_image[:, 2], base[:, 2]) > 1e-3
    assert changed_per_sample(with_new_text[:, 1], base[:, 1]) > 1e-3

    # The same through the single-view forward, and masked padding inside a modality.
    np.testing.assert_array_equal(
        forward(keep_only(new_image, "text")), forward(keep_only(batch, "text"))
    )
    np.testing.assert_array_equal(
        forward(keep_only(new_text, "image")), forward(keep_only(batch, "image"))
    )
    changed_padding = batch.replace(
        text_ids_bt=jnp.where(
            batch.text_mask_bt, batch.text_ids_bt, (batch.text_ids_bt + 1) % VOCAB
        ),
        image_bpd=jnp.where(batch.image_mask_bp[..., None], batch.image_bpd, 7.0),
    )
    np.testing.assert_array_equal(view_logits(changed_padding), base)


def test_transformer_masking_equals_absent_tokens():
    """The text-only view equals a forward pass on a batch with no patches at all (and vice
    versa): masked tokens are gone, not zero vectors with position and type embeddings."""
    _, forward, _ = jitted("transformer")
    batch = random_batch(3)
    no_image = batch.replace(
        image_bpd=batch.image_bpd[:, :0], image_mask_bp=batch.image_mask_bp[:, :0]
    )
    no_text = batch.replace(
        text_ids_bt=batch.text_ids_bt[:, :0], text_mask_bt=batch.text_mask_bt[:, :0]
    )
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(
            forward(keep_only(batch, "text")), forward(no_image), rtol=1e-6, atol=1e-6
        )
        np.testing.assert_allclose(
            forward(keep_only(batch, "image")), forward(no_text), rtol=1e-6, atol=1e-6
        )


def test_sharded_teacher_fn_gives_the_view_logits():
    """The cached-teacher path: one sharded forward over the views, split along the batch."""
    model, _, view_logits = jitted("transformer")
    mesh = make_mesh(MeshConfig(("data",), (-1,)))
    graphdef, params = nnx.split(model)
    shardings = param_shardings(params, mesh, models.DATA_PARALLEL_RULES)
    teacher_fn = step.make_teacher_fn(graphdef, mesh, models.DATA_PARALLEL_RULES, shardings)
    batch = random_batch(6, b=8)
    logits_bvc = teacher_fn(jax.device_put(params, shardings), batch)
    assert logits_bvc.sharding.spec[0] == "data" and len(logits_bvc.sharding.device_set) == 8
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(logits_bvc, view_logits(batch), rtol=1e-6, atol=1e-6)


def test_bfloat16_compute_gives_float32_logits():
    model, forward, _ = jitted("transformer")
    config = dataclasses.replace(model.config, dtype="bfloat16")
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.build_model(config, rngs=nnx.Rngs(0))))
    _, params = nnx.split(model)  # the fp32 model's parameters, bf16 compute
    bf16 = jax.jit(lambda s, x: nnx.merge(graphdef, s).view_logits(x))
    batch = random_batch(7)
    logits_bvc = bf16(params, batch)
    assert logits_bvc.dtype == jnp.float32
    full_precision = np.stack([forward(view(batch, name)) for name in VIEWS], axis=1)
    scale = np.abs(full_precision).max()
    np.testing.assert_allclose(logits_bvc, full_precision, atol=0.05 * scale)
    assert np.abs(np.asarray(logits_bvc) - full_precision).max() > 0  # it did compute in bf16


def test_mlp_zeroes_block_and_sets_indicator():
    model = jitted("mlp")[0]
    batch = random_batch(4)
    e, pd = model.config.text_embed_size, P * D
    fused_inputs = jax.jit(lambda x: model.fused_inputs(x))
    fused = {name: np.asarray(fused_inputs(view(batch, name))) for name in VIEWS}
    np.testing.assert_array_equal(fused["full"][:, -2:], 1.0)
    np.testing.assert_array_equal(fused["text"][:, -2:], [[1.0, 0.0]] * B)
    np.testing.assert_array_equal(fused["image"][:, -2:], [[0.0, 1.0]] * B)
    np.testing.assert_array_equal(fused["text"][:, e : e + pd], 0.0)
    np.testing.assert_array_equal(fused["image"][:, :e], 0.0)
    np.testing.assert_array_equal(fused["text"][:, :e], fused["full"][:, :e])
    np.testing.assert_array_equal(fused["image"][:, e : e + pd], fused["full"][:, e : e + pd])


def test_stack_views_and_patchify():
    batch = random_batch(5)
    stacked = stack_views(batch)
    for v, name in enumerate(VIEWS):
        expected = view(batch, name)
        np.testing.assert_array_equal(stacked.text_mask_bt[v::3], expected.text_mask_bt)
        np.testing.assert_array_equal(stacked.image_mask_bp[v::3], expected.image_mask_bp)
        np.testing.assert_array_equal(stacked.image_bpd[v::3], batch.image_bpd)
        np.testing.assert_array_equal(stacked.label_b[v::3], batch.label_b)
    assert not np.asarray(stacked.image_mask_bp[1::3]).any()
    assert not np.asarray(stacked.text_mask_bt[2::3]).any()

    images = np.random.default_rng(0).normal(size=(2, 8, 4, 3)).astype(np.float32)
    patches = np.asarray(patchify(images, 2))
    assert patches.shape == (2, 8, 12)
    for i in range(4):
        for j in range(2):
            np.testing.assert_array_equal(
                patches[:, i * 2 + j],
                images[:, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2].reshape(2, -1),
            )
    with pytest.raises(ValueError, match="multiple of the patch size"):
        patchify(images, 3)


def test_configs_and_batches_are_validated():
    with pytest.raises(ValueError, match="not a multiple of num_heads"):
        models.transformer_config(
            "tiny", num_classes=2, vocab_size=4, max_text_len=2, max_patches=2, patch_dim=2,
            num_heads=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match="unknown transformer size"):
        models.transformer_config("huge")
    with pytest.raises(ValueError, match="dtype"):
        models.MLPConfig(num_classes=2, vocab_size=4, max_patches=2, patch_dim=2, dtype="int8")
    with pytest.raises(ValueError, match="the model takes"):
        transformer()(random_batch(0, t=T + 1))
    batch = random_batch(0)
    batch.validate()
    with pytest.raises(ValueError, match="label_b"):
        batch.replace(label_b=batch.label_b[:2]).validate()
    with pytest.raises(ValueError, match="integer"):
        batch.replace(text_ids_bt=batch.text_ids_bt.astype(jnp.float32)).validate()
