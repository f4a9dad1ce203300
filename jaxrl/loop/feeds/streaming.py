"""Streaming async RL: the engine never drains, weights are swapped in between decode steps.

The fixed-lag and free-running schedules (`lagged`) sample whole batches: the trainer
waits for a batch's longest completion, and a weight push waits for the batch in flight. Here
(`RLConfig.schedule = "streaming"`, after AReaL / PipelineRL / verl fully-async):

* **The generator keeps the engine full.** Its thread submits prompt `i` of the task's stream as
  engine request `i` (G samples, one prefill) and scores each group the moment its last sample
  stops. Back-pressure is on admission, never on decoding: a prompt is issued only while fewer
  than `queue capacity` groups are queued and fewer than `capacity + RLConfig.stream_in_flight`
  (default the engine's groups, `slots / G`) are queued or in flight; a finished group always
  goes into the queue. A smaller margin keeps fewer finished groups waiting for the trainer,
  so fewer versions go by between sampling and training. An engine that waited on a full queue
  would hold its running rows still while versions go by, so long completions, which run
  through more such waits, would grow staler and be dropped more: a bias against them.
* **Groups, not batches.** A scored group goes into the `GroupQueue`; each trainer step takes
  the next `num_prompts` groups, in the order they finished.
* **In-flight weight updates.** After each optimizer step the trainer pushes its weights into
  the generator's double buffer (`GeneratorWeights`, latest only: device to device, never
  waiting); the engine asks for newer weights before every device call (every
  `steps_per_call` decode steps) and swaps them in without draining. Each token records the
  version that sampled it (`Rollout.token_versions`); AIPO's per-token ratio uses the
  per-token behaviour log-probs, so a trajectory spanning versions needs no special maths. A
  mixture-of-experts engine's routing records (`GroupResult.routing_g`) go with the rollouts
  (`Rollout.routing`), through the queue and the checkpoint, for the trainer to replay. On a
  swap the running rows' KV is kept, or recomputed with the new weights
  (`RLConfig.kv_on_update`; see `jaxrl.generation.engine`).
* **Dynamic sampling** (`RLConfig.oversample > 1`): a group whose samples all got one reward
  (no advantage, no gradient) is left out as it finishes and counted
  (`data/filtered_groups`), within the budget of `oversample - 1` groups per group queued.
* **Staleness per token; the bound on the oldest.** A token's staleness is the trainer's
  version minus the version that sampled it (sampled tokens only: a multi-turn episode's
  observation tokens, version -1, are in no staleness figure). A group whose oldest token is
  more than `max_staleness` versions old is dropped and counted (on admission to the queue, or
  on consumption), never truncated: a truncated completion would be scored as if it had ended
  there.

Multi-turn episodes (`jaxrl.loop.feeds.episodes.EpisodeGroups` in place of `PromptGroups`):
prompt `i` runs as G episodes whose later turns join the running engine as their tool replies
arrive; an episode may span weight versions (each sampled token records its own), and its group
is queued when its last episode ends. The checkpoint and its ledger are the same: an episode
group in flight at a save is dropped and its prompt re-run from the start on resume (fresh
environments), so no episode is trained twice.

Checkpoint (an exact continuation of the state, not of the timing): besides the train state, the
scored groups still queued (in full: sampled by versions the saved weights cannot reproduce),
the prompt indices in flight (submitted, not yet queued: their partial tokens are dropped and
the prompts re-issued first on resume, sampled afresh with the restored weights), the next
prompt index, the cumulative counts, and which prompts were dropped and which filtered
(`dropped_prompts`, `filtered_prompts`: bitmaps, `ledger_indices`). So the checkpoint names
each issued prompt's fate: trained (the rest of [0, next_prompt)), queued, in flight, dropped
or filtered, exactly one of them, and no group is trained twice. A streaming run is not
reproducible bit for bit: which version samples which token follows the timing. Fixed lag stays
the reproducible mode.

Metrics per step: `stream/tokens_at_staleness/<k>` (the trained batch's completion tokens by
staleness; a TensorBoard histogram too), `stream/token_staleness_mean|max`,
`stream/mixed_version_rows` (fraction of rows sampled by more than one version),
`stream/engine_utilisation` (kept tokens / decode slot-steps since the last step),
`time/trainer_idle_s`, `time/generator_idle_s` (the engine drained, waiting for room to issue
a prompt; a partly filled engine shows in the utilisation instead), `stream/push_to_use_s`
(from a push to the engine's first decode step with it),
`stream/swaps`, and the ids of the trained prompts (`stream/trained_prompt/<j>`, for audits).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import numpy as np

from jaxrl.generation.engine import Request
from jaxrl.generation.engine_sampler import EngineSampler
from jaxrl.generation.executor import GeneratedBatch, sampling_key
from jaxrl.generation.mismatch import score_batch
from jaxrl.infra.closable import QueueClosed, unwrap
from jaxrl.loop.config import RLConfig
from jaxrl.loop.feeds.base import ControllerView, GeneratorThread, Taken, check_resumable, publish
from jaxrl.loop.report import BusyTimeline, queue_metrics
from jaxrl.loop.rollout_queue import GroupQueue, ScoredBatch
from jaxrl.tasks.source import encode_prompts


@dataclasses.dataclass
class _GeneratorCounters:
    """What the generator thread did since the trainer last read it (`take_counters`)."""

    swaps: int = 0
    push_to_use_s: list[float] = dataclasses.field(default_factory=list)
    slot_steps: int = 0
    kept_tokens: int = 0
    recompute_tokens: int = 0


def streaming_engine(ctl: ControllerView):
    """The generator's `Engine`, checked for a streaming run."""
    sampler = ctl.generator.sampler
    if type(sampler) is not EngineSampler:
        raise ValueError(
            f"schedule='streaming' needs the engine as the generator (GeneratorConfig.kind = "
            f"'engine', a single-process generator mesh, no LoRA); got {type(sampler).__name__}"
        )
    g = ctl.config.samples_per_prompt
    if sampler.engine.num_slots < g:
        raise ValueError(f"{sampler.engine.num_slots} engine slots < samples_per_prompt={g}")
    return sampler.engine


