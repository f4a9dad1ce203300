"""A speed-up model for sync vs async RL, from compiled costs and chip peaks; checked against
this machine's `bench.rl` CPU proxy rows (on a quiet machine it predicts about half the measured
times: a lower bound, see bench/results/scale.md).

Model. Each program's time is its roofline, `t = max(FLOPs / peak FLOP/s, bytes / bandwidth)`
(per device, from `compiled.cost_analysis()`). One RL step:

    Tg = t(prefill) + (N - 1) t(decode step)        generation of N new tokens (first from prefill)
    Tt = t(train step)
    sync (colocated)  = Tg + Tt
    async (LlamaRL)   = max(Tg, Tt + Ts)            Ts: the weight push (measured, not modelled)

CPU validation (`--validate`): the programs `bench.rl` runs (rlbench-tiny, 8 prompts x 4 samples,
16-token prompts, 32 new tokens; one CPU device) are compiled here and their costs read; the
peaks are measured on this machine (best of several runs of a 1024^3 float32 matmul, and of a
256 MiB elementwise pass for bandwidth), pinned to one core and to both. XLA counts a while
loop's body once, so the decode step's cost is the sampler program's minus its prefill's.

Not done: the LlamaRL-scale predictions (8B / 70B / 405B) next to the paper's table (8B 22.4 s
-> 8.90 s, 70B 82.3 s -> 20.67 s, 405B 635.8 s -> 59.5 s); `launch.plan`'s per-step costs
(`PlanConfig.per_step_cost`) are the inputs they would take.

    python -m bench.scale --validate     # compiles 3 small CPU programs, ~1-2 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time


def roofline(flops: float, bytes_: float, peak_flops: float, bandwidth: float) -> float:
    """Seconds of a program bound by compute or by memory traffic, whichever is slower."""
    return max(flops / peak_flops, bytes_ / bandwidth)


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    generate_s: float
    train_s: float
    sync_s: float = 0.0

    @property
    def sync_step_s(self) -> float:
        return self.generate_s + self.train_s

    @property
    def async_step_s(self) -> float:
        return max(self.generate_s, self.train_s + self.sync_s)

    @property
    def speedup(self) -> float:
        return self.sync_step_s / self.async_step_s


# --- this machine ---------------------------------------------------------------------------


def measure_peaks(repeats: int = 9, shape: tuple[int, int, int] = (1024, 1024, 1024)):
    """(FLOP/s, bytes/s) of this process's CPU device, best of `repeats`: a float32 matmul
    `[m, k] @ [k, n]` of `shape`, and an elementwise pass over a 64 MiB buffer that is donated
    (reused: no fresh allocation's page faults in the timing)."""
    import jax
    import jax.numpy as jnp

    m, k, n = shape
    a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, b).block_until_ready()
    best = min(_timed(lambda: matmul(a, b).block_until_ready()) for _ in range(repeats))
    flops = 2 * m * k * n / best
    x = jnp.ones((16 * 1024 * 1024,), jnp.float32)
    scale = jax.jit(lambda v: v * 0.5 + 1.0, donate_argnums=0)
    x = scale(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x = scale(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return flops, 2 * x.nbytes / min(times)  # read + write


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cost(lowered) -> tuple[float, float]:
    cost = lowered.compile().cost_analysis()
    return float(cost["flops"]), float(cost["bytes accessed"])


def bench_rl_costs() -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) of `bench.rl`'s train step, sampler prefill and one decode step on one CPU
    device (the shapes of its CPU-proxy rows)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.rl import NUM_PROMPTS, PROMPT_LEN, SAMPLES, _model_config, _rl_config, _trainer
    from bench.rl import PROXY_SYNC_1 as MODE
    from jaxrl.generation.sampler import Sampler
    from jaxrl.generation.sampling import SamplingConfig
    from jaxrl.models.transformer import Transformer, constrain_cache, init_cache
    from jaxrl.planning import abstract_rollout_batch

    config = _model_config(False)
    new = _rl_config(MODE, 10, False).max_new_tokens
    rows = NUM_PROMPTS * SAMPLES
    trainer = _trainer(((1, 1), 0), 10, False)
    train = _cost(trainer.lower_rl_step(abstract_rollout_batch(rows, PROMPT_LEN, new)))

    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    sampler = Sampler(graphdef, config, pad_id=0, eos_ids=config.eos_token_ids)
    tokens = jax.ShapeDtypeStruct((rows, PROMPT_LEN), jnp.int32)
    valid = jax.ShapeDtypeStruct((rows, PROMPT_LEN), bool)
    key = jax.eval_shape(lambda: jax.random.key(0))
    sampling = SamplingConfig(max_new_tokens=new)
    whole = _cost(sampler._generate.lower(params, tokens, valid, key, sampling=sampling))

    def prefill(params, tokens_bp, valid_bp):  # the sampler's prefill, as in _generate_impl
        model = nnx.merge(graphdef, params)
        total = PROMPT_LEN + new
        cache = constrain_cache(init_cache(config, rows, total))
        valid_bs = jnp.concatenate([valid_bp, jnp.ones((rows, new), bool)], axis=1)
        positions = jnp.maximum(jnp.cumsum(valid_bp.astype(jnp.int32), axis=-1) - 1, 0)
        causal = jnp.arange(PROMPT_LEN)[:, None] >= jnp.arange(total)[None, :]
        mask = causal[None] & valid_bs[:, None]
        hidden, _ = model.hidden_states(tokens_bp, positions, mask, cache, 0)
        return model.logits(hidden[:, -1:])

    pre = _cost(jax.jit(prefill).lower(params, tokens, valid))
    decode = (whole[0] - pre[0], whole[1] - pre[1])
    return {"train": train, "prefill": pre, "decode": decode, "new_tokens": (new, new)}


def predict_bench_rl(costs, peak_flops: float, bandwidth: float, sync_s: float = 0.0):
    new = int(costs["new_tokens"][0])
    t = {k: roofline(*costs[k], peak_flops, bandwidth) for k in ("train", "prefill", "decode")}
    return StepPrediction(t["prefill"] + (new - 1) * t["decode"], t["train"], sync_s), t


def _validate_child(cores: list[int], out) -> None:
    os.sched_setaffinity(0, set(cores))
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    costs = bench_rl_costs()
    # The workload's own matmul shape (32 rows x 48 tokens against the 256 x 768 MLP), the peak
    # the model uses, and a 1024^3 matmul for comparison (equal on a quiet machine).
    out.send((costs, measure_peaks(shape=(1536, 256, 768)), measure_peaks()))


def validate() -> None:
    import json
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = {}
    for name, cores in (("1 core", [0]), ("2 cores", [0, 1])):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_validate_child, args=(cores, send))
        proc.start()
        results[name] = recv.recv()
        proc.join()
    print(f"load average: {os.getloadavg()}")
    for name, (costs, (flops, bw), (big_flops, _)) in results.items():
        pred, t = predict_bench_rl(costs, flops, bw)
        print(
            f"{name}: workload-shape matmul {flops / 1e9:.1f} GFLOP/s (1024^3 matmul "
            f"{big_flops / 1e9:.1f}), {bw / 1e9:.1f} GB/s; costs "
            + json.dumps({k: [f"{x:.3g}" for x in v] for k, v in costs.items()})
        )
        print(
            f"  predicted: generate {pred.generate_s:.3f} s, train {pred.train_s:.3f} s, "
            f"sync step {pred.sync_step_s:.3f} s, async step (Ts = 0) {pred.async_step_s:.3f} s"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate", action="store_true", help="predict bench.rl's CPU rows")
    args = parser.parse_args(argv)
    if args.validate:
        validate()


if __name__ == "__main__":
    main()
