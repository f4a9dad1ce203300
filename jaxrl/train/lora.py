"""LoRA adapters on the policy through qwix (the library Tunix uses for LoRA on Flax NNX).

A targeted projection `y = x @ W` (W `[*K, *N]`: the kernel as stored, e.g. q `[E, H, D]`,
o `[H, D, E]`, gate `[E, F]`) becomes

    y = x @ W + (alpha / r) * (x @ A) @ B,   A `[prod K, r]` (he-uniform), B `[r, prod N]` (zeros)

so a fresh adapter leaves the model bit for bit unchanged (B = 0 adds exact zeros). qwix
intercepts `jax.lax.dot_general` inside `Transformer.hidden_states` (the method the trainer and
the sampler both call) and creates `{name}_lora_a` / `{name}_lora_b` (`nnx.LoRAParam`) next to
each kernel of a module whose path (e.g. `layers/3/attention`) matches `target_modules`; the
adapters inherit the kernel's logical sharding names on their K / N sides.

Adapter params ("adapters") are a pure dict holding only the LoRA leaves; base params the usual
pure dict of the plain model. `combine(base, adapters)` is what the LoRA graphdef merges.

Scanned layers (`ModelConfig.scan_layers`) are refused: qwix creates the adapters during a
forward pass, which under `nnx.scan` happens inside a trace. So are the expert projections of a
mixture-of-experts model's sparse MLPs (grouped `ragged_dot` matmuls, which qwix cannot adapt);
attention adapters (and the dense layers' MLPs) on an MoE model train.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer, causal_mask, positions_from_mask

Params = dict

# Projections of each targetable module, and their names in HF / PEFT checkpoints.
_HF_PROJ = {
    "attention": {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                  "o": "self_attn.o_proj"},
    "mlp": {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"},
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (the update is scaled by alpha / r), and `target_modules`: a regex that
    must match a module's whole path, e.g. `layers/0/attention` (q, k, v, o) or
    `layers/0/mlp` (gate, up, down). `target_kernels`: a regex that must match the whole name of
    a projection of those modules (`q`, `k`, `v`, `o`, `gate`, `up`, `down`), e.g. `q|v` for
    the LoRA paper's W_q, W_v choice; the default takes them all. Dropout is 0 (adapters are
    deterministic).

    b_lr_ratio: LoRA+ (Hayou et al., 2024): B's learning rate is `b_lr_ratio` x A's (the
    optimizer's updates of every `*_lora_b` leaf are scaled by it, after Adam, so the schedule
    and the clipping stay shared); 1 is plain LoRA.

    freeze_a: LoRA-FA (Zhang et al., 2023): every A stays at its initialisation (he-uniform
    from `seed`, rebuilt identically wherever the model is built) and only B is trained, so the
    optimizer state, the checkpoints and each weight push hold B alone: `r x out` numbers a
    kernel instead of `r x (in + out)`. A is frozen like the base and held once beside it (the
    trainer's and the generator's `base_params`)."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: str = r"layers/\d+/(attention|mlp)"
    target_kernels: str = ".*"
    seed: int = 0
    b_lr_ratio: float = 1.0
    freeze_a: bool = False

    def validate(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoraConfig.rank={self.rank} must be >= 1")
        if not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha={self.alpha} must be > 0")
        for field in ("target_modules", "target_kernels"):
            try:
                re.compile(getattr(self, field))
            except re.error as e:
                raise ValueError(f"LoraConfig.{field}={getattr(self, field)!r}: {e}") from None
        if not self.b_lr_ratio > 0:
            raise ValueError(f"LoraConfig.b_lr_ratio={self.b_lr_ratio} must be > 0 (1: plain LoRA)")

    def __post_init__(self):
        self.validate()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def with_b_lr_ratio(tx, lora: LoraConfig):
    """`tx` followed by LoRA+'s scaling of the `*_lora_b` updates (`tx` itself at ratio 1, so
    plain-LoRA optimizer states keep their structure)."""
    import optax

    if lora.b_lr_ratio == 1.0:
        return tx
    ratio = lora.b_lr_ratio

    def scale(updates, params=None):
        del params

        def leaf(path, u):
            return u * ratio if str(getattr(path[-1], "key", "")).endswith("_lora_b") else u

        return jax.tree_util.tree_map_with_path(leaf, updates)

    return optax.chain(tx, optax.stateless(scale))


def _check_model(config: ModelConfig, lora: LoraConfig) -> None:
    """Refuses, before anything is built, what qwix cannot adapt: scanned layers, and the
    expert projections of a mixture-of-experts model's sparse MLPs."""
    if config.scan_layers:
        raise ValueError(
            "LoRA needs unrolled layers: qwix creates the adapters during a forward pass, which "
            "under nnx.scan runs inside a trace; set ModelConfig.scan_layers=False "
            "(PolicySpec.scan_layers = False in gin)"
        )
    modules, kernels = re.compile(lora.target_modules), re.compile(lora.target_kernels)
    sparse = [i for i in config.moe_layers if modules.fullmatch(f"layers/{i}/mlp")]
    experts = [k for k in ("gate", "up", "down") if kernels.fullmatch(k)]
    if sparse and experts:
        # The experts run as `ragged_dot` grouped matmuls: qwix either fails inside them
        # (TraceContextError, the default targets) or silently adds no adapter.
        raise ValueError(
            f"LoRA on mixture-of-experts policies is not supported yet: "
            f"LoraConfig.target_modules={lora.target_modules!r} with target_kernels="
            f"{lora.target_kernels!r} targets the expert projections {experts} of the sparse "
            f"MLPs of layers {sparse}, which qwix cannot adapt (their grouped matmuls fail "
            "inside qwix with a TraceContextError). Adapt attention only, "
            r"LoraConfig(target_modules=r'layers/\d+/attention') (LoraConfig.target_modules = "
            r"'layers/\d+/attention' in gin), or train the full model (no LoRA)"
        )


