"""`launch.export`: a run's checkpointed params -> a HF directory with equal weights."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

from jaxrl.infra.checkpoint import CheckpointConfig, Checkpointer
from jaxrl.infra.launcher import CONFIG_FILE
from jaxrl.job import workdir as run_dir
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer
from jaxrl.train import lora as lora_lib
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


LORA = lora_lib.LoraConfig(rank=2, alpha=4.0, target_modules=r"layers/\d+/attention", freeze_a=True)

# A LoRA run's config.gin as far as `launch.eval --workdir` reads it (task and eval settings).
LORA_RUN_GIN = """
rl_main.policy = @PolicySpec()
rl_main.task = @TaskSpec()
rl_main.rl = @RLConfig()
rl_main.optimizer = @OptimizerConfig()
rl_main.loss = @LossConfig()
rl_main.lora = @LoraConfig()
RLConfig.eval_size = 16
RLConfig.eval_samples = 2
"""


def fake_lora_run(workdir) -> None:
    """A LoRA run's workdir as `launch.rl` leaves it with an SFT stage: the frozen base is the
    run `WORKDIR/sft/` (params checkpoint), `lora.json` names it, and the run's checkpoint
    (step 7) holds the trained B's only (LoRA-FA), nonzero so that they move the logits."""
    workdir = str(workdir)
    tokenizer = build_arithmetic_tokenizer()
    config = ModelConfig(
        "llama", len(tokenizer), 32, 64, 2, 4, 2, 8,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64,
    )  # fmt: skip
    base = os.path.join(workdir, "sft")
    for where in (base, workdir):
        run_dir.save_model_spec(where, config, tokenizer)
    # Random weights drawn in numpy (an eager or jitted Transformer init costs seconds of CPU).
    rng = np.random.default_rng(0)

    def draw(path, x):
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(x.shape, np.float32)
        return rng.normal(0.0, 0.3, x.shape).astype(np.float32)

    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    params = jax.tree_util.tree_map_with_path(
        draw, nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    )
    saves = CheckpointConfig(save_every_steps=1, async_save=False)
    with Checkpointer(run_dir.checkpoint_dir(base), saves) as ckpt:
        ckpt.save(5, {"params": params}, extra={})
    _, adapters = lora_lib.abstract_lora(config, LORA)
    trained = lora_lib.trained_part(nnx.to_pure_dict(adapters), LORA)
    trained = jax.tree.map(lambda b: rng.normal(0.0, 0.5, b.shape).astype(np.float32), trained)
    with Checkpointer(run_dir.checkpoint_dir(workdir), saves) as ckpt:
        ckpt.save(7, {"params": trained}, extra={})
    run_dir.save_run_lora(workdir, LORA, base)
    with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
        f.write(LORA_RUN_GIN)


def _hf_logits(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def test_a_moved_lora_run_exports_from_its_own_base(tmp_path):
    """Regression: lora.json recorded the SFT base by its absolute path, so a moved workdir
    looked for `<old path>/sft`. A base inside the workdir is recorded relative to it."""
    fake_lora_run(tmp_path / "run")
    shutil.move(tmp_path / "run", tmp_path / "moved")
    moved = tmp_path / "moved"
    assert export.main([f"--workdir={moved}", f"--out={tmp_path / 'merged'}", "--merge_lora"]) == 0
    assert (tmp_path / "merged" / "model.safetensors").exists()
    record = json.loads((moved / "lora.json").read_text())
    assert record["base"] == "sft"
    # An older run's lora.json holds an absolute base: still read, and a missing one is named.
    (moved / "lora.json").write_text(json.dumps(record | {"base": str(moved / "sft")}))
    assert run_dir.load_run_lora(str(moved))[1] == str(moved / "sft")
    (moved / "lora.json").write_text(json.dumps(record | {"base": str(tmp_path / "run/sft")}))
    with pytest.raises(FileNotFoundError, match="records the run's frozen base"):
        export.main([f"--workdir={moved}", f"--out={tmp_path / 'x'}", "--merge_lora"])


def test_peft_export_of_an_sft_based_run_loads_with_auto_peft(tmp_path):
    """Regression: the PEFT export named the jaxrl workdir `sft/` as its base, which
    transformers cannot read. The base is exported beside the adapters and recorded there."""
    import peft

    fake_lora_run(tmp_path / "run")
    out, merged = tmp_path / "adapters", tmp_path / "merged"
    argv = [f"--workdir={tmp_path / 'run'}", f"--peft_out={out}", f"--out={merged}", "--merge_lora"]
    assert export.main(argv) == 0
    model = peft.AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(out / "base")
    tokens = np.array([[1, 5, 6, 7, 15, 8]])
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    plain = _hf_logits(out / "base", tokens)
    assert np.abs(theirs - plain).max() > 0.1  # the adapters were applied
    np.testing.assert_allclose(theirs, _hf_logits(merged, tokens), atol=1e-4, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.encode("12+3=") == build_arithmetic_tokenizer().encode("12+3=")