def groups_in_flight(ctl: ControllerView) -> int:
    """`GroupQueue.max_in_flight` of a streaming run: `RLConfig.stream_in_flight`, or (-1) the
    groups the engine's slots hold, so an empty queue gets every slot refilled at once."""
    engine_groups = streaming_engine(ctl).num_slots // ctl.config.samples_per_prompt
    lead = ctl.config.stream_in_flight
    return engine_groups if lead < 0 else lead


class PromptGroups:
    """What the streaming generator runs for each prompt index (the default): one engine
    request of G samples, each group scored by the reward executor as its last sample stops.
    The interface a `StreamProducer` drives (multi-turn episodes plug in
    `jaxrl.loop.feeds.episodes.EpisodeGroups`):

        submit(index)                         queue prompt `index` on the engine
        run(params, key, version=, update=, kv_on_update=)
                                              run the engine until it drains, yielding each
                                              prompt's `ScoredBatch` (batch_index = the prompt
                                              index) as it finishes; `submit` may be called
                                              between yields
    """

    def __init__(self, controller: ControllerView, engine):
        self.controller, self.engine = controller, engine
        self.current = (None, None)  # (version, params) the engine holds now (`run`)

    def submit(self, index: int) -> None:
        ctl = self.controller
        ids = encode_prompts(ctl.tokenizer, [ctl.source.item(index)], ctl.chat_formatted)[0]
        self.engine.submit(
            Request(index, tuple(ids), ctl.config.samples_per_prompt, ctl.generator.sampling)
        )

    def run(self, params, key, **engine_run) -> Iterator[ScoredBatch]:
        # The version the engine holds now and its weights: an 8-bit engine's mismatch is
        # measured on the groups it sampled with these alone (`_mismatch`).
        self.current = (engine_run.get("version"), params)
        update = engine_run.get("update")

        def tracked(version):
            newer = update(version)
            if newer is not None:
                self.current = newer
            return newer

        if update is not None:
            engine_run["update"] = tracked
        for group in self.engine.run(params, key, **engine_run):
            yield self._score(group)

    def _mismatch(self, generated: GeneratedBatch, versions) -> dict:
        """`gen/mismatch_*` over the samples of the group drawn by the engine's current
        version alone (the weights of older versions are gone); {} without a scorer."""
        scorer = self.controller.generator.scorer
        version, params = self.current
        rows = [i for i, v in enumerate(versions) if len(v) and (v == version).all()]
        if scorer is None or not rows:
            return {}
        sub = dataclasses.replace(
            generated,
            prompt_ids=[generated.prompt_ids[i] for i in rows],
            completion_ids=[generated.completion_ids[i] for i in rows],
            behaviour_logprobs=[generated.behaviour_logprobs[i] for i in rows],
        )
        return score_batch(scorer, params, sub, uncorrected=False)[1]

    def _score(self, group) -> ScoredBatch:
        ctl = self.controller
        item = ctl.source.item(group.request_id)
        g = len(group.tokens_gn)
        lengths = group.lengths_g
        versions = [group.versions_gn[i, : lengths[i]] for i in range(g)]
        oldest = int(min(v.min() for v in versions))
        generated = GeneratedBatch(
            items=[item] * g,
            prompt_ids=[list(group.prompt)] * g,
            completion_ids=[group.tokens_gn[i, : lengths[i]] for i in range(g)],
            behaviour_logprobs=[group.logprobs_gn[i, : lengths[i]] for i in range(g)],
            group_ids=np.full(g, group.request_id),
            policy_version=oldest,
            batch_index=group.request_id,
            seconds=0.0,
        )
        generated = dataclasses.replace(generated, metrics=self._mismatch(generated, versions))
        rollouts, metrics = ctl.rewarder.score(generated)  # one group: filtered in `produce`
        # A mixture-of-experts engine's routing records, one per sample (None: dense).
        routing_g = [None] * g if group.routing_g is None else group.routing_g
        rollouts = [
            dataclasses.replace(r, token_versions=v.astype(np.int32), routing=routing)
            for r, v, routing in zip(rollouts, versions, routing_g, strict=True)
        ]
        return ScoredBatch(group.request_id, oldest, rollouts, metrics)