class _RestoredOriginals(dict):
    """qwix's table of the functions it patched, name -> original, answering a name it no longer
    holds with the function now at that path (the original, restored).

    qwix patches a function process-wide while any thread runs an intercepted forward pass
    (`jnp.asarray`, `lax.dot_general`, ...), and a call from another thread is sent through the
    patch to the original it looks up in this table. The async loops trace in two threads at
    once: when the generator's forward pass ends and qwix removes the patch (and the entry)
    after the trainer's call has entered the patched function but before it looked the entry
    up, that lookup raised `KeyError: 'jax.numpy.asarray.__code__'` (qwix 0.1.8). The missing
    entry means the patch is gone, so the function at the path is the original again."""

    def __missing__(self, name: str):
        from qwix._src import interception

        owner, attr = interception._resolve_path(name)
        return owner if attr == "__code__" else getattr(owner, attr)


def _guard_qwix_threads() -> None:
    """Installs `_RestoredOriginals` as qwix's table (once, keeping its entries)."""
    from qwix._src import interception

    manager = interception.interception_manager
    with manager._lock:
        if not isinstance(manager._original_fns, _RestoredOriginals):
            manager._original_fns = _RestoredOriginals(manager._original_fns)


def _provider(lora: LoraConfig):
    """qwix's `LoraProvider` for `lora`'s modules, restricted to the kernels `target_kernels`
    names. qwix selects by module path only (its rules carry no parameter name), so the
    restriction looks the kernel's name up as qwix itself does (`flax_util.find_param`, qwix
    0.1.8, pinned) and lets any other projection through as the plain matmul."""
    import qwix
    from qwix._src.providers import ptq
    from qwix._src.utils import flax_util

    _guard_qwix_threads()
    kernels = re.compile(lora.target_kernels)

    class KernelLoraProvider(qwix.LoraProvider):
        def dot_general(self, lhs, rhs, *args, **kwargs):
            name = flax_util.find_param(rhs, ptq.WithAux)
            if name is not None and not kernels.fullmatch(name.removesuffix("_kernel")):
                return ptq.PtqProvider.dot_general(self, lhs, rhs, *args, **kwargs)
            return super().dot_general(lhs, rhs, *args, **kwargs)

    return KernelLoraProvider(
        module_path=lora.target_modules, rank=lora.rank, alpha=lora.alpha, dropout=0.0
    )


def apply_lora(model: Transformer, lora: LoraConfig) -> Transformer:
    """A copy of `model` with zero-B adapters on the targeted projections (qwix)."""
    import qwix

    _check_model(model.config, lora)
    provider = _provider(lora)
    tokens = jnp.zeros((1, 2), jnp.int32)
    valid = jnp.ones((1, 2), bool)
    lora_model = qwix.apply_lora_to_model(
        model,
        provider,
        tokens,
        positions_from_mask(valid),
        causal_mask(valid),
        methods=("hidden_states",),
        rngs=nnx.Rngs(params=jax.random.key(lora.seed)),
    )
    if not adapter_names(nnx.to_pure_dict(nnx.state(lora_model, nnx.LoRAParam))):
        raise ValueError(
            f"LoraConfig.target_modules={lora.target_modules!r} with target_kernels="
            f"{lora.target_kernels!r} matched no projection; module paths look like "
            "'layers/0/attention' (kernels q, k, v, o) and 'layers/0/mlp' (gate, up, down)"
        )
    return lora_model


def lora_model(config: ModelConfig, lora: LoraConfig, seed: int = 0) -> Transformer:
    """A random-init model with adapters (tests; the trainer builds adapters abstractly)."""
    _check_model(config, lora)  # before the model is built
    return apply_lora(Transformer(config, rngs=nnx.Rngs(seed)), lora)


