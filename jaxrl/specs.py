"""What a job trains: the policy (a preset or a checkpoint) and the task.

Frozen dataclasses that gin binds (see `launch/`), plus the builders that turn them into objects.
"""

from __future__ import annotations

import dataclasses
import os

from jaxrl.models import hf
from jaxrl.models import presets as model_presets
from jaxrl.models.config import _DTYPES as MODEL_DTYPES
from jaxrl.models.config import ModelConfig
from jaxrl.tasks.arithmetic import ArithmeticTask
from jaxrl.tasks.math_jsonl import DEFAULT_INSTRUCTION
from jaxrl.tasks.rewards import get_reward
from jaxrl.tasks.source import ArithmeticSource, JsonlMathSource
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer


def arith_tiny(vocab_size: int, tokenizer) -> ModelConfig:
    """The embedded default: a 2-layer, d=128 Llama (~0.4M params) for 1-2 digit arithmetic."""
    return ModelConfig(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


PRESETS = {
    "arith_tiny": arith_tiny,
    "rlbench_tiny": lambda v, t: model_presets.rlbench_tiny(
        max(v, 512),
        bos_token_id=t.bos_token_id,
        eos_token_id=t.eos_token_id,
        pad_token_id=t.pad_token_id,
    ),
}


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """The policy: a named preset trained from scratch (or from the SFT stage), or `init_from`, a
    HF `save_pretrained` directory or another run's workdir.

    vocab_multiple: presets round the tokenizer's vocabulary up to a multiple of this, so the
      vocabulary splits over tensor-parallel meshes (the extra ids are never produced by the
      tokenizer).
    """

    preset: str = "arith_tiny"
    init_from: str = ""
    param_dtype: str = "float32"
    dtype: str = "float32"
    vocab_multiple: int = 64

    def validate(self) -> None:
        if not self.init_from and self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r}; known presets: {sorted(PRESETS)}")
        if self.init_from and not os.path.isdir(self.init_from):
            raise ValueError(f"init_from={self.init_from!r} is not a directory")
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple={self.vocab_multiple} must be >= 1")
        for name in ("param_dtype", "dtype"):  # checked here, before the workdir is made
            if getattr(self, name) not in MODEL_DTYPES:
                raise ValueError(
                    f"{name}={getattr(self, name)!r}; choose one of {sorted(MODEL_DTYPES)}"
                )


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The prompts and the reward.

    name: "arithmetic" (synthetic, offline) or "math_jsonl" (GSM8K / MATH-style files).
    reward: a registered reward name; empty = the task's own verifiable reward.
    instruction (math_jsonl): appended to each question in the user turn; "" = none.
    """

    name: str = "arithmetic"
    min_digits: int = 1
    max_digits: int = 2
    operators: str = "+"
    train_path: str = ""
    eval_path: str = ""
    reward: str = ""
    seed: int = 0
    instruction: str = DEFAULT_INSTRUCTION

    def validate(self) -> None:
        if self.name not in ("arithmetic", "math_jsonl"):
            raise ValueError(f"task name={self.name!r}; use 'arithmetic' or 'math_jsonl'")
        if self.name == "math_jsonl" and not self.train_path:
            raise ValueError("task math_jsonl needs train_path (a jsonl of question/answer)")
        for path in (self.train_path, self.eval_path):
            if path and not os.path.isfile(path):
                raise ValueError(f"{path!r}: no such file")
        if self.name == "arithmetic":
            ArithmeticTask(
                min_digits=self.min_digits, max_digits=self.max_digits, operators=self.operators
            )
        if self.reward:  # a reward that cannot be imported fails now, not after the SFT stage
            try:
                get_reward(self.reward)
            except (KeyError, TypeError) as e:
                raise ValueError(str(e).strip("\"'")) from None


def build_tokenizer(policy: PolicySpec, task: TaskSpec):
    """The checkpoint's tokenizer when starting from one, else the task's offline tokenizer."""
    if policy.init_from:
        tokenizer_dir = policy.init_from
        if os.path.isdir(os.path.join(policy.init_from, "model")):  # a run's workdir
            tokenizer_dir = os.path.join(policy.init_from, "model")
        return hf.load_tokenizer(tokenizer_dir)
    # A preset trained from scratch uses the offline character tokenizer, whatever the task: on
    # math_jsonl it spells lowercase text, digits and punctuation (a pipeline check on a tiny
    # file, configs/rl/gsm8k_tiny.gin); real GSM8K / MATH runs start from a model (init_from).
    return build_arithmetic_tokenizer()


def build_model_config(policy: PolicySpec, tokenizer) -> ModelConfig:
    overrides = dict(param_dtype=policy.param_dtype, dtype=policy.dtype)
    if policy.init_from:
        config_dir = policy.init_from
        if os.path.isdir(os.path.join(policy.init_from, "model")):
            config_dir = os.path.join(policy.init_from, "model")
        return hf.load_config(config_dir, **overrides)
    m = policy.vocab_multiple
    vocab = -(-len(tokenizer) // m) * m
    return PRESETS[policy.preset](vocab, tokenizer).replace(**overrides)


def build_source(task: TaskSpec, tokenizer, max_prompt_tokens: int | None = None):
    """The task's prompt source. `max_prompt_tokens` (math_jsonl): problems whose prompt is
    longer are left out, with a count (the model's context minus the tokens to generate)."""
    if task.name == "arithmetic":
        return ArithmeticSource(
            ArithmeticTask(
                min_digits=task.min_digits,
                max_digits=task.max_digits,
                operators=task.operators,
                seed=task.seed,
            )
        )
    return JsonlMathSource(
        task.train_path,
        task.eval_path or None,
        tokenizer,
        seed=task.seed,
        instruction=task.instruction,
        max_prompt_tokens=max_prompt_tokens,
    )


def reward_name(task: TaskSpec, source) -> str:
    return task.reward or source.reward_name
