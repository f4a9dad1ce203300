"""Multi-turn tool-use episodes against single-turn generation: sampled tokens/s on the same
model, engine and sampling (issue 40, acceptance 4: multi-turn >= 0.8x single-turn).

Workload, per model (`--hf_dir`: SmolLM2-135M-Instruct's own ChatML tool calls instead,
`chat_workload`): the calculator task (`jaxrl.env.calculator`, character tokenizer) with a
policy SFT'd here for a few hundred steps on demonstrations that all use the tool, so its
episodes really call it: `<bos>37*48=` -> `(37*48)` | `=1776` | `1776<eos>` (two turns), or, with
`--chained`, `a*b+c*d=` -> three calls and the answer (four turns). P prompts x G = 8 samples.

* **multi-turn**: `EpisodeRunner` episodes (sampling at temperature 1, turns stopped at `)` or
  EOS, calculator steps on a thread pool, the budgets of configs/rl/calc_tiny.gin).
  `continue="slot"` (the default path) continues each episode in its own engine slot: its KV
  cache is kept while the tool runs and only the observation is written, then decoding goes on;
  `continue="request"` is the old path: each later turn a new request whose prompt, the whole
  history, is prefilled again.
* **single-turn**: the same P prompts as P requests of G samples on the same engine, no stop
  ids (EOS ignored), paired with a multi-turn run of the same seed: "the episodes' lengths"
  samples each episode's own sampled token count (`Request.sample_budgets`), "lockstep" their
  mean for all, so both sides sample the same tokens.

`--turn_tokens L` replaces the calculator by a scripted workload whose turns average L tokens
(`scripted_workload`): the cost of a turn boundary against the turns' length.

Reported: sampled tokens (loss-masked; observations excluded) per second of `run` wall time,
median of `--repeats` timed runs after a warm-up run (compiles), and the ratio multi / single
of each repeat's pair (their median; "ratios per repeat" lists them); and from one more,
instrumented, pair: device seconds in prefill / extend / decode calls
(each call timed to completion), the number of calls, and the seconds the driver waited with
nothing to decode for tools. A multi-turn run's shapes depend on when tool replies land, so a
timed run can meet a program its warm-up did not compile: such a run is run again (up to
`WARM_TRIES` times; counted in "timed runs that compiled"), so what is timed is the steady
state of an RL run whose programs exist. `--extend_min_rows` / `--extend_widths` set the
engine's extension buckets (rows and widths of continued rows' tool replies; the "extended
positions, padded" column against the "tool-reply tokens extended"); `--keep_calls` how long a
row waiting for its tool reply keeps its slot, `--exit_stops` when a decode call ends early
(`Engine.exit_stops`; the "decode calls ended early" column). Both sides run on the same engine,
so each setting applies to single-turn too.

    python -m bench.multiturn            # arith_tiny and rlbench_tiny, both paths
    python -m bench.multiturn --turn_tokens 64 --models rlbench_tiny   # turns of ~64 tokens
    python -m bench.multiturn --smoke    # seconds: bench/results/multiturn_smoke.*
    python -m bench.multiturn --hf_dir ~/.cache/jaxrl/smollm2-135m-instruct --prompts 8 \
        --paths slot --name multiturn_smollm2_p8   # docs/multiturn_chat.md
    python -m bench.multiturn --extension_cost   # a decode call with 0-32 continued rows

From the instrumented run also: host seconds (its wall time less the device calls and the
driver's waits for tools), how many decode calls continued rows waited for their
continuation in all (`EngineStats.kept_wait_calls`; 0 when every tool reply joined the next
call), and the attended positions (`EngineStats.attended_positions`: on the CPU a decode step
reads the cache prefix of its call's longest row in every row).
`--extension_cost` times one decode call of each model at its random init (32 active
slots, span 32, `--steps_per_call` steps) plain and with 8, 16 and 32 continued rows of 8 new
tokens each: what a turn boundary adds to the call its continuation joins.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, serialization

from bench.common import command, machine, write_results
from jaxrl.env.base import Step
from jaxrl.env.calculator import CalculatorSource, CalculatorTask
from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.episodes import EpisodeBudget, EpisodeGroup, EpisodeRunner
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.job.specs import PRESETS
from jaxrl.models.transformer import Transformer
from jaxrl.tasks.source import PromptItem
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer
from jaxrl.train.steps import sft_loss

G = 8
WARM_TRIES = 3  # warm-up runs of a multi-turn seed at most, until one compiles nothing


def sft_policy(preset, source, tokenizer, steps: int, seq_len: int, cache_dir: str | None):
    """`preset` trained for `steps` Adam steps (batch 64) on the source's demonstrations (read
    from / written to `cache_dir` when given)."""
    vocab = -(-len(tokenizer) // 8) * 8
    config = PRESETS[preset](vocab, tokenizer)
    model = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    chained = "chained" if source.task.chained else "plain"
    path = cache_dir and os.path.join(cache_dir, f"multiturn_{preset}_{chained}_{steps}.msgpack")
    if path and os.path.exists(path):
        with open(path, "rb") as f:
            nnx.replace_by_pure_dict(params, serialization.msgpack_restore(f.read()))
        return nnx.merge(graphdef, params), float("nan")
    optimizer = optax.adam(optax.linear_schedule(2e-3, 0.0, max(steps, 1)))
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, tokens, mask):
        batch = {"tokens_bs": tokens, "loss_mask_bs": mask}
        (loss, _), grads = jax.value_and_grad(
            lambda p: sft_loss(graphdef, p, batch, None), has_aux=True
        )(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    loss = jnp.nan
    for i in range(steps):
        tokens, mask = source.demonstrations(i * 64, 64, tokenizer, seq_len, pool=4096)
        params, opt_state, loss = step(params, opt_state, tokens, mask)
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        with open(path, "wb") as f:
            f.write(serialization.msgpack_serialize(jax.device_get(nnx.to_pure_dict(params))))
    return nnx.merge(graphdef, params), float(loss)


class Timed:
    """Wraps an engine's `programs.run`: each call blocks until its outputs are ready and adds
    its seconds to `seconds[name]` (the instrumented run only)."""

    def __init__(self, engine: Engine):
        self.engine, self.inner = engine, engine.programs.run
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def __enter__(self):
        def run(name, *args, **static):
            start = time.perf_counter()
            out = jax.block_until_ready(self.inner(name, *args, **static))
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.calls[name] = self.calls.get(name, 0) + 1
            return out

        self.engine.programs.run = run
        return self

    def __exit__(self, *exc):
        self.engine.programs.run = self.inner


def _stats_delta(engine: Engine, before) -> dict:
    after = dataclasses.asdict(engine.stats)
    return {k: after[k] - before[k] for k in after}


class ScriptedToolEnv:
    """The `--turn_tokens` workload's environment: it ignores what the model wrote, answers
    every turn but the last with `observation` (a fixed tool reply) and ends the episode after
    `turns` turns."""

    def __init__(self, prompt: Sequence[int], observation: Sequence[int], turns: int):
        self.prompt, self.observation, self.turns, self.turn = prompt, observation, turns, 0

    def reset(self, item) -> Sequence[int]:
        return self.prompt

    def step(self, turn_ids: Sequence[int]) -> Step:
        self.turn += 1
        if self.turn >= self.turns:
            return Step(done=True)
        return Step(observation=self.observation)


@dataclasses.dataclass
class Workload:
    """A policy and its episodes: `prompts[e]` are episode group e's prompt ids; `make_env(e)`
    one of its G environments."""

    task: str
    model: Transformer
    sft_loss: float
    sft_s: float
    budget: EpisodeBudget
    stop_ids: tuple[int, ...]
    items: list
    prompts: list[tuple[int, ...]]
    make_env: Callable[[int], object]
    temperature: float = 1.0
    prompt_buckets: tuple[int, ...] = (16, 32)


def calculator_workload(preset, args) -> Workload:
    """The calculator task with a policy SFT'd to call the tool (module docstring)."""
    tokenizer = build_arithmetic_tokenizer()
    task = CalculatorTask(chained=args.chained, tool_share=1.0)
    source = CalculatorSource(task, tokenizer)
    seq_len = 64 if args.chained else 32
    start = time.perf_counter()
    model, loss = sft_policy(preset, source, tokenizer, args.sft_steps, seq_len, args.sft_cache)
    sft_s = time.perf_counter() - start
    if args.chained:
        budget = EpisodeBudget(max_turns=5, max_turn_tokens=12, max_total_tokens=64,
                               max_observation_tokens=24, tool_timeout_s=10.0)  # fmt: skip
    else:  # configs/rl/calc_tiny.gin
        budget = EpisodeBudget(max_turns=3, max_turn_tokens=10, max_total_tokens=40,
                               max_observation_tokens=12, tool_timeout_s=10.0)  # fmt: skip
    items = [source.item(i) for i in range(args.prompts)]
    prompts = [tuple(tokenizer.encode(item.text)) for item in items]
    task_name = "a*b+c*d" if args.chained else "a*b"
    stop_ids = tuple(source.stop_ids)
    return Workload(
        task_name, model, loss, sft_s, budget, stop_ids, items, prompts, lambda e: source.make_env()
    )