def abstract_lora(config: ModelConfig, lora: LoraConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The LoRA model's graphdef and its abstract adapter state (with sharding metadata)."""
    model = nnx.eval_shape(lambda: lora_model(config, lora))
    graphdef, _ = nnx.split(model)
    return graphdef, nnx.state(model, nnx.LoRAParam)


def init_adapters(config: ModelConfig, lora: LoraConfig) -> Params:
    """Fresh adapters (A he-uniform from `lora.seed`, B zeros) as a pure dict. Jitted: the
    random base it is built on and the forward pass qwix runs are dead code and cost nothing."""
    make = lambda: nnx.to_pure_dict(nnx.state(lora_model(config, lora), nnx.LoRAParam))
    return jax.jit(make)()


def _select(tree: Params, keep) -> Params:
    """The leaves of a nested dict whose own key `keep(key)` accepts, dicts emptied by it
    dropped."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            sub = _select(value, keep)
            if sub:
                out[key] = sub
        elif keep(str(key)):
            out[key] = value
    return out


def trained_part(adapters: Params, lora: LoraConfig) -> Params:
    """The adapter leaves the trainer optimizes and pushes: all, or with `freeze_a` the B's."""
    return _select(adapters, lambda k: k.endswith("_lora_b")) if lora.freeze_a else adapters


def frozen_part(adapters: Params, lora: LoraConfig) -> Params:
    """The adapter leaves held beside the base: none, or with `freeze_a` the A's."""
    return _select(adapters, lambda k: k.endswith("_lora_a")) if lora.freeze_a else {}


def whole_adapters(config: ModelConfig, lora: LoraConfig, trained: Params) -> Params:
    """Every adapter leaf (A's and B's) from the `trained` part a checkpoint holds: with
    `freeze_a`, the A's rebuilt from the seed added; otherwise `trained` itself."""
    if not lora.freeze_a:
        return trained
    return combine(frozen_part(init_adapters(config, lora), lora), trained)


def adapter_names(adapters: Params) -> list[str]:
    """'layers/0/attention/q_kernel'-style names of the adapted kernels."""
    out = []
    for path, _ in jax.tree_util.tree_leaves_with_path(adapters):
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        if keys[-1].endswith("_lora_a"):
            out.append("/".join([*keys[:-1], keys[-1][: -len("_lora_a")]]))
    return out


def combine(base: Params, adapters: Params) -> Params:
    """`base` with the adapter leaves added (a new dict tree; the arrays are shared)."""
    out = dict(base)
    for key, value in adapters.items():
        out[key] = combine(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


def zero_adapters(adapters: Params) -> Params:
    """Adapters that are off: B = 0 makes every delta exactly zero (the frozen base policy)."""

    def one(path, x):
        name = str(getattr(path[-1], "key", path[-1]))
        return jnp.zeros_like(x) if name.endswith("_lora_b") else x

    return jax.tree_util.tree_map_with_path(one, adapters)


def _walk(adapters: Params):
    """(path tuple, kernel name, A, B) for each adapted kernel."""
    found = []

    def visit(node, path):
        for key, value in node.items():
            if isinstance(value, dict):
                visit(value, (*path, key))
            elif str(key).endswith("_lora_a"):
                kernel = str(key)[: -len("_lora_a")]
                found.append((path, kernel, value, node[f"{kernel}_lora_b"]))

    visit(adapters, ())
    return found


def merge(base: Params, adapters: Params, lora: LoraConfig) -> Params:
    """Plain-model params with `W + (alpha / r) * (A @ B)` folded in (computed in float32)."""
    return jax.jit(lambda b, a: _merge(b, a, lora))(base, adapters)


def _merge(base: Params, adapters: Params, lora: LoraConfig) -> Params:
    out = jax.tree.map(lambda x: x, base)  # a fresh tree to write into
    for path, kernel, a, b in _walk(adapters):
        node = out
        for key in path:
            node = node[key]
        w = node[kernel]
        delta = jnp.asarray(a, jnp.float32) @ jnp.asarray(b, jnp.float32)
        node[kernel] = (jnp.asarray(w, jnp.float32) + lora.scale * delta.reshape(w.shape)).astype(
            w.dtype
        )
    return out


def count_params(tree: Any) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def tree_bytes(tree: Any, dtype=None) -> int:
    """Bytes of one copy of `tree` (in `dtype` if given, else each leaf's own)."""
    return sum(
        math.prod(x.shape) * np.dtype(dtype or x.dtype).itemsize for x in jax.tree.leaves(tree)
    )


# --- PEFT export ----------------------------------------------------------------------------------


def save_peft(adapters: Params, lora: LoraConfig, path: str, base_model: str = "") -> None:
    """Writes `adapter_config.json` + `adapter_model.safetensors` (PEFT's LoRA layout) that
    `peft.PeftModel.from_pretrained(hf_base, path)` loads.

    PEFT stores `lora_A.weight` `[r, in]` and `lora_B.weight` `[out, r]` with the update
    `(lora_alpha / r) * B @ A` on a torch `[out, in]` weight; our A `[in, r]`, B `[r, out]` (with
    `in`, `out` flattened in the order the HF export flattens heads) are their transposes.
    """
    from jaxrl.models.safetensors_io import write_safetensors

    tensors, targets = {}, set()
    for where, kernel, a, b in _walk(adapters):
        layer, module = where[1], where[2]
        proj = _HF_PROJ[module][kernel.removesuffix("_kernel")]
        targets.add(proj.split(".")[-1])
        prefix = f"base_model.model.model.layers.{layer}.{proj}"
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a, np.float32).T)
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(np.asarray(b, np.float32).T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors)
