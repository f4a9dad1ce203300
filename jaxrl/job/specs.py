"""What a job trains: the policy (a preset or a checkpoint) and the task.

Frozen dataclasses that gin binds (see `launch/`), plus the builders that turn them into objects.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import jaxrl.env.calculator  # noqa: F401  (registers the "calculator" task)
import jaxrl.env.chat_calculator  # noqa: F401  (registers the "calculator_chat" task)
from jaxrl.env.calculator import calculator_task
from jaxrl.infra.paths import user_path
from jaxrl.models import hf
from jaxrl.models import presets as model_presets
from jaxrl.models.config import DTYPES as MODEL_DTYPES
from jaxrl.models.config import ModelConfig
from jaxrl.models.remat import REMAT_POLICIES
from jaxrl.tasks.arithmetic import ArithmeticTask
from jaxrl.tasks.chain import ChainTask
from jaxrl.tasks.chat import answer_format, check_format_is_asked, stop_token_ids
from jaxrl.tasks.math_jsonl import DEFAULT_INSTRUCTION
from jaxrl.tasks.rewards import get_reward
from jaxrl.tasks.source import PromptSource, get_task
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


def arith_tiny_moe(vocab_size: int, tokenizer) -> ModelConfig:
    """`arith_tiny` with sparse MLPs (Qwen3-MoE, q/k RMSNorm): in both layers 8 SwiGLU experts of
    width 192, top 2 renormalised, so a token's active MLP is arith_tiny's (2 x 192 = 384): 1.3M
    parameters, 0.41M active, as arith_tiny's 0.41M. Load-balancing loss weight 0.01
    (`LossConfig.router_aux_loss_coef` overrides it). docs/models.md, "A tiny MoE policy"."""
    return arith_tiny(vocab_size, tokenizer).replace(
        model_type="qwen3_moe",
        qk_norm=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=192,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
    )


# `PolicySpec.scan_layers = None` scans models with more layers than this: deep enough that the
# unrolled program's compile time matters, shallow test models stay unrolled.
SCAN_LAYERS_ABOVE = 8


def chain_tiny(vocab_size: int, tokenizer) -> ModelConfig:
    """`arith_tiny` with a 128-token context: chain sums of 16 operands take 33 prompt tokens
    and up to 50 completion tokens (same parameters: positions are rotary)."""
    return arith_tiny(vocab_size, tokenizer).replace(max_position_embeddings=128)


PRESETS = {
    "arith_tiny": arith_tiny,
    "chain_tiny": chain_tiny,
    "arith_tiny_moe": arith_tiny_moe,
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
    scan_layers: stack the layers and run them under `nnx.scan` (compile time flat in depth);
      checkpoints of either layout restore into either. None (default): scanned for models
      deeper than `SCAN_LAYERS_ABOVE` layers (a Llama 3 8B has 32), unrolled for shallower
      ones and for LoRA runs (qwix cannot attach adapters inside `nnx.scan`).
    remat_policy: what the backward pass keeps of each layer (`jaxrl.models.remat`).
    requires_init_from: set by a config written for a pretrained model: the model and where to
      get it. A launch of that config without `init_from` is refused before any work (a preset
      from random weights cannot read the config's chat prompts or fit its budgets).
    """

    # Fields that name files: `~` expanded here; stored absolute in a run's config.gin
    # (`jaxrl.infra.config.parse_gin`), so the run finds them from any working directory.
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("init_from",)

    preset: str = "arith_tiny"
    init_from: str = ""
    param_dtype: str = "float32"
    dtype: str = "float32"
    vocab_multiple: int = 64
    scan_layers: bool | None = None
    remat_policy: str = "none"
    requires_init_from: str = ""

    def __post_init__(self):
        _expand_paths(self)

    def validate(self) -> None:
        if self.requires_init_from and not self.init_from:
            raise ValueError(
                f"init_from is not set, and this config starts from a pretrained model: "
                f"{self.requires_init_from}. Add --gin_param=\"PolicySpec.init_from = 'DIR'\" "
                "with its save_pretrained directory"
            )
        if not self.init_from and self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r}; known presets: {sorted(PRESETS)}")
        if self.init_from and not os.path.isdir(self.init_from):
            exists = os.path.exists(self.init_from)
            what = "is a file, not a directory" if exists else "does not exist"
            gguf = ""
            if self.init_from.lower().endswith(".gguf"):  # a GGUF file: imported first
                gguf = (
                    "; import the GGUF into one first: python -m launch.import_gguf "
                    f"--gguf={self.init_from} --out=DIR, then init_from=DIR"
                )
            raise ValueError(
                f"init_from={self.init_from!r} {what} (a save_pretrained directory or a run's "
                f"workdir){gguf}"
            )
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple={self.vocab_multiple} must be >= 1")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"remat_policy={self.remat_policy!r}; choose one of {sorted(REMAT_POLICIES)}"
            )
        for name in ("param_dtype", "dtype"):  # checked here, before the workdir is made
            if getattr(self, name) not in MODEL_DTYPES:
                raise ValueError(
                    f"{name}={getattr(self, name)!r}; choose one of {sorted(MODEL_DTYPES)}"
                )


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The prompts and the reward.

    name: a registered task (`jaxrl.tasks.source.register_task`): "arithmetic" (synthetic,
      offline), "math_jsonl" (GSM8K / MATH-style files), "calculator" (multi-turn tool use,
      `jaxrl.env.calculator`; operators "*" or "*+"), "calculator_chat" (the same in a chat
      template's tool-call form, `jaxrl.env.chat_calculator`), or one registered by a module the gin
      file imports; or "package.module:factory". A task without `PolicySpec.init_from` uses the
      offline character tokenizer of the arithmetic task.
    reward: a registered reward name or "package.module:function"; empty = the source's own
      `reward_name`.
    The other fields are read by the built-in tasks; a user task's factory gets this TaskSpec and
    may read `seed` (its own settings are best bound in gin on the factory itself).
    min_operands, max_operands (chain_sum): the operand count's range (`jaxrl.tasks.chain`).
    instruction (math_jsonl, reasoning_gym): appended to each question in the user turn; "" =
      none. The default asks for `\\boxed{}`, which answer_format "boxed" reads.
    dataset, dataset_config (reasoning_gym): a reasoning-gym dataset name and the fields of its
      config dataclass (e.g. {"min_terms": 2, "max_digits": 2}; seed and size are the task's).
    system_prompt (reasoning_gym): the system turn; None keeps the chat template's default.
    answer_format (reasoning_gym): where the reply's final answer is read
      (`jaxrl.tasks.chat.ANSWER_FORMATS`: "boxed", "answer_tag", "last_number", "text").
    heldout_size (reasoning_gym): distinct held-out questions set aside (>= the eval size).
    tool_disabled (calculator, calculator_chat): the environment answers every tool call
      without its value (`=?`; in chat form `{"result": "?"}`), a control: tool use then gains
      nothing; SFT demonstrations are unchanged.
    min_digits_b, max_digits_b (calculator, calculator_chat): the second factor's digit range
      (b in a*b), e.g. min_digits = max_digits = 3 with 2 here for 3-digit x 2-digit products;
      None: the first factor's.
    few_shot (calculator_chat): (a, b) pairs, each a worked exchange (question, tool call, the
      tool's result, the answer) rendered as turns of the conversation before the question, so
      that an instruct model starts out calling the tool; () = none.
    """

    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("train_path", "eval_path")  # as PolicySpec's

    name: str = "arithmetic"
    min_digits: int = 1
    max_digits: int = 2
    operators: str = "+"
    min_operands: int = 2
    max_operands: int = 16
    train_path: str = ""
    eval_path: str = ""
    reward: str = ""
    seed: int = 0
    instruction: str = DEFAULT_INSTRUCTION
    dataset: str = ""
    dataset_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    system_prompt: str | None = None
    answer_format: str = "boxed"
    heldout_size: int = 1024
    tool_disabled: bool = False
    min_digits_b: int | None = None
    max_digits_b: int | None = None
    few_shot: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        _expand_paths(self)
        object.__setattr__(self, "few_shot", _pairs(self.few_shot))

    def validate(self) -> None:
        try:
            get_task(self.name)
        except (KeyError, TypeError) as e:
            raise ValueError(str(e).strip('"')) from None
        if self.name == "math_jsonl" and not self.train_path:
            raise ValueError("task math_jsonl needs train_path (a jsonl of question/answer)")
        for field in self.PATH_FIELDS:
            path = getattr(self, field)
            if path and not os.path.isfile(path):
                what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
                raise ValueError(f"{field}={path!r} {what}")
        if self.name == "arithmetic":
            ArithmeticTask(
                min_digits=self.min_digits, max_digits=self.max_digits, operators=self.operators
            )
        if self.name == "chain_sum":
            ChainTask(min_operands=self.min_operands, max_operands=self.max_operands)
        if self.name == "reasoning_gym":
            from jaxrl.tasks.reasoning_gym import check_dataset

            if not self.dataset:
                raise ValueError(
                    "task reasoning_gym needs TaskSpec.dataset (a reasoning-gym dataset name, "
                    "e.g. 'basic_arithmetic')"
                )
            check_dataset(self.dataset, dict(self.dataset_config))
            answer_format(self.answer_format)
            check_format_is_asked(self.answer_format, self.instruction, self.system_prompt)
            if self.heldout_size < 1:
                raise ValueError(f"TaskSpec.heldout_size={self.heldout_size} must be >= 1")
        if self.name in ("calculator", "calculator_chat"):
            calculator_task(self, self.name)  # operators and digit ranges
        if self.few_shot and self.name != "calculator_chat":
            raise ValueError(
                f"TaskSpec.few_shot is read by the calculator_chat task only, not {self.name!r}; "
                "remove it"
            )
        if self.reward:  # a reward that cannot be imported fails now, not after the SFT stage
            try:
                get_reward(self.reward)
            except (KeyError, TypeError) as e:
                raise ValueError(str(e).strip("\"'")) from None


def _pairs(few_shot) -> tuple[tuple[int, int], ...]:
    """`TaskSpec.few_shot` as a tuple of (a, b) int pairs (gin writes lists); anything else is
    refused with the form to write."""

    def is_pair(pair) -> bool:
        return (
            isinstance(pair, (tuple, list))
            and len(pair) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair)
        )

    if not isinstance(few_shot, (tuple, list)) or not all(is_pair(p) for p in few_shot):
        raise ValueError(
            f"TaskSpec.few_shot={few_shot!r}: write (a, b) pairs of non-negative integers, e.g. "
            "TaskSpec.few_shot = [(123, 45)]"
        )
    return tuple((int(a), int(b)) for a, b in few_shot)


def _expand_paths(spec) -> None:
    """Expands `~` in the path fields of a frozen spec (`PATH_FIELDS`)."""
    for field in spec.PATH_FIELDS:
        value = getattr(spec, field)
        if isinstance(value, str) and value.startswith("~"):
            object.__setattr__(spec, field, user_path(value))


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


def resolve_scan_layers(scan_layers: bool | None, num_layers: int, lora: bool = False) -> bool:
    """`PolicySpec.scan_layers`, with None resolved: scanned above `SCAN_LAYERS_ABOVE` layers,
    except for LoRA (an explicit True with LoRA is refused by `jaxrl.train.lora`, naming the
    fix)."""
    if scan_layers is not None:
        return bool(scan_layers)
    return num_layers > SCAN_LAYERS_ABOVE and not lora


def build_model_config(policy: PolicySpec, tokenizer, *, lora: bool = False) -> ModelConfig:
    """The policy's `ModelConfig`; `lora`: the run trains LoRA adapters (layers stay unrolled
    unless `policy.scan_layers` says otherwise). A tokenizer with a chat template adds its
    end-of-turn token to the stop ids (`jaxrl.tasks.chat.stop_token_ids`) when the checkpoint's
    config names another EOS only (e.g. `<|endoftext|>` but not `<|im_end|>`): a chat model's
    reply ends with its turn."""
    overrides = dict(
        param_dtype=policy.param_dtype, dtype=policy.dtype, remat_policy=policy.remat_policy
    )
    if policy.init_from:
        config_dir = policy.init_from
        if os.path.isdir(os.path.join(policy.init_from, "model")):
            config_dir = os.path.join(policy.init_from, "model")
        config = hf.load_config(config_dir, **overrides)
    else:
        m = policy.vocab_multiple
        vocab = -(-len(tokenizer) // m) * m
        config = PRESETS[policy.preset](vocab, tokenizer).replace(**overrides)
    return with_end_of_turn(config, tokenizer).replace(
        scan_layers=resolve_scan_layers(policy.scan_layers, config.num_layers, lora)
    )


def with_end_of_turn(config: ModelConfig, tokenizer) -> ModelConfig:
    """`config` with the tokenizer's chat-template end-of-turn token among its EOS ids (the
    ids every sampler stops at), when it is not there already."""
    eos_ids = stop_token_ids(config.eos_token_ids, tokenizer)
    return config if eos_ids == config.eos_token_ids else config.replace(eos_token_id=eos_ids)


def build_source(task: TaskSpec, tokenizer, max_prompt_tokens: int | None = None) -> PromptSource:
    """The task's prompt source, built by its registered factory (see `TaskSpec.name`).
    `max_prompt_tokens` (the model's context minus the tokens to generate) goes to factories
    that take it (math_jsonl: problems whose prompt is longer are left out, with a count)."""
    factory = get_task(task.name)
    kwargs = {}
    if max_prompt_tokens is not None and "max_prompt_tokens" in _parameters(factory):
        kwargs["max_prompt_tokens"] = max_prompt_tokens
    source = factory(task, tokenizer, **kwargs)
    if not isinstance(source, PromptSource):
        raise TypeError(
            f"task {task.name!r} built a {type(source).__name__}, which lacks the PromptSource "
            "methods item(index) -> PromptItem and eval_items(limit) -> list[PromptItem]"
        )
    return source


def _parameters(fn) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def reward_name(task: TaskSpec, source) -> str:
    """`TaskSpec.reward`, else the source's own `reward_name`."""
    name = task.reward or getattr(source, "reward_name", "")
    if not name:
        raise ValueError(
            f"task {task.name!r} names no reward: set TaskSpec.reward (a registered reward or "
            "'package.module:function'), or give the source a `reward_name` attribute"
        )
    return name