def chat_workload(preset, args) -> Workload:
    """`--hf_dir DIR`: the chat calculator on a pretrained instruct model (SmolLM2-135M-Instruct)
    as configs/rl/calc_smollm2_learn.gin sets it (3-digit x 2-digit products, one worked
    exchange before the question, its episode budgets, temperature 0.7): the model's own
    ChatML tool calls, ~32 tokens each, answered by the calculator. No SFT."""
    from jaxrl.env.chat_calculator import ChatCalculatorSource
    from jaxrl.generation.engine import DEFAULT_PROMPT_BUCKETS
    from jaxrl.models import hf

    model, tokenizer = hf.load_model(args.hf_dir), hf.load_tokenizer(args.hf_dir)
    task = CalculatorTask(min_digits=3, max_digits=3, min_digits_b=2, max_digits_b=2)
    source = ChatCalculatorSource(task, tokenizer, examples=[(123, 45)])
    budget = EpisodeBudget(max_turns=3, max_turn_tokens=48, max_total_tokens=416,
                           max_observation_tokens=64, tool_timeout_s=10.0)  # fmt: skip
    items = [source.item(i) for i in range(args.prompts)]
    prompts = [tuple(tokenizer.encode(i.text, add_special_tokens=False)) for i in items]
    return Workload("chat a*b (3x2 digits)", model, float("nan"), 0.0, budget,
                    tuple(source.stop_ids), items, prompts, lambda e: source.make_env(),
                    temperature=0.7, prompt_buckets=DEFAULT_PROMPT_BUCKETS)  # fmt: skip


