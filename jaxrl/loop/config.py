"""The RL run's config, the I/O a loop needs, and the checks that its parts fit together.

`RLConfig` is bound in gin (by class name, `launch/configs.py`) and read by the launcher, the
controller and the feeds; `check_controller_inputs` raises, naming the field and the fix, when a
controller's executors, trainer, source or I/O do not fit the config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

from jaxrl.generation.sampling import SamplingConfig
from jaxrl.tasks.source import PromptSource
from jaxrl.train.state import TrainState

SCHEDULES = ("fixed_lag", "free_running", "streaming")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL run: batch shape, sampling, schedule of evals and saves.

    Each step trains on `num_prompts x samples_per_prompt` completions of at most
    `max_new_tokens` tokens, sampled at `temperature` (no top-k / top-p: the trainer's log pi
    must be the sampling distribution's). `eval_size=0` turns evaluation off.

    oversample: dynamic sampling (DAPO). Each batch samples `num_prompts * oversample` prompts
      and trains on `num_prompts` of them, those whose completions got different rewards first
      (`jaxrl.rl.select_groups`: a group with one reward for all its samples has zero advantage
      and adds no gradient). 1 trains on every sampled prompt. Under "streaming" a group with
      one reward is left out as it finishes (counted), as long as the groups left out stay
      within `oversample - 1` per group queued (`GroupQueue.filter`): the same sampling budget.

    Async mode (`mode="async"`, the generator on its own mesh):
      schedule: "fixed_lag" (reproducible: batch k sampled by version max(k - lag, 0)) or
        "free_running" (the newest weights, as fast as the queue allows).
      lag: fixed_lag's distance in policy versions; 0 = on-policy, no overlap.
      max_staleness: largest trainer-minus-generator version gap a trained sample may have;
        staler batches are dropped and counted. Fixed lag needs max_staleness >= lag.
      queue_size: scored batches the queue holds (fixed lag needs >= lag).
      stall_timeout_s: the trainer gives up (TimeoutError) after waiting this long for rollouts.
      "streaming" (`jaxrl.loop.feeds.streaming`): the engine never drains; each step trains on
        the next `num_prompts` groups to finish, new weights are swapped into the running
        engine between decode steps (a trajectory may span versions), `max_staleness` bounds
        the oldest token of a group (staler groups are dropped and counted), `queue_size`
        counts batches of `num_prompts` groups (no prompt is issued while that many are queued;
        a finished group never waits). Not reproducible bit for bit (timing decides versions).
      stream_in_flight (streaming): how far the generator may run ahead of the queue, in
        groups: a prompt is issued only while queued + in flight < `queue_size x num_prompts`
        + this. -1: the engine's groups (slots / samples_per_prompt), the engine refilled whole
        whenever the queue is empty. Smaller values keep fewer finished groups waiting (lower
        token staleness) at the cost of a partly filled engine while a step's groups finish.
      kv_on_update (streaming): on a swap, "keep" the running rows' KV or "recompute" it with
        the new weights.

    pack_length: > 0 trains on padding-free batches: each rollout's prompt and completion packed
      into rows of this many tokens (`jaxrl.rl.packing`; at least the longest prompt plus
      `max_new_tokens`); 0 trains on padded `[prompts x (prompt bucket + max_new_tokens)]`
      rectangles.
    share_prompts: packed batches lay each group out as `[prompt, completions]`, the prompt
      trained on once (`Trainer(share_prompts)`); None: on whenever `pack_length` > 0.
    """

    mode: str = "sync"
    total_steps: int = 1000
    num_prompts: int = 16
    samples_per_prompt: int = 8
    oversample: int = 1
    max_new_tokens: int = 6
    temperature: float = 1.0
    eval_every_steps: int = 250
    eval_size: int = 512
    eval_samples: int = 4
    save_every_steps: int = 250
    keep_last_n: int = 2
    log_every_steps: int = 50
    seed: int = 0
    shuffle_rewards: bool = False
    schedule: str = "fixed_lag"
    lag: int = 1
    max_staleness: int = 1
    queue_size: int = 2
    stall_timeout_s: float = 900.0
    pack_length: int = 0
    share_prompts: bool | None = None
    kv_on_update: str = "keep"
    stream_in_flight: int = -1

    def validate(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode={self.mode!r}; use 'sync' (colocated) or 'async'")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}; use one of {SCHEDULES}")
        if self.lag < 0 or self.max_staleness < 0:
            raise ValueError(f"lag={self.lag} and max_staleness={self.max_staleness} must be >= 0")
        if self.schedule == "fixed_lag" and self.max_staleness < self.lag:
            raise ValueError(
                f"max_staleness={self.max_staleness} < lag={self.lag}: under a fixed lag every "
                "batch is `lag` versions old, so all of them would be dropped"
            )
        if self.schedule == "fixed_lag" and self.queue_size < self.lag:
            raise ValueError(
                f"queue_size={self.queue_size} < lag={self.lag}: the queue must hold the `lag` "
                "batches sampled ahead of the trainer"
            )
        if self.kv_on_update not in ("keep", "recompute"):
            raise ValueError(f"kv_on_update={self.kv_on_update!r}; use 'keep' or 'recompute'")
        if self.schedule == "streaming" and self.mode != "async":
            raise ValueError(
                f"schedule='streaming' with mode={self.mode!r}: streaming is an async schedule "
                "(mode='async')"
            )
        if self.stream_in_flight < -1:
            raise ValueError(
                f"RLConfig.stream_in_flight={self.stream_in_flight}; use -1 (the engine's "
                "groups) or a count of groups >= 0"
            )
        if self.queue_size < 1 or not self.stall_timeout_s > 0:
            raise ValueError("queue_size must be >= 1 and stall_timeout_s > 0")
        for name in (
            "total_steps",
            "num_prompts",
            "samples_per_prompt",
            "oversample",
            "max_new_tokens",
            "eval_every_steps",
            "save_every_steps",
            "keep_last_n",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name}={getattr(self, name)} must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"RLConfig.temperature={self.temperature} must be > 0")
        if self.pack_length < 0:
            raise ValueError(
                f"RLConfig.pack_length={self.pack_length}: use 0 (padded) or a row length"
            )

    @property
    def batch_size(self) -> int:
        return self.num_prompts * self.samples_per_prompt