class StreamProducer(GeneratorThread):
    """The generator thread (`GeneratorThread`'s life cycle): keeps the engine full, swaps
    weights in between device calls, scores each group as it finishes and queues it. `groups`:
    what runs per prompt (default `PromptGroups`)."""

    thread_name = "jaxrl-streamer"

    def __init__(
        self,
        controller: ControllerView,
        queue: GroupQueue,
        timeline: BusyTimeline | None = None,
        groups=None,
    ):
        super().__init__(controller, queue, timeline)
        self.engine = streaming_engine(controller)
        self.groups = groups or PromptGroups(controller, self.engine)
        self._counters = _GeneratorCounters()
        self._lock = threading.Lock()

    def take_counters(self) -> _GeneratorCounters:
        with self._lock:
            counters, self._counters = self._counters, _GeneratorCounters()
        return counters

    def _update(self, version: int):
        """The engine's hook before each device call: newer weights, if any were pushed."""
        if self.queue.closed:
            raise QueueClosed()
        newer = self.controller.weights.newest(version)
        if newer is None:
            return None
        pushed = self.controller.weights.published_at.get(newer.version)
        with self._lock:
            self._counters.swaps += 1
            if pushed is not None:
                self._counters.push_to_use_s.append(time.perf_counter() - pushed)
        self.version = newer.version
        return newer.version, newer.params

    def _submit(self, outstanding: set[int], block: bool = False) -> None:
        """Submits prompts while the queue gives room; with `block`, waits for the first."""
        while True:
            index = self.queue.issue(block=block and not outstanding)
            if index is None:
                return
            self.groups.submit(index)
            outstanding.add(index)

    def produce(self) -> None:
        ctl, engine = self.controller, self.engine
        outstanding: set[int] = set()
        stats = engine.stats
        last = (stats.slot_steps, stats.kept_tokens, stats.recompute_tokens)
        # Noise keyed by (seed, prompt index, sample, token): the request id is the index.
        key = sampling_key(ctl.config.seed, 0, 0)
        while True:
            # The engine has drained (or not started): idle until a prompt may be issued.
            self._submit(outstanding, block=True)
            self.timeline.begin(time.perf_counter())
            current = ctl.weights.acquire(None)  # the newest version; frees older ones
            self.version = current.version
            ctl.generator.sampler.warm_up(  # once (GeneratorConfig.precompile)
                current.params,
                ctl.generator.sampling,
                ctl.config.samples_per_prompt,
                recompute=ctl.config.kv_on_update == "recompute",
            )
            for scored in self.groups.run(
                current.params,
                key,
                version=current.version,
                update=self._update,
                kv_on_update=ctl.config.kv_on_update,
            ):
                outstanding.discard(scored.batch_index)
                now = (stats.slot_steps, stats.kept_tokens, stats.recompute_tokens)
                with self._lock:
                    self._counters.slot_steps += now[0] - last[0]
                    self._counters.kept_tokens += now[1] - last[1]
                    self._counters.recompute_tokens += now[2] - last[2]
                last = now
                if not self.queue.filter(scored, ctl.config.oversample):
                    self.queue.put(scored)
                self._submit(outstanding)  # as much as the queue gives room for
            self.timeline.end(time.perf_counter())

    def where(self) -> str:
        return f"the streaming generator thread (policy version {self.version})"

    def finish(self) -> None:
        self.engine.reset()