def scripted_workload(preset, args) -> Workload:
    """`--turn_tokens L`: turns of about L tokens. The policy is `preset` at its seed-0 random
    init, sampled at temperature 100 (nearly uniform over its vocabulary V), with V / L of its
    ids stop ids, so turn lengths are about geometric with mean L (at most 3 L); `--turns`
    turns per episode, each tool reply `--observation_tokens` ids; 16-token prompts. What it
    measures is the engine's and driver's cost per turn boundary against the turns' length,
    not a task."""
    L, turns, obs = args.turn_tokens, args.turns, args.observation_tokens
    config = PRESETS[preset](512, build_arithmetic_tokenizer())
    model = Transformer(config, rngs=nnx.Rngs(0))
    vocab = config.vocab_size
    stop_ids = tuple(range(vocab - max(1, round(vocab / L)), vocab))  # P(stop) ~ 1 / L
    rng = np.random.default_rng(0)
    plain = stop_ids[0]  # prompts and replies: ids below the stop ids
    prompts = [tuple(int(t) for t in rng.integers(3, plain, 16)) for _ in range(args.prompts)]
    observation = tuple(int(t) for t in rng.integers(3, plain, obs))
    turn_max = 3 * L
    total = min(16 + turns * turn_max + (turns - 1) * obs, config.max_position_embeddings)
    budget = EpisodeBudget(
        max_turns=turns,
        max_turn_tokens=turn_max,
        max_total_tokens=total,
        max_observation_tokens=(turns - 1) * obs,
        tool_timeout_s=10.0,
    )
    items = [PromptItem(f"scripted {e}", "") for e in range(args.prompts)]
    return Workload(f"scripted, {turns} turns of ~{L} + {obs}-token replies", model, float("nan"),
                    0.0, budget, stop_ids, items, prompts,
                    lambda e: ScriptedToolEnv(prompts[e], observation, turns),
                    temperature=100.0)  # fmt: skip


