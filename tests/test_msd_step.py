"""The sharded MSD train step: 8 devices match 1 device; the state is laid out as the rules say."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.infra.mesh import MeshConfig, make_mesh
from msd_jax import models, step, weighting
from msd_jax.views import MultimodalBatch

B, T, P, D, C, VOCAB = 16, 4, 3, 5, 3, 11


def batches(num_steps: int, seed: int = 0):
    """`num_steps` (batch, targets, val_batch) triples with random teacher logits / saliency."""
    rng = np.random.default_rng(seed)

    def batch():
        text_mask = rng.random((B, T)) < 0.8
        text_mask[:, 0] = True
        return MultimodalBatch(
            text_ids_bt=jnp.asarray(rng.integers(0, VOCAB, (B, T)), jnp.int32),
            text_mask_bt=jnp.asarray(text_mask),
            image_bpd=jnp.asarray(rng.normal(size=(B, P, D)), jnp.float32),
            image_mask_bp=jnp.asarray(rng.random((B, P)) < 0.9),
            label_b=jnp.asarray(rng.integers(0, C, B), jnp.int32),
        )

    out = []
    for _ in range(num_steps):
        targets = step.TeacherTargets(
            logits_bvc=jnp.asarray(rng.normal(scale=2.0, size=(B, 3, C)), jnp.float32),
            saliency_bm=jnp.asarray(rng.random((B, 2)), jnp.float32),
        )
        out.append((batch(), targets, batch()))
    return out


def model_config(kind: str):
    if kind == "transformer":
        return models.transformer_config(
            "tiny", num_classes=C, vocab_size=VOCAB, max_text_len=T, max_patches=P, patch_dim=D
        )
    return models.MLPConfig(
        num_classes=C, vocab_size=VOCAB, max_patches=P, patch_dim=D, text_embed_size=8,
        hidden_sizes=(16,),
    )  # fmt: skip


def train(num_devices, student, rules, scheme, data, objective="msd"):
    """Params (host copies) after the first and the last step, the last metrics, the state."""
    graphdef, params = student
    mesh = make_mesh(MeshConfig(("data",), (num_devices,)))
    optimizer = optax.adamw(3e-3, weight_decay=1e-2)
    state, shardings = step.init_train_state(
        params, optimizer, scheme, mesh, rules, jax.random.key(0)
    )
    train_step = step.make_train_step(
        graphdef, optimizer, scheme, step.StepConfig(objective=objective), mesh, rules, shardings
    )
    snapshots = []
    for i, (batch, targets, val_batch) in enumerate(data):
        args = (batch, targets) + ((val_batch,) if scheme is not None and scheme.learned else ())
        previous = state
        state, metrics = train_step(state, *args)
        assert all(x.is_deleted() for x in jax.tree.leaves(previous.params))  # donated
        if i in (0, len(data) - 1):
            # Fetch a device copy: on CPU a fetched array is a zero-copy host view, which
            # would (rightly) stop the next step from donating it.
            copies = jax.tree.map(jnp.copy, (state.params, state.weighting.params))
            snapshots.append(jax.device_get(copies))
    assert int(state.step) == len(data)
    return snapshots, jax.device_get(metrics), state


def relative_error(a, b) -> float:
    errors = jax.tree.map(lambda x, y: np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30), a, b)
    return max(jax.tree.leaves(errors))


@pytest.mark.parametrize(
    "kind, rules_name, scheme",
    [
        ("transformer", "data_parallel", weighting.make_weighting("instance")),
        ("mlp", "fsdp", weighting.make_weighting("learned", parametrisation="net")),
    ],
)
def test_sharded_step_matches_one_device(kind, rules_name, scheme):
    rules = models.RULES[rules_name]
    data = batches(10)
    config = model_config(kind)
    # Host (NumPy) params for both runs; jax.random init would only add compile time here.
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: models.build_model(config, rngs=nnx.Rngs(0)))
    )
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(scale=0.3, size=a.shape).astype(a.dtype), abstract)
    with jax.default_matmul_precision("highest"):
        one, metrics_one, _ = train(1, (graphdef, params), rules, scheme, data)
        eight, metrics_eight, state = train(8, (graphdef, params), rules, scheme, data)
    first, last = relative_error(eight[0], one[0]), relative_error(eight[1], one[1])
    assert first <= 1e-6, first
    assert last <= 1e-5, last
    assert relative_error(eight[1], eight[0]) > 1e-3  # training moved the params
    for name, value in metrics_one.items():
        np.testing.assert_allclose(metrics_eight[name], value, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(metrics_eight["weights/mass"], scheme.mass, rtol=1e-6)

    # Layout: weights as the rules say, the step replicated, all on the 8 devices.
    for leaf in jax.tree.leaves(state.params):
        assert len(leaf.sharding.device_set) == 8
    embedding = state.params["token_embedding"].get_value()
    if rules_name == "fsdp":
        assert embedding.sharding.spec == jax.sharding.PartitionSpec(None, "data")
        assert embedding.addressable_shards[0].data.shape == (VOCAB, embedding.shape[1] // 8)
    else:
        assert embedding.sharding.is_fully_replicated
    assert state.step.sharding.is_fully_replicated
