"""An async LoRA run through `launch.rl` (configs/rl/arith_tiny_lora.gin on a random HF base):
checkpoints hold the adapters only, a run killed after step 3 resumes to end bitwise equal to an
uninterrupted one, each weight push moves only the adapters' bytes, and `launch.export
--merge_lora` / `--peft_out` write what the trained LoRA policy computes."""

from __future__ import annotations

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_async_loop import _finish, _last_records, _start

from jaxrl.job import workdir as run_dir
from jaxrl.job.specs import PolicySpec, TaskSpec, build_model_config, build_tokenizer
from jaxrl.models import hf
from jaxrl.models.transformer import Transformer
from jaxrl.train import lora as lora_lib
from launch import export

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA_CONFIG = os.path.join(REPO, "configs", "rl", "arith_tiny_lora.gin")


def _run(workdir, cache, base, fault=None):
    """`launch.rl` on the LoRA config with the async tests' six-step schedule, from `base`."""
    params = [f"PolicySpec.init_from = '{base}'", "OptimizerConfig.learning_rate = 3e-2"]
    return _finish(_start(workdir, cache, params, fault, config=LORA_CONFIG))


def _adapters(workdir, step=None):
    config = build_model_config(PolicySpec(), build_tokenizer(PolicySpec(), TaskSpec()))
    lora, _ = run_dir.load_run_lora(str(workdir))
    step, adapters = run_dir.restore_adapters(str(workdir), config, lora, step)
    flat = jax.tree_util.tree_leaves_with_path(adapters)
    return step, {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


def test_async_lora_resumes_bitwise_and_exports(tmp_path, xla_cache):
    cache = xla_cache
    tokenizer = build_tokenizer(PolicySpec(), TaskSpec())
    config = build_model_config(PolicySpec(), tokenizer)
    base = str(tmp_path / "base")
    hf.save_hf(Transformer(config, rngs=nnx.Rngs(3), init_std=0.1), base, tokenizer=tokenizer)

    reference = _run(tmp_path / "reference", cache, base)
    assert reference.returncode == 0, reference.stderr[-3000:]
    run = tmp_path / "run"
    killed = _run(run, cache, base, fault="kill_at_step=3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = _run(run, cache, base)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from step 2" in resumed.stdout
    _, ref = _adapters(tmp_path / "reference")
    step, ours = _adapters(run)
    assert step == 6 and ref.keys() == ours.keys()
    assert all(ref[k].tobytes() == ours[k].tobytes() for k in ref)
    assert any(np.any(v) for k, v in ours.items() if k.endswith("_lora_b']"))  # RL moved B
    # The checkpoint is the adapters (and their optimizer state): no base weights in it.
    ckpt = run / "checkpoints" / "6" / "state"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    base_bytes = os.path.getsize(os.path.join(base, "model.safetensors"))
    assert size < base_bytes / 2, (size, base_bytes)  # a full one: params + Adam = 3x base
    # Each push moved the trained adapters only (fp32 on the CPU generator), under 2% of the model.
    pushed = [r["sync/bytes_pushed"] for r in _last_records(run) if "sync/bytes_pushed" in r]
    n_adapters = sum(v.size for v in ours.values())
    assert pushed and set(pushed) == {4.0 * n_adapters}
    assert n_adapters <= 0.02 * config.num_params()

    # Exports: merged HF directory and PEFT adapters, against the unmerged LoRA policy.
    merged_dir, peft_dir = tmp_path / "merged", tmp_path / "peft"
    argv = [f"--workdir={run}", f"--out={merged_dir}", "--merge_lora", f"--peft_out={peft_dir}"]
    assert export.main(argv) == 0
    assert export.main([f"--workdir={run}", f"--out={tmp_path / 'x'}"]) == 2  # needs --merge_lora
    lora, _ = run_dir.load_run_lora(str(run))
    _, adapters = run_dir.restore_adapters(str(run), config, lora)
    adapters = lora_lib.whole_adapters(config, lora, adapters)
    base_params = run_dir.load_base(base, config)
    graphdef, _ = lora_lib.abstract_lora(config, lora)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 14, (2, 7)), jnp.int32)
    unmerged = nnx.merge(graphdef, lora_lib.combine(base_params, adapters))(tokens)
    exported = hf.load_model(str(merged_dir))(tokens)
    np.testing.assert_allclose(np.asarray(exported), np.asarray(unmerged), rtol=1e-5, atol=2e-5)
    assert (peft_dir / "adapter_config.json").exists()
    assert (peft_dir / "adapter_model.safetensors").exists()