@runtime_checkable
class ControllerIO(Protocol):
    """What the controller needs of a run's I/O. `jaxrl.infra.run_io.RunIO` (checkpoints,
    metrics.jsonl, TensorBoard, progress) is the launchers'; a script may pass anything with these
    methods (e.g. one that keeps metrics in memory and never saves). Optional: `histogram(step,
    name, values)`, a metric's distribution (`RunIO` writes it to TensorBoard), which
    `jaxrl.loop.report.StepReport` calls when the io has it."""

    def start(self, step: int) -> None:
        """The loop starts (or resumes) at `step`."""

    def log(self, step: int, metrics: dict[str, float], headline: dict[str, str]) -> Any:
        """Metrics of `step` (step 0: the evaluation before training); `headline`: a few
        formatted values for a progress line. May raise to stop the run (e.g. a NaN loss)."""

    def save_due(self, step: int, force: bool = False) -> bool:
        """Whether `save` would write `step` (`force`: the final step)."""

    def save(self, state: TrainState, extra: dict, *, force: bool = False) -> None:
        """Checkpoints `state` and `extra` (JSON-able run state) when due."""

    def after_step(self, step: int) -> None:
        """Called after every step's log and save (fault hooks, preemption)."""


def sampling_config(config: RLConfig) -> SamplingConfig:
    """The generator's sampling settings for `config` (no top-k / top-p: see RLConfig)."""
    return SamplingConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature)


