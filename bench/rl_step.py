"""The rlbench-tiny sync RL step on one CPU core, this tree against an earlier commit, with FLOPs.

Each side runs `bench.rl`'s "sync (1 process, 1 core)" row (`run_mode(PROXY_SYNC_1)`: the
library's Controller, sample + score + train, one CPU device, the process pinned to one core) in a
fresh process, from its own source tree: this checkout, and `--baseline` (a commit, checked out
into a temporary git worktree). The two alternate for `--rounds` rounds, so a drift in the
machine's speed hits both alike; per side, the median over rounds of each round's median step
(after warm-up) and of its phases. Both trees get the same malloc settings (`--allocator`: keep
freed memory, as this tree's launchers do, or glibc's default), so the comparison is of the code.

Next to the times, the train step's FLOPs on this tree: XLA's cost analysis of the compiled RL
step for the workload's batch (32 rows x (16 + 32) tokens), the minimal FLOPs for the same tokens
(forward `2 x N x tokens`, N the parameters outside the embedding lookup, plus the attention
scores `4 x layers x S^2/2 x heads x head_dim` per row; x3 for forward + backward), and the
achieved GFLOP/s of the measured train phase against this core's fp32 matmul peak (a 1024^3
`jnp.dot`, same pinning).

    python -m bench.rl_step                      # this tree vs 3876ef4, 3 rounds x 16 steps
    python -m bench.rl_step --smoke              # 1 round of a few steps, no baseline (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import baseline_worktree
from bench.rl import smoke_xla_flags
from jaxrl.infra.xla_cpu import allocator_env, cpu_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = (
    "import json, sys\n"
    "from bench.rl import run_mode, PROXY_SYNC_1\n"
    "row = run_mode(PROXY_SYNC_1, int(sys.argv[1]), sys.argv[2] == 'smoke')\n"
    "print('ROW ' + json.dumps(row))\n"
)
PHASES = ("step_s", "generate_s", "reward_s", "train_s")


def _env(allocator: str = "keep", flags: str = "") -> dict:
    env = allocator_env(dict(os.environ), allocator)  # both trees alike
    env["XLA_FLAGS"] = cpu_xla_flags(flags, devices=1)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(
    tree: str, code: str, args: list[str], core: int, allocator: str = "keep", flags: str = ""
) -> dict:
    """`code` in a fresh process importing from `tree`, pinned to `core`, with XLA flags `flags`
    (and one device); its `ROW` line."""
    env = _env(allocator, flags) | {"PYTHONPATH": tree}
    out = subprocess.run(
        ["taskset", "-c", str(core), sys.executable, "-c", code, *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    rows = [line[4:] for line in out.stdout.splitlines() if line.startswith("ROW ")]
    if out.returncode or not rows:
        raise SystemExit(f"bench.rl_step: run in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(rows[-1])


FLOPS = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from bench.rl import _model_config, _trainer, PROMPT_LEN, NUM_PROMPTS, SAMPLES
from jaxrl.rl import Rollout, collate_rollouts
smoke = sys.argv[1] == 'smoke'
new = 4 if smoke else 32
trainer = _trainer(((1, 1), 0), 10, smoke)
config = trainer.model_config
rng = np.random.default_rng(0)
rollouts = [Rollout(rng.integers(3, 512, PROMPT_LEN), rng.integers(3, 512, new),
                    np.full(new, -6.0, np.float32), 0, float(i % 2), i // SAMPLES)
            for i in range(NUM_PROMPTS * SAMPLES)]
batch = collate_rollouts(rollouts, prompt_len=PROMPT_LEN, completion_len=new, pad_id=0)
state = trainer.abstract_state()
with trainer._context():
    compiled = trainer._rl.lower(state, trainer.place_batch(batch), None, None).compile()
cost = compiled.cost_analysis()
cost = cost[0] if isinstance(cost, list) else cost
params = sum(x.size for x in jax.tree.leaves(trainer.abstract_params))
embedding = config.vocab_size * config.hidden_size  # a lookup, no FLOPs (tied: also the head)
matmul_params = params - (0 if config.tie_word_embeddings else embedding)
rows, seq = batch.batch_size, PROMPT_LEN + new
attention = 4 * config.num_layers * seq * seq / 2 * config.num_heads * config.head_dim
minimal = 3 * rows * (2 * matmul_params * seq + attention)
x = jnp.ones((1024, 1024), jnp.float32)
dot = jax.jit(lambda a: a @ a)
dot(x).block_until_ready()
times = []
for _ in range(10):
    start = time.perf_counter()
    dot(x).block_until_ready()
    times.append(time.perf_counter() - start)
peak = 2 * 1024**3 / min(times) / 1e9
print('ROW ' + json.dumps(dict(xla_gflop=float(cost['flops']) / 1e9, minimal_gflop=minimal / 1e9,
      params=int(params), tokens=rows * seq, matmul_peak_gflops=peak)))
"""


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--baseline", default="3876ef4")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument(
        "--allocator", default="keep", choices=["keep", "default"],
        help="both trees' malloc: keep freed memory (the launchers' setting) or glibc's default",
    )  # fmt: skip
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.smoke else 3)
    steps = args.steps or (4 if args.smoke else 16)
    mode = "smoke" if args.smoke else "full"
    # The smoke's processes keep this one's LLVM optimisation level (0 in the tests): it checks
    # the plumbing and XLA's FLOP count, which the level does not change.
    flags = smoke_xla_flags() if args.smoke else ""
    core = sorted(os.sched_getaffinity(0))[-1]
    load_before = os.getloadavg()[0]
    baseline = (
        contextlib.nullcontext() if args.smoke else baseline_worktree(args.baseline, "rl_step_")
    )
    with baseline as base:
        trees = {"this tree": REPO}
        if base is not None:
            trees = {f"baseline {args.baseline}": base} | trees
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(rounds):
            for name, tree in trees.items():
                start = time.perf_counter()
                runs[name].append(_run(tree, RUN, [str(steps), mode], core, args.allocator, flags))
                print(f"[rl_step] round {r + 1}/{rounds} {name}: "
                      f"{runs[name][-1]['step_s']:.3f} s/step "
                      f"({time.perf_counter() - start:.0f}s)", flush=True)  # fmt: skip
        flops = _run(REPO, FLOPS, [mode], core, args.allocator, flags)
    rows = []
    for name, results in runs.items():
        row = {"tree": name, "rounds": len(results)}
        row |= {k: statistics.median(r[k] for r in results) for k in PHASES}
        rows.append(row)
    reference = rows[0]["step_s"]
    for row in rows:
        row["vs_baseline"] = row["step_s"] / reference
    ours = rows[-1]
    ours |= flops
    ours["achieved_gflops"] = flops["xla_gflop"] / ours["train_s"]
    ours["peak_fraction"] = ours["achieved_gflops"] / flops["matmul_peak_gflops"]
    for row in rows:
        print(json.dumps(row), flush=True)

    from bench.common import write_results

    command = "python -m bench.rl_step" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    command = os.environ.get("JAXRL_BENCH_COMMAND") or command  # `python -m bench`
    load = f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    note = (
        f"`{command}`, one core (taskset -c {core}), {load}, {steps} steps x {rounds} rounds, "
        f"malloc {args.allocator} in both trees"
    )
    columns = [
        ("tree", "tree"), ("step_s", "s / step"), ("vs_baseline", "vs baseline"),
        ("generate_s", "generate s"), ("reward_s", "reward s"), ("train_s", "train s"),
        ("xla_gflop", "train GFLOP (XLA)"), ("minimal_gflop", "minimal GFLOP"),
        ("achieved_gflops", "train GFLOP/s"), ("matmul_peak_gflops", "fp32 matmul peak GFLOP/s"),
        ("peak_fraction", "of peak"),
    ]  # fmt: skip
    print(write_results("rl_step" + ("_smoke" if args.smoke else ""), rows, columns, note))
    return rows


if __name__ == "__main__":
    main()