def sampled_versions(rollout) -> np.ndarray:
    """The versions of the tokens the policy sampled (trained): a multi-turn episode's
    observation tokens (version -1, `loss_mask` False) are left out."""
    versions = np.asarray(rollout.token_versions)
    if rollout.loss_mask is None:
        return versions
    return versions[np.asarray(rollout.loss_mask, bool)]


def token_staleness_metrics(rollouts, trainer_version: int) -> tuple[dict[str, float], np.ndarray]:
    """Per-token staleness of a train batch, over sampled tokens only (`sampled_versions`):
    counts by staleness, mean, max, and the fraction of rows that more than one version
    sampled. Returns (metrics, staleness of every sampled token)."""
    versions = [sampled_versions(r) for r in rollouts]
    staleness = np.concatenate([trainer_version - v for v in versions])
    metrics = {
        "stream/token_staleness_mean": float(staleness.mean()),
        "stream/token_staleness_max": float(staleness.max()),
        "stream/mixed_version_rows": float(np.mean([len(np.unique(v)) > 1 for v in versions])),
    }
    for k, n in zip(*np.unique(staleness, return_counts=True), strict=True):
        metrics[f"stream/tokens_at_staleness/{int(k)}"] = float(n)
    return metrics, staleness


class StreamingFeed:
    """Streaming (module docstring): each step's `num_prompts` groups from a `GroupQueue` that a
    `StreamProducer` thread keeps filled; weights swapped into the running engine."""

    latest_only = staticmethod(lambda config: True)  # the engine takes the newest version only

    @staticmethod
    def engine_slots(config: RLConfig) -> int:
        """One step's groups in flight, however many dynamic sampling leaves out."""
        return config.samples_per_prompt * config.num_prompts

    def __init__(self, controller: ControllerView, groups=None):
        """`groups`: what the generator runs per prompt (None: `PromptGroups`, one request of
        G samples; multi-turn episodes: `jaxrl.loop.feeds.episodes.EpisodeGroups`)."""
        self.controller, self.config, self.groups = controller, controller.config, groups
        self.in_flight = groups_in_flight(controller)  # checks the engine first
        self.timeline: BusyTimeline | None = BusyTimeline()
        self.queue: GroupQueue | None = None
        self.source: StreamProducer | None = None

    def start(self, step: int, params, extra: dict | None) -> None:
        c = self.config
        capacity = c.queue_size * c.num_prompts
        if step == 0:
            self.queue = GroupQueue(capacity, c.max_staleness, max_in_flight=self.in_flight)
        else:
            check_resumable(step, extra, {"mode": "async", "schedule": "streaming"})
            self.queue = GroupQueue.restore(capacity, c.max_staleness, step, extra, self.in_flight)
        self.push(step, params)
        self.source = StreamProducer(self.controller, self.queue, self.timeline, self.groups)
        self.source.start()

    def take(self, step: int, params) -> Taken:
        groups = unwrap(self.queue.take, self.config.num_prompts, self.config.stall_timeout_s)
        rollouts = [r for g in groups for r in g.rollouts]
        staleness_metrics, staleness = token_staleness_metrics(rollouts, step)
        metrics = _group_metrics(groups) | staleness_metrics
        for j, g in enumerate(groups):
            metrics[f"stream/trained_prompt/{j}"] = float(g.batch_index)
        headline = {"stale": f"{metrics['stream/token_staleness_mean']:.2f}"}
        return Taken(rollouts, metrics, headline, histogram=("stream/token_staleness", staleness))

    def push(self, version: int, params) -> dict[str, float]:
        c = self.config
        weights, needed = self.controller.weights, version < c.total_steps
        return publish(weights, params, version, c.stall_timeout_s, needed)

    def trained(self, step: int, params) -> dict[str, float]:
        self.queue.advance(step)
        metrics = self.push(step, params)
        counters = self.source.take_counters()
        stats = self.queue.stats
        used = stats.consumed_batches + stats.filtered_batches + stats.dropped_batches
        metrics |= {
            "data/prompts_sampled": float(used),
            "async/generator_version": float(self.source.version or 0),
            "async/queue_depth": float(self.queue.depth),
            "stream/swaps": float(counters.swaps),
            "stream/engine_utilisation": counters.kept_tokens / max(counters.slot_steps, 1),
            "stream/recompute_tokens": float(counters.recompute_tokens),
            "stream/dropped_groups": float(stats.dropped_batches),
        } | queue_metrics(stats)
        if counters.push_to_use_s:
            metrics["stream/push_to_use_s"] = float(np.mean(counters.push_to_use_s))
        return metrics

    def snapshot(self, step: int) -> dict:
        """The queue's ledger and groups (module docstring) and the run's schedule."""
        c = self.config
        return self.queue.snapshot() | {
            "mode": "async",
            "schedule": "streaming",
            "lag": c.lag,
            "generator_version": self.source.version,
            "kv_on_update": c.kv_on_update,
        }

    def stop(self, failed: bool) -> None:
        if self.source is not None:
            self.source.stop(timeout_s=10.0 if failed else self.config.stall_timeout_s)