def measure(name, preset, args, continue_modes) -> list[dict]:
    if args.hf_dir:
        work = chat_workload(preset, args)
    else:
        work = (scripted_workload if args.turn_tokens else calculator_workload)(preset, args)
    model, budget, items, prompts = work.model, work.budget, work.items, work.prompts
    max_len = model.config.max_position_embeddings
    engine, params = Engine.for_model(
        model,
        num_slots=args.slots,
        steps_per_call=args.steps_per_call,
        max_total_len=min(max_len, budget.max_total_tokens),
        prompt_buckets=work.prompt_buckets,
        keep_calls=args.keep_calls,
        exit_stops=args.exit_stops,
        extend_min_rows=args.extend_min_rows,
        extend_buckets=args.extend_widths,
        span_buckets=args.span_buckets,
    )
    sampling = SamplingConfig(
        budget.max_turn_tokens, temperature=work.temperature, stop_ids=work.stop_ids
    )

    def groups():
        return [EpisodeGroup(e, item, [work.make_env(e) for _ in range(G)])
                for e, item in enumerate(items)]  # fmt: skip

    runners = {
        mode: EpisodeRunner(
            engine,
            sampling,
            budget,
            tool_workers=args.tool_workers,
            continue_in_slot=mode == "slot",
            tool_grace_s=args.tool_grace_s,
        )  # fmt: skip
        for mode in continue_modes
    }
    waited = {"s": 0.0}

    def multi(mode, seed, timed=None):
        runner = runners[mode]
        wait = runner._wait

        def timed_wait():
            t = time.perf_counter()
            wait()
            waited["s"] += time.perf_counter() - t

        runner._wait = timed_wait
        try:
            episodes = groups()  # built before the clock starts, as single-turn's requests are
            t = time.perf_counter()
            out = runner.run(params, jax.random.key(seed), episodes)
            seconds = time.perf_counter() - t
        finally:
            runner._wait = wait
        trajectories = [t for ts in out for t in ts]
        return seconds, trajectories

    def lengths_of(trajectories):
        """Each prompt's episodes' sampled token counts: what single-turn samples against them."""
        return [(p, tuple(sum(t.loss_mask) for t in trajectories if t.episode == e))
                for e, p in enumerate(prompts)]  # fmt: skip

    def single(kind, seed, lengths):
        """One request of G per prompt, sampling the `lengths` of a multi-turn run of the same
        seed: `kind` "lengths", each sample's budget its episode's sampled tokens; "lockstep",
        their mean for all."""
        temp = work.temperature
        if kind == "lengths":
            requests = [
                Request(e, p, G, SamplingConfig(max(n), temperature=temp, ignore_eos=True),
                        sample_budgets=n)
                for e, (p, n) in enumerate(lengths)
            ]  # fmt: skip
        else:
            mean = math.ceil(sum(sum(n) for _, n in lengths) / (len(lengths) * G))
            plain = SamplingConfig(mean, temperature=temp, ignore_eos=True)
            requests = [Request(i, p, G, plain) for i, p in enumerate(prompts)]
        t = time.perf_counter()
        out = engine.generate(params, requests, jax.random.key(seed))
        seconds = time.perf_counter() - t
        return seconds, sum(int(g.mask_gn.sum()) for g in out)

    start = time.perf_counter()
    longest = max(map(len, prompts))
    compiled = 0
    warm_each = bool(args.turn_tokens or args.hf_dir)
    if not warm_each:  # scripted and chat: every span bucket up to hundreds of positions would
        # take minutes (a 135M model's, more memory than the machine has); their warm-up runs
        # compile what the episodes need instead.
        widest = budget.max_total_tokens  # a history re-prefilled reaches the total budget
        compiled = engine.precompile(params, sampling, max_prompt_len=widest,
                                     max_extend_len=budget.max_observation_tokens + 1)  # fmt: skip
        plain = SamplingConfig(1, temperature=work.temperature, ignore_eos=True)
        compiled += engine.precompile(params, plain, samples_per_request=G, max_prompt_len=longest)
    print(f"[{name}] precompiled {compiled} programs in {time.perf_counter() - start:.0f}s")
    rows = []
    singles = ("lengths", "lockstep")
    paths = (*singles, *continue_modes)
    # A run that compiled a program is run again (up to WARM_TRIES times): what is timed is the
    # steady state an RL run reaches once its programs exist. Timed runs count them per path.
    compiles = dict.fromkeys(paths, 0)

    def steady(fn, path, seed, counts=True):
        for _ in range(WARM_TRIES):
            before = engine.stats.num_traces
            seconds, out = fn(path, seed)
            if engine.stats.num_traces == before:
                break
            compiles[path] += counts
        return seconds, out

    def paired(seed, run=steady):
        """Every multi-turn path on `seed`, then single-turn sampling the first path's episodes'
        token counts on the same seed: {path: (seconds, sampled tokens or trajectories)}."""
        out = {mode: run(multi, mode, seed) for mode in continue_modes}
        lengths = lengths_of(out[continue_modes[0]][1])
        for kind in singles:
            out[kind] = run(lambda k, s: single(k, s, lengths), kind, seed)
        return out

    paired(0, run=lambda fn, path, seed: fn(path, seed))  # warm-up: compiles what it meets
    if warm_each:  # not precompiled: each timed run first, again while it compiles (a
        # multi-turn run's shapes depend on when tool replies land, so one warm-up may miss some)
        for seed in (*range(1, args.repeats + 1), 99):  # 99: the instrumented run
            paired(seed, run=lambda fn, path, seed: steady(fn, path, seed, counts=False))

    # Timed: repeat r's single-turn runs sample the token counts of its multi-turn episodes
    # (same seed), so each ratio compares the same tokens; medians over the repeats.
    times, tok_s, ratios, ratios_lockstep = ({p: [] for p in paths} for _ in range(4))
    sampled, trajectories = dict.fromkeys(paths, 0), {}
    for r in range(args.repeats):
        out = paired(r + 1)
        for path, (seconds, result) in out.items():
            if path in continue_modes:
                trajectories[path] = result
                result = sum(sum(t.loss_mask) for t in result)
            times[path].append(seconds)
            tok_s[path].append(result / seconds)
            sampled[path] += result
        for path in paths:
            ratios[path].append(tok_s[path][-1] / tok_s["lengths"][-1])
            ratios_lockstep[path].append(tok_s[path][-1] / tok_s["lockstep"][-1])

    def split(fn):
        for _ in range(WARM_TRIES):  # as `steady`: a run that compiled is run again
            before = dataclasses.asdict(engine.stats)
            waited["s"] = 0.0
            with Timed(engine) as timed:
                start = time.perf_counter()
                result = fn()
                wall = time.perf_counter() - start
            stats = _stats_delta(engine, before)
            if not stats["num_traces"]:
                break
        device = sum(timed.seconds.values())
        return result, {
            "prefill_s": round(timed.seconds.get("prefill", 0.0), 3),
            "extend_s": round(timed.seconds.get("extend", 0.0), 3),
            "decode_s": round(timed.seconds.get("decode", 0.0), 3),
            "move_s": round(timed.seconds.get("move", 0.0), 3),
            "prefill_calls": timed.calls.get("prefill", 0),
            "extend_calls": stats["extend_calls"],
            "decode_calls": timed.calls.get("decode", 0),
            "early_exits": stats.get("early_exits", 0),
            "prefill_tokens": stats["prefill_tokens"],
            "extend_tokens": stats.get("extend_tokens", 0),
            "extend_padded_tokens": stats.get("extend_padded_tokens", 0),
            "utilisation": round(stats["kept_tokens"] / max(stats["slot_steps"], 1), 3),
            "slot_steps": stats["slot_steps"],
            "attended_positions": stats["attended_positions"],
            "tool_wait_s": round(waited["s"], 3),
            "host_s": round(wall - device - waited["s"], 3),
            "continued_rows": stats["continued_rows"],
            "kept_wait_calls": stats["kept_wait_calls"],
        }

    # The instrumented run (seed 99), paired as the timed ones.
    instrumented = {mode: split(lambda mode=mode: multi(mode, 99)) for mode in continue_modes}
    lengths = lengths_of(instrumented[continue_modes[0]][0][1])
    for kind in singles:
        instrumented[kind] = split(lambda kind=kind: single(kind, 99, lengths))
    episodes = len(items) * G
    common = {
        "model": name,
        "params_m": round(model.config.num_params() / 1e6, 2),
        "task": work.task,
        "episodes": episodes,
        "slots": args.slots,
        "steps_per_call": args.steps_per_call,
        "extend_min_rows": args.extend_min_rows,
        "keep_calls": args.keep_calls,
        "exit_stops": args.exit_stops,
        "extend_widths": list(args.extend_widths or ()),
        "span_buckets": list(args.span_buckets or ()),
        "sft_steps": args.sft_steps,
        "sft_loss": round(work.sft_loss, 3),
        "sft_s": round(work.sft_s, 1),
    }
    labels = {"lengths": "single-turn, the episodes' lengths",
              "lockstep": "single-turn, mean length, lockstep"}  # fmt: skip
    for path in paths:
        row = common | {"path": labels.get(path, f"multi-turn ({path})")}
        if path in continue_modes:
            last = trajectories[path]
            row |= {
                "turns_mean": round(sum(t.turns for t in last) / len(last), 2),
                "tool_call_rate": round(sum(t.turns > 1 for t in last) / len(last), 3),
            }
        else:
            row["turns_mean"] = 1.0
        row |= {
            "sampled_per_episode": round(sampled[path] / (args.repeats * episodes), 2),
            "sampled_tok_s": round(statistics.median(tok_s[path]), 1),
            "ratio": round(statistics.median(ratios[path]), 3),
            "ratios": [round(x, 3) for x in ratios[path]],
            "ratio_lockstep": round(statistics.median(ratios_lockstep[path]), 3),
            "wall_s": round(statistics.median(times[path]), 3),
            "timed_compiles": compiles[path],
        }
        rows.append(row | instrumented[path][1])
    for runner in runners.values():
        runner.close()
    return rows


