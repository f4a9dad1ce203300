"""What a run's workdir holds, so that every job (sft, rl, eval, generate, export) reads it alike.

```
WORKDIR/
  config.gin          the operative gin config (jaxrl.infra.launcher)
  model/              the policy's HF config.json and tokenizer (no weights)
  checkpoints/<step>/ Orbax: `state` = {"params": ..., "opt_state": ..., ...}, `extra` = JSON
  metrics.jsonl       one JSON object per logged step
  lora.json           a LoRA run's adapter config and base (its checkpoints hold adapters only)
```

`model/` makes a workdir self-describing: the architecture and tokenizer are read from it, the
weights from the newest (or a chosen) checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
from flax import nnx

from jaxrl.infra.checkpoint import CheckpointConfig, Checkpointer, CheckpointMismatchError
from jaxrl.infra.run_io import checkpoint_dir
from jaxrl.infra.sharding import attach_shardings
from jaxrl.models import hf
from jaxrl.models.config import ModelConfig
from jaxrl.models.scan import convert_layer_layout, layer_layout_shardings
from jaxrl.models.transformer import Transformer
from jaxrl.train import lora as lora_lib

MODEL_DIR = "model"
PARAMS_KEY = "params"
LORA_FILE = "lora.json"


def model_dir(workdir: str) -> str:
    return os.path.join(workdir, MODEL_DIR)


def save_model_spec(workdir: str, config: ModelConfig, tokenizer=None) -> None:
    """Writes the policy's HF `config.json` (and tokenizer) to `WORKDIR/model/` (process 0 of a
    multi-process job; the others have nothing to write)."""
    import jax

    if jax.process_index() != 0:
        return
    path = model_dir(workdir)
    os.makedirs(path, exist_ok=True)
    config.to_hf().save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def load_model_spec(workdir: str, **config_overrides: Any) -> tuple[ModelConfig, Any]:
    """(ModelConfig, tokenizer or None) of the run in `workdir`."""
    path = model_dir(workdir)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{workdir} has no {MODEL_DIR}/ directory: it is not the workdir of a jaxrl run "
            "(or the run never started)."
        )
    config = hf.load_config(path, **config_overrides)
    has_tokenizer = any(n.startswith("tokenizer") for n in os.listdir(path))
    return config, hf.load_tokenizer(path) if has_tokenizer else None


def restore_params(
    workdir: str,
    config: ModelConfig,
    *,
    step: int | None = None,
    shardings: Any | None = None,
) -> tuple[int, nnx.State]:
    """Only the params of checkpoint `step` (default: newest finished) as an `nnx.State`.

    The optimizer state and anything else in the checkpoint is not read. `shardings` (a state of
    `Sharding`s as `param_shardings` returns) places them; by default they go to the first device.
    A checkpoint whose layers are laid out the other way (`ModelConfig.scan_layers`: stacked or
    one subtree per layer) is restored in its own layout and converted on the devices.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    abstract_params = nnx.to_pure_dict(abstract)
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract_params)
    elif isinstance(shardings, nnx.State):
        shardings = nnx.to_pure_dict(shardings)
    try:
        restored_step, params = _restore_pure_params(workdir, step, abstract_params, shardings)
    except CheckpointMismatchError as mismatch:
        other = config.replace(scan_layers=not config.scan_layers)
        _, other_abstract = nnx.split(nnx.eval_shape(lambda: Transformer(other, rngs=nnx.Rngs(0))))
        other_abstract = nnx.to_pure_dict(other_abstract)
        other_shardings = layer_layout_shardings(shardings, other_abstract, other.scan_layers)
        try:
            restored_step, saved = _restore_pure_params(
                workdir, step, other_abstract, other_shardings
            )
        except CheckpointMismatchError:
            raise mismatch from None
        params = convert_layer_layout(saved, config.num_layers, config.scan_layers, shardings)
    nnx.replace_by_pure_dict(abstract, params)
    return restored_step, abstract


def _restore_pure_params(workdir, step, abstract_params, shardings):
    target = {PARAMS_KEY: attach_shardings(abstract_params, shardings)}
    with Checkpointer(checkpoint_dir(workdir), CheckpointConfig(), read_only=True) as ckpt:
        restored = ckpt.restore(step, abstract_target=target, partial=True)
    return restored.step, restored.state[PARAMS_KEY]