def check_controller_inputs(config: RLConfig, trainer, generator, source, io) -> None:
    """Raises ValueError / TypeError, naming the field and the fix, when the controller's parts
    do not fit together (each would otherwise fail steps later, or silently train wrongly)."""
    if not isinstance(config, RLConfig):
        raise TypeError(f"config must be an RLConfig, got {type(config).__name__}")
    try:
        config.validate()
    except ValueError as e:
        raise ValueError(f"invalid RLConfig: {e}") from None
    if generator.samples_per_prompt != config.samples_per_prompt:
        raise ValueError(
            f"the generator samples {generator.samples_per_prompt} completions per prompt but "
            f"RLConfig.samples_per_prompt={config.samples_per_prompt}; build the "
            "GeneratorExecutor with config.samples_per_prompt"
        )
    wanted = sampling_config(config)
    got = generator.sampling
    if (got.max_new_tokens, got.temperature) != (wanted.max_new_tokens, wanted.temperature):
        raise ValueError(
            f"the generator samples with max_new_tokens={got.max_new_tokens}, temperature="
            f"{got.temperature}, but RLConfig says {wanted.max_new_tokens}, "
            f"{wanted.temperature}; build the GeneratorExecutor with sampling_config(config)"
        )
    check_temperature(config, getattr(getattr(trainer, "loss", None), "temperature", None))
    if not isinstance(source, PromptSource):
        raise TypeError(
            f"source {type(source).__name__} is not a PromptSource: it needs item(index) -> "
            "PromptItem and eval_items(limit) -> list[PromptItem]"
        )
    if not isinstance(io, ControllerIO):
        missing = [
            m for m in ("start", "log", "save_due", "save", "after_step") if not hasattr(io, m)
        ]
        raise TypeError(f"io {type(io).__name__} is not a ControllerIO: it lacks {missing}")


def check_temperature(config: RLConfig, loss_temperature: float | None) -> None:
    """The trainer must score tokens under the sampling distribution (None: nothing to check)."""
    if loss_temperature is not None and loss_temperature != config.temperature:
        raise ValueError(
            f"LossConfig.temperature={loss_temperature} differs from RLConfig.temperature="
            f"{config.temperature}: the trainer must score tokens under the sampling distribution"
        )


def check_role_split(config: RLConfig, lora: bool = False) -> None:
    """A role-split job (`jaxrl.loop.roles`) runs fixed lag only: both roles must know every
    version pushed across processes in advance (and LoRA runs are single-process)."""
    if config.mode != "async" or config.schedule != "fixed_lag" or lora:
        raise ValueError(
            "rl_main.roles across processes needs RLConfig.mode = 'async', RLConfig.schedule = "
            f"'fixed_lag' (got {config.mode!r}, {config.schedule!r}: both roles must know every "
            "pushed version in advance) and no rl_main.lora"
        )


def check_rl_job(
    config: RLConfig,
    *,
    loss_temperature: float,
    generator_mesh: bool,
    roles: tuple[str, ...] | None,
    lora: bool,
    processes: int,
) -> None:
    """The checks across a launch's configs, before any work (the launcher turns the ValueError
    into its exit message): the loss scores under the sampling temperature; async mode, and only
    it, has the generator's own devices; a job of several processes runs fixed lag (role split:
    and no LoRA); LoRA runs are single-process."""
    check_temperature(config, loss_temperature)
    if (config.mode == "async") != generator_mesh:
        raise ValueError(
            f"RLConfig.mode={config.mode!r} with rl_main.generator_mesh="
            f"{'set' if generator_mesh else 'None'}: async mode needs the generator's own "
            "devices (bind rl_main.generator_mesh = @generator/MeshConfig()); sync mode is "
            "colocated (no generator_mesh; for on-policy on disjoint meshes use async with "
            "RLConfig.lag = 0)"
        )
    if processes > 1 and config.mode == "async" and config.schedule != "fixed_lag":
        raise ValueError(
            f"RLConfig.schedule={config.schedule!r} in a job of {processes} processes: "
            "every process runs the same controller, and free-running choices (which version "
            "samples a batch, which batches are dropped) follow each process's own timing; "
            "use RLConfig.schedule = 'fixed_lag'"
        )
    if roles is not None:
        if not generator_mesh:
            raise ValueError("rl_main.roles needs async mode and rl_main.generator_mesh")
        if not set(roles) <= {"trainer", "generator"}:
            raise ValueError(f"rl_main.roles={tuple(roles)}: each role is 'trainer' or 'generator'")
        if processes > 1:
            check_role_split(config, lora)
    if lora and processes > 1:
        raise ValueError("LoRA runs are single-process for now; drop rl_main.lora")
