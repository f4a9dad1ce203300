"""`launch.export`: a run's checkpointed params -> a HF directory with equal weights."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

from jaxrl import workdir as run_dir
from jaxrl.infra.checkpoint import CheckpointConfig, Checkpointer
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer
from launch import export


def _fake_run(workdir):
    """A workdir as a training run leaves it: model spec + checkpoints with params and opt
    state (two steps, so --step selects)."""
    tokenizer = build_arithmetic_tokenizer()
    config = ModelConfig(
        "qwen2",
        len(tokenizer),
        32,
        64,
        2,
        4,
        2,
        8,
        qkv_bias=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    run_dir.save_model_spec(str(workdir), config, tokenizer)
    params = {}
    with Checkpointer(
        run_dir.checkpoint_dir(str(workdir)), CheckpointConfig(save_every_steps=1, async_save=False)
    ) as ckpt:
        for step in (10, 20):
            model = Transformer(config, rngs=nnx.Rngs(step), init_std=0.2)
            state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            opt_state = optax.adamw(1e-3).init(state)
            ckpt.save(step, {"params": state, "opt_state": opt_state}, extra={"step": step})
            params[step] = model
    return params


def test_export_newest_and_chosen_step(tmp_path, capsys):
    models = _fake_run(tmp_path / "run")
    tokens = np.array([[1, 5, 6, 7, 15, 8]])
    for step, argv in ((20, []), (10, ["--step=10"])):
        out = tmp_path / f"hf_{step}"
        assert export.main([f"--workdir={tmp_path / 'run'}", f"--out={out}", *argv]) == 0
        assert f"exported step {step}" in capsys.readouterr().out
        reference = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            ref = reference(torch.tensor(tokens)).logits.numpy()
        with jax.default_matmul_precision("highest"):
            ours = np.asarray(models[step](tokens))
        np.testing.assert_allclose(ours, ref, atol=2e-5 * max(1.0, np.abs(ref).max()), rtol=0)
        tok = transformers.AutoTokenizer.from_pretrained(out)
        assert tok.encode("12+3=") == build_arithmetic_tokenizer().encode("12+3=")


def test_export_refuses_existing_out_and_non_runs(tmp_path, capsys):
    _fake_run(tmp_path / "run")
    (tmp_path / "taken").mkdir()
    assert export.main([f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'taken'}"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="not the workdir of a jaxrl run"):
        export.main([f"--workdir={tmp_path}", f"--out={tmp_path / 'x'}"])