def load_policy(workdir: str, *, step: int | None = None, **config_overrides: Any):
    """(step, Transformer, tokenizer) of a run: the architecture from `model/`, the weights from
    the checkpoint. A LoRA run's checkpoints hold adapters only: its policy is the base it
    recorded (`lora.json`) with the checkpoint's adapters merged in."""
    if load_run_lora(workdir) is not None:
        step, model, _, _, _, tokenizer = load_lora_policy(workdir, step, **config_overrides)
        return step, model, tokenizer
    config, tokenizer = load_model_spec(workdir, **config_overrides)
    step, params = restore_params(workdir, config, step=step)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    return step, nnx.merge(graphdef, params), tokenizer


def save_run_lora(workdir: str, lora: lora_lib.LoraConfig, base: str) -> None:
    """Records a LoRA run's adapter config and where its frozen base comes from (a run workdir
    or an HF directory), so that export can merge without being told. A base inside the
    workdir (the SFT stage's `sft/`) is recorded relative to it, so that a moved or copied
    workdir still finds its own; any other base by its absolute path."""
    os.makedirs(workdir, exist_ok=True)
    base = os.path.abspath(base)
    inside = os.path.relpath(base, os.path.abspath(workdir))
    if inside != os.pardir and not inside.startswith(os.pardir + os.sep):
        base = inside
    with open(os.path.join(workdir, LORA_FILE), "w") as f:
        json.dump(dataclasses.asdict(lora) | {"base": base}, f, indent=2)


def load_run_lora(workdir: str) -> tuple[lora_lib.LoraConfig, str] | None:
    """(LoraConfig, base path) of the LoRA run in `workdir` (None: not a LoRA run). A relative
    base is the workdir's own (see `save_run_lora`); an absolute one, as older runs recorded
    every base, is returned as is."""
    path = os.path.join(workdir, LORA_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        record = json.load(f)
    base = record.pop("base")
    if not os.path.isabs(base):
        base = os.path.normpath(os.path.join(workdir, base))
    return lora_lib.LoraConfig(**record), base


def restore_adapters(workdir: str, config: ModelConfig, lora: lora_lib.LoraConfig, step=None):
    """(step, adapters) of a LoRA run's checkpoint `step` (default newest), on the first device."""
    _, abstract = lora_lib.abstract_lora(config, lora)
    abstract = lora_lib.trained_part(nnx.to_pure_dict(abstract), lora)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, abstract)
    return _restore_pure_params(workdir, step, abstract, shardings)


def load_base(source: str, config: ModelConfig) -> lora_lib.Params:
    """A LoRA run's frozen base from `source`: a jaxrl run workdir or an HF directory."""
    if os.path.isdir(checkpoint_dir(source)):
        _, params = restore_params(source, config)
    else:
        params = hf.load_params(source, config)
    return nnx.to_pure_dict(params)


def load_lora_policy(workdir: str, step=None, **config_overrides: Any):
    """(step, merged plain Transformer, adapters, LoraConfig, base source, tokenizer) of a LoRA
    run: the base from where the run recorded it (`lora.json`), the adapters from the run's
    checkpoint."""
    record = load_run_lora(workdir)
    if record is None:
        raise ValueError(f"{workdir} has no {LORA_FILE}: it is not a LoRA run")
    lora, source = record
    if not os.path.isdir(source):
        raise FileNotFoundError(
            f"{os.path.join(workdir, LORA_FILE)} records the run's frozen base at {source}, "
            "which does not exist (moved or deleted?); put the base back there or edit "
            "'base' in that file (a path relative to the workdir is the workdir's own)"
        )
    config, tokenizer = load_model_spec(workdir, **config_overrides)
    step, adapters = restore_adapters(workdir, config, lora, step)
    adapters = lora_lib.whole_adapters(config, lora, adapters)  # LoRA-FA: checkpoints hold the B's
    merged = lora_lib.merge(load_base(source, config), adapters, lora)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(abstract, merged)
    return step, nnx.merge(graphdef, abstract), adapters, lora, source, tokenizer
