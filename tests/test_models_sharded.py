"""The model on a (fsdp=4, tp=2) mesh: parameter shardings from the rules table, sharded forward
equal to the unsharded one, HF import straight into shardings, and the export round trip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from flax.core import spmd as flax_spmd
from hf_fixtures import left_padded_batch, save_tiny_checkpoint

from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES, init_sharded, logical_to_pspec
from jaxrl.models import hf
from jaxrl.models.safetensors_io import SafetensorsReader
from jaxrl.models.transformer import Transformer


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(("fsdp", "tp"), (4, 2)))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    # vocab 98 and 4 heads, 2 kv heads, intermediate 96 over tp=2; hidden 64 over fsdp=4.
    path = tmp_path_factory.mktemp("qwen3")
    save_tiny_checkpoint(path, "qwen3", vocab_size=98)
    return str(path)


def _forward(model, tokens, mask):
    return model(jnp.asarray(tokens), jnp.asarray(mask, bool))


def test_sharded_load_and_forward_match_unsharded(mesh, qwen3_dir):
    sharded = hf.load_model(qwen3_dir, mesh=mesh, rules=TRAINER_RULES)
    plain = hf.load_model(qwen3_dir)
    tokens, mask = left_padded_batch(sharded.config.vocab_size)
    tokens, mask = np.concatenate([tokens, tokens[:1]]), np.concatenate([mask, mask[:1]])

    # Every parameter's sharding is what the rules table says for its logical names.
    checked = 0
    for path, var in nnx.to_flat_state(nnx.state(sharded, nnx.Param)):
        expected = logical_to_pspec(var.get_metadata("out_sharding"), TRAINER_RULES)
        actual = var.get_value().sharding
        assert actual.mesh == mesh, path
        assert actual.spec == expected, (path, actual.spec, expected)
        checked += 1
    assert checked == len(hf.param_map(sharded.config))
    q = sharded.layers[0].attention.q_kernel.get_value()
    assert q.addressable_shards[0].data.shape == (64 // 4, 4 // 2, 24)  # really split

    with jax.default_matmul_precision("highest"):
        ref = np.asarray(nnx.jit(_forward, static_argnums=())(plain, tokens, mask))
        with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(TRAINER_RULES):
            logits = nnx.jit(_forward)(sharded, tokens, mask)
    assert logits.sharding.spec == logical_to_pspec(("act_batch", None, "act_vocab"), TRAINER_RULES)
    diff = float(np.abs(np.asarray(logits) - ref).max())
    print(f"sharded vs unsharded logits: max|diff|={diff:.3g}, max|logits|={np.abs(ref).max():.3g}")
    assert diff <= 1e-5 * float(np.abs(ref).max()), diff


def test_params_born_sharded_by_jitted_init(mesh, qwen3_dir):
    config = hf.load_config(qwen3_dir)
    _, state, shardings = init_sharded(
        lambda: Transformer(config, rngs=nnx.Rngs(0)), mesh, TRAINER_RULES
    )
    leaves = jax.tree.leaves(nnx.to_pure_dict(state))
    expected = jax.tree.leaves(nnx.to_pure_dict(shardings))
    assert len(leaves) == len(expected) > 0
    for leaf, sharding in zip(leaves, expected, strict=True):
        assert leaf.sharding == sharding


def test_export_round_trip_is_bitwise(tmp_path, qwen3_dir):
    tokenizer_free_model = hf.load_model(qwen3_dir)
    out = str(tmp_path / "exported")
    hf.save_hf(tokenizer_free_model, out)

    original, exported = SafetensorsReader(qwen3_dir), SafetensorsReader(out)
    assert sorted(original) == sorted(exported)
    for name in original:
        a, b = original[name], exported[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name

    tokens, mask = left_padded_batch(tokenizer_free_model.config.vocab_size)
    logits = []
    for path in (qwen3_dir, out):
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            logits.append(model(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits)
    assert torch.equal(logits[0], logits[1])


def test_export_is_atomic(tmp_path, qwen3_dir, monkeypatch):
    model = hf.load_model(qwen3_dir)
    out = tmp_path / "export"

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("jaxrl.models.safetensors_io.write_safetensors", fail)
    with pytest.raises(OSError, match="No space"):
        hf.save_hf(model, str(out))
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left behind


def test_indivisible_vocab_is_named(mesh, tmp_path):
    save_tiny_checkpoint(tmp_path, "llama3")  # vocab 97 cannot split over tp=2
    with pytest.raises(ValueError, match=r"\['embedding'\].*'vocab', size 97.*pad the vocabulary"):
        hf.load_model(str(tmp_path), mesh=mesh, rules=TRAINER_RULES)