def _group_metrics(groups: list[ScoredBatch]) -> dict[str, float]:
    """Reward and length figures of the trained groups (each group scored on its own)."""
    rewards = [r.reward for g in groups for r in g.rollouts]
    lengths = [len(r.completion_ids) for g in groups for r in g.rollouts]
    spread = [len({r.reward for r in g.rollouts}) > 1 for g in groups]
    # Multi-turn episodes' figures and an 8-bit engine's mismatch: means over the groups with
    # them (the largest log-ratio: the largest).
    means = {k for g in groups for k in g.metrics if k.startswith(("episode/", "gen/mismatch"))}
    means.discard("gen/mismatch_abs_log_ratio_max")
    worst = [g.metrics["gen/mismatch_abs_log_ratio_max"] for g in groups
             if "gen/mismatch_abs_log_ratio_max" in g.metrics]  # fmt: skip
    return (
        {k: float(np.mean([g.metrics[k] for g in groups if k in g.metrics])) for k in means}
        | ({"gen/mismatch_abs_log_ratio_max": float(max(worst))} if worst else {})
        | {
            "reward/mean": float(np.mean(rewards)),
            "data/informative_trained": float(np.mean(spread)),
            "completion/mean_tokens": float(np.mean(lengths)),
            "completion/max_tokens": float(np.max(lengths)),
            "time/reward_s": float(sum(g.metrics.get("time/reward_s", 0.0) for g in groups)),
            **(
                {
                    "time/mismatch_s": float(
                        sum(g.metrics.get("time/mismatch_s", 0.0) for g in groups)
                    )
                }
                if worst
                else {}
            ),
        }
    )
