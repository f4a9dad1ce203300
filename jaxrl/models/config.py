"""Decoder LM configuration, read from (and written back to) Hugging Face `transformers` configs.

One frozen dataclass covers the three supported families:

| family  | q/k/v bias | o bias       | q/k RMSNorm | head_dim              |
|---------|------------|--------------|-------------|-----------------------|
| llama   | attention_bias | attention_bias | no      | head_dim or hidden/heads |
| qwen2   | yes        | no           | no          | hidden/heads          |
| qwen3   | attention_bias | attention_bias | yes     | head_dim (free)       |
| qwen3_moe | attention_bias | attention_bias | yes   | head_dim (free)       |

qwen3_moe is qwen3 with sparse mixture-of-experts MLPs (`num_experts > 0`; `jaxrl.models.moe`).

Anything the model does not implement is refused when the config is read, with a message that
names the field, rather than silently computing something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class UnsupportedModelError(ValueError):
    """The checkpoint or config asks for something this model does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: `theta` plus an optional frequency scaling (`rope_type`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}). Use a checkpoint without this RoPE "
                "scaling or "
                "add the scaling to jaxrl/models/rope.py."
            )
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama 3 / Qwen2 / Qwen3 / Qwen3-MoE decoder plus the dtypes it runs in.

    `param_dtype` is the storage dtype of the weights; `dtype` is the compute dtype of matmuls and
    activations. Log-softmax and every log-prob are computed in float32 regardless.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    param_dtype: str = "float32"
    dtype: str = "float32"
    # None: the platform's own attention (CPU: the host forms; GPU: the Pallas Triton kernels,
    # `gpu_attention` for training / prefill self-attention and `decode_kernel` for decode;
    # TPU: the Pallas Mosaic kernels, `tpu_attention` and `decode_kernel_tpu`). "xla":
    # `jax.nn.dot_product_attention`'s XLA path on accelerators. "pallas": the target's Pallas
    # kernels (GPU, TPU: as None; a CPU program: the splash kernel in interpret mode,
    # `jaxrl.models.pallas_attention`). "cudnn": the cuDNN kernel on NVIDIA GPUs. The platform
    # is the one a program is compiled for (its mesh's devices), not the process's default
    # backend (docs/models.md, "Attention").
    attention_impl: str | None = None
    # Layers stacked on a leading `layers` axis and run by `nnx.scan` (one traced layer: compile
    # time and program size flat in depth) instead of a Python loop over `layers.0`, `layers.1`...
    scan_layers: bool = False
    # What the backward pass keeps of each layer's forward (`jaxrl.models.remat.REMAT_POLICIES`).
    remat_policy: str = "none"
    # Mixture of experts (Qwen3-MoE; `jaxrl.models.moe`). num_experts=0: every MLP dense (every
    # other family). A layer i is sparse when i is not in `mlp_only_layers` and
    # (i + 1) % decoder_sparse_step == 0, as transformers' Qwen3MoeDecoderLayer decides.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # The default weight of the load-balancing loss (HF `router_aux_loss_coef`).
    router_aux_loss_coef: float = 0.0

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {sorted(DTYPES)}")
        if self.attention_impl not in ("xla", "cudnn", "pallas", None):
            raise ValueError(
                f"attention_impl={self.attention_impl!r}; use 'xla', 'cudnn', 'pallas' or None"
            )
        self._check_moe()
        from jaxrl.models.remat import REMAT_POLICIES

        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"remat_policy={self.remat_policy!r}; choose one of {sorted(REMAT_POLICIES)}"
            )

    def _check_moe(self) -> None:
        if not isinstance(self.mlp_only_layers, tuple):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.num_experts < 0:
            raise ValueError(f"num_experts={self.num_experts}; use 0 (dense MLPs) or more")
        if self.num_experts == 0:  # dense (a qwen3_moe config with no experts is dense too)
            return
        if self.model_type != "qwen3_moe":
            raise UnsupportedModelError(
                f"num_experts={self.num_experts} with model_type {self.model_type!r}: mixture of "
                "experts is implemented for qwen3_moe only; use model_type 'qwen3_moe'"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} with num_experts="
                f"{self.num_experts}: each token is routed to its top-k experts, so k must be "
                f"between 1 and num_experts; fix num_experts_per_tok in config.json"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(
                f"moe_intermediate_size={self.moe_intermediate_size}: each expert's MLP width "
                "must be >= 1; set it from the checkpoint's config.json"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(
                f"decoder_sparse_step={self.decoder_sparse_step}; it must be >= 1 (1: every "
                "layer not in mlp_only_layers is sparse)"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"mlp_only_layers {bad} are not layers of a {self.num_layers}-layer model; "
                f"use indices in [0, {self.num_layers})"
            )
        sparse = self.moe_layers
        if self.scan_layers and 0 < len(sparse) < self.num_layers:
            raise UnsupportedModelError(
                f"scan_layers=True needs every layer alike, but layers {list(sparse)} are "
                "mixture-of-experts and the others dense (mlp_only_layers / "
                "decoder_sparse_step); use scan_layers=False for this checkpoint"
            )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The sparse (mixture-of-experts) layers; () for a dense model."""
        if self.num_experts == 0:
            return ()
        return tuple(
            i
            for i in range(self.num_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def jnp_param_dtype(self):
        return DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embeddings included, tied embeddings counted once)."""
        e, d, q, k = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        attn = e * d * (2 * q + 2 * k)
        if self.qkv_bias:
            attn += d * (q + 2 * k)
        if self.o_bias:
            attn += e
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * e * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + e
        layer = attn + mlp + 2 * e
        head = 0 if self.tie_word_embeddings else e * self.vocab_size
        sparse = len(self.moe_layers)
        # A sparse layer holds the router and the experts in place of the dense MLP.
        moe_delta = self.num_experts * (e + 3 * e * self.moe_intermediate_size) - mlp
        return self.vocab_size * e + self.num_layers * layer + sparse * moe_delta + e + head

    # --- Hugging Face interop -------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf_config: Any, **overrides: Any) -> ModelConfig:
        """Builds a config from a `transformers.PretrainedConfig` (as `AutoConfig` returns it).

        `overrides` set fields that HF configs do not carry (`param_dtype`, `dtype`,
        `attention_impl`).
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})."
            )
        if getattr(hf_config, "use_sliding_window", False):
            raise UnsupportedModelError(
                "use_sliding_window=True is not supported: this model implements full causal "
                "attention only. Set use_sliding_window=false in config.json if the checkpoint was "
                "trained without it."
            )
        layer_types = getattr(hf_config, "layer_types", None) or ()
        if any(t != "full_attention" for t in layer_types):
            raise UnsupportedModelError(
                f"layer_types {sorted(set(layer_types))} are not supported: only full_attention."
            )
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = attention_bias
        kwargs = dict(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope=_rope_from_hf(hf_config),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_id=_as_eos(getattr(hf_config, "eos_token_id", None)),
            pad_token_id=getattr(hf_config, "pad_token_id", None),
        )
        if model_type == "qwen3_moe":
            kwargs.update(_moe_from_hf(hf_config))
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if dtype is not None and str(dtype).removeprefix("torch.") in DTYPES:
            kwargs["param_dtype"] = str(dtype).removeprefix("torch.")
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf(self):
        """The equivalent `transformers` config (for export)."""
        import transformers

        rope_parameters = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type in ("linear", "llama3"):
            rope_parameters["factor"] = self.rope.factor
        if self.rope.rope_type == "llama3":
            rope_parameters.update(
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters=rope_parameters,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            dtype=self.param_dtype,
        )
        if self.model_type == "llama":
            return transformers.LlamaConfig(
                **common, attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias
            )
        if self.model_type == "qwen2":
            return transformers.Qwen2Config(**common, use_sliding_window=False)
        if self.model_type == "qwen3_moe":
            return transformers.Qwen3MoeConfig(
                **common,
                attention_bias=self.qkv_bias,
                use_sliding_window=False,
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        return transformers.Qwen3Config(
            **common, attention_bias=self.qkv_bias, use_sliding_window=False
        )


def _moe_from_hf(hf_config: Any) -> dict[str, Any]:
    """Qwen3-MoE's routing fields (`Qwen3MoeConfig`)."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported: the experts are SwiGLU")
    return dict(
        num_experts=int(hf_config.num_experts),
        num_experts_per_tok=int(hf_config.num_experts_per_tok),
        moe_intermediate_size=int(hf_config.moe_intermediate_size),
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        decoder_sparse_step=int(getattr(hf_config, "decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(int(i) for i in (getattr(hf_config, "mlp_only_layers", None) or ())),
        router_aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
    )


def _as_eos(value) -> int | tuple[int, ...] | None:
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return value


def _rope_from_hf(hf_config: Any) -> RopeConfig:
    """Reads RoPE settings from either spelling.

    transformers 5 writes `rope_parameters` (rope_theta inside); older hub configs carry
    `rope_scaling` + `rope_theta`. `AutoConfig` normalises both into `rope_parameters`, but a
    config object built by hand may still carry the old attributes.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(
            f"per-layer-type RoPE parameters ({sorted(params)}) are not supported"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    kwargs: dict[str, Any] = dict(theta=float(theta) if theta is not None else 10000.0)
    kwargs["rope_type"] = rope_type
    if rope_type in ("linear", "llama3"):
        kwargs["factor"] = float(params["factor"])
    if rope_type == "llama3":
        kwargs["low_freq_factor"] = float(params["low_freq_factor"])
        kwargs["high_freq_factor"] = float(params["high_freq_factor"])
        kwargs["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return RopeConfig(**kwargs)