def extension_cost(preset: str, args) -> list[dict]:
    """Median seconds of one decode call plain and with continued rows (module docstring)."""
    tokenizer = build_arithmetic_tokenizer()
    config = PRESETS[preset](-(-len(tokenizer) // 8) * 8, tokenizer)  # as `sft_policy`'s
    model = Transformer(config, rngs=nnx.Rngs(0))
    engine, params = Engine.for_model(
        model, num_slots=args.slots, steps_per_call=args.steps_per_call, max_total_len=64
    )
    programs, active, span, width = engine.programs, args.slots, 32, 8
    sampling = engine._static_sampling(SamplingConfig(16, temperature=1.0, stop_ids=(3,)))
    cache = programs.new_cache(engine.capacity)
    state = [np.full(active, 5, np.int32), np.full(active, 12, np.int32),
             np.zeros(active, np.int32), np.full(active, 16, np.int32), np.ones(active, bool),
             np.arange(active, dtype=np.int32), np.zeros(active, np.int32)]  # fmt: skip
    key_data = np.asarray(jax.random.key_data(jax.random.key(0)))
    cases = {0: ()}
    for rows in (8, 16, 32):  # rows of `width` new tokens at positions 8.., slots 0..rows-1
        slots = np.arange(rows, dtype=np.int32)
        cases[rows] = ((np.full((rows, width), 5, np.int32), np.full(rows, 8, np.int32), slots),)
    times = {rows: [] for rows in cases}
    for repeat in range(2 + args.repeats * 10):
        for rows, extend in cases.items():
            start = time.perf_counter()
            cache, *_ = jax.block_until_ready(programs.run(
                "decode", params, cache, tuple(programs.place_rows(x) for x in state),
                key_data, np.int32(0), *extend, sampling=sampling, span=span, active=active,
            ))  # fmt: skip
            if repeat >= 2:  # the first two compile and warm up
                times[rows].append(time.perf_counter() - start)
    plain = statistics.median(times[0])
    return [
        {
            "model": preset,
            "params_m": round(config.num_params() / 1e6, 2),
            "active": active,
            "span": span,
            "steps_per_call": args.steps_per_call,
            "extended_rows": rows,
            "extension_width": width if rows else 0,
            "call_ms": round(1e3 * statistics.median(t), 2),
            "vs_plain": round(statistics.median(t) / plain, 3),
        }
        for rows, t in times.items()
    ]


def _note() -> str:
    """The results files' note: the command, the machine and its load."""
    load = "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    return f"`{command()}` on {machine()}, {load}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16, help="prompts (x G = 8 episodes)")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--steps_per_call", type=int, default=8)
    parser.add_argument("--tool_workers", type=int, default=8)
    parser.add_argument("--tool_grace_s", type=float, default=0.005)
    parser.add_argument("--keep_calls", type=int, default=0)
    parser.add_argument(
        "--exit_stops", type=int, default=0,
        help="a decode call ends once this many rows stopped while work waits (Engine.exit_stops)",
    )  # fmt: skip
    parser.add_argument(
        "--extend_min_rows", type=int, default=8,
        help="fewest rows a decode call's extension computes (Engine.extend_min_rows)",
    )  # fmt: skip
    parser.add_argument("--sft_steps", type=int, default=300)
    parser.add_argument("--sft_cache", default=None, help="directory for the SFT'd params")
    parser.add_argument("--chained", action="store_true", help="a*b+c*d: four turns")
    parser.add_argument(
        "--turn_tokens", type=int, default=0,
        help="> 0: the scripted workload, turns of about this many tokens (not the calculator)",
    )  # fmt: skip
    parser.add_argument("--turns", type=int, default=3, help="--turn_tokens: turns per episode")
    parser.add_argument("--observation_tokens", type=int, default=8, help="--turn_tokens: reply")
    parser.add_argument("--models", default="", help="presets (default arith_tiny,rlbench_tiny)")
    parser.add_argument(
        "--hf_dir", default="",
        help="a pretrained chat model (SmolLM2-135M-Instruct): its ChatML calculator episodes "
        "instead of the presets' (--models names its rows)",
    )  # fmt: skip
    parser.add_argument(
        "--span_buckets", type=lambda v: tuple(int(w) for w in v.split(",")), default=None,
        help="attended prefixes a decode call is bucketed to (Engine.span_buckets; default "
        "powers of two from 32, and the cache's length)",
    )  # fmt: skip
    parser.add_argument(
        "--extend_widths", type=lambda v: tuple(int(w) for w in v.split(",")), default=None,
        help="comma list of extension widths (Engine.extend_buckets; default 8, 16, 32, ...)",
    )  # fmt: skip
    parser.add_argument("--name", default=None, help="results file name (default multiturn)")
    parser.add_argument("--paths", default="slot,request", help="multi-turn paths to run")
    parser.add_argument(
        "--extension_cost", action="store_true",
        help="time a decode call with 0, 8, 16, 32 continued rows instead (module docstring)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.models = args.models or ("smollm2" if args.hf_dir else "arith_tiny,rlbench_tiny")
    if args.extension_cost:
        rows = [row for preset in args.models.split(",") for row in extension_cost(preset, args)]
        columns = [("model", "model"), ("params_m", "params (M)"), ("active", "active slots"),
                   ("span", "span"), ("steps_per_call", "steps / call"),
                   ("extended_rows", "continued rows"), ("extension_width", "new tokens / row"),
                   ("call_ms", "decode call ms"), ("vs_plain", "vs no continuation")]  # fmt: skip
        print(write_results(args.name or "multiturn_extension", rows, columns, _note()))
        return
    if args.smoke:
        args.prompts, args.slots, args.repeats, args.sft_steps = 4, 16, 1, 30
        args.models = "arith_tiny"
    modes = tuple(m for m in args.paths.split(",") if m)
    if not modes or set(modes) - {"slot", "request"}:
        parser.error(f"--paths={args.paths!r}; a comma-separated subset of slot,request")
    rows = []
    for preset in args.models.split(","):
        for row in measure(preset, preset, args, modes):
            print(json.dumps(row), flush=True)
            rows.append(row)
    columns = [
        ("model", "model"),
        ("params_m", "params (M)"),
        ("task", "task"),
        ("path", "path"),
        ("turns_mean", "turns"),
        ("sampled_per_episode", "sampled tok / episode"),
        ("sampled_tok_s", "sampled tok/s"),
        ("ratio", "vs single-turn, same lengths"),
        ("ratio_lockstep", "vs single-turn, lockstep"),
        ("ratios", "ratios per repeat"),
        ("prefill_calls", "prefill calls"),
        ("extend_calls", "decode calls extending"),
        ("decode_calls", "decode calls"),
        ("prefill_s", "prefill s"),
        ("decode_s", "decode s"),
        ("extend_tokens", "tool-reply tokens extended"),
        ("extend_padded_tokens", "extended positions, padded"),
        ("tool_wait_s", "tool wait s"),
        ("host_s", "host s"),
        ("kept_wait_calls", "calls continuations waited"),
        ("early_exits", "decode calls ended early"),
        ("utilisation", "slot utilisation"),
        ("attended_positions", "attended positions (slot-steps x span)"),
        ("timed_compiles", "timed runs that compiled (run again)"),
    ]
    name = args.name or ("multiturn_smoke" if args.smoke else "multiturn")
    print(write_results(name, rows, columns, _note()))


if __name__ == "__main__":
    main()
