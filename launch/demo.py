"""`make demo`: the main job on its embedded default, on 8 simulated CPU devices.

Runs `launch.rl` with `configs/rl/arith_tiny.gin` (SFT warm start, then async LlamaRL-style RL
with AIPO on 1-2 digit addition, a 0.4M-parameter Llama: the trainer on devices 0-3, two policy
versions behind) into `runs/demo`, with a shorter RL schedule so it ends in a few minutes and the
generator on device 4 alone, then prints where the metrics, the plot and the checkpoints are.
Rerunning resumes (or, when finished, only reports).

The generator is one device because XLA:CPU runs one multi-device program of a process at a time:
the config's 4-device generator would wait for each 4-device train step to end, so the roles would
take turns instead of overlapping (`jaxrl.infra.mesh.cpu_overlap_note`, which `launch.rl` prints for
that layout). On GPUs and TPUs the config's layout runs both roles at once.

`--sync` runs the colocated sync baseline instead (`configs/rl/arith_tiny_sync.gin`).

    python -m launch.demo [--workdir runs/demo] [--rl_steps 400] [--sync]
"""

from __future__ import annotations

import argparse
import os
import time

from jaxrl.infra.xla_cpu import cpu_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The generator on device 4 alone: it runs beside the trainer's 4-device programs on CPU devices.
ONE_DEVICE_GENERATOR = (
    "generator/MeshConfig.axis_sizes = (1, 1)",
    "generator/MeshConfig.num_devices = 1",
)


def main(argv=None) -> None:
    os.environ["XLA_FLAGS"] = cpu_xla_flags(os.environ.get("XLA_FLAGS", ""), devices=8)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--rl_steps", type=int, default=400)
    parser.add_argument("--sync", action="store_true", help="the colocated sync baseline")
    args = parser.parse_args(argv)

    import jax

    from jaxrl.infra.launcher import launch
    from launch.rl import rl_main

    devices = jax.devices()
    print(f"JAX {jax.__version__}: {len(devices)} {devices[0].platform} devices")
    start = time.perf_counter()
    result = launch(rl_main, demo_flags(args.workdir, args.rl_steps, args.sync))
    print(f"demo finished in {time.perf_counter() - start:.0f}s (workdir {result['workdir']})")
    print(summary(os.path.join(result["workdir"], "metrics.jsonl")))


def demo_flags(workdir: str, rl_steps: int, sync: bool) -> list[str]:
    """The `launch.rl` command line of the demo."""
    config = "arith_tiny_sync.gin" if sync else "arith_tiny.gin"
    every = max(rl_steps // 4, 1)
    flags = [
        "--gin_file", os.path.join(REPO, "configs", "rl", config),
        "--workdir", workdir,
        "--gin_param", f"RLConfig.total_steps = {rl_steps}",
        "--gin_param", f"RLConfig.eval_every_steps = {every}",
        "--gin_param", f"RLConfig.save_every_steps = {every}",
    ]  # fmt: skip
    if not sync:
        flags += [f"--gin_param={param}" for param in ONE_DEVICE_GENERATOR]
    return flags


def summary(metrics_path: str) -> str:
    """Held-out greedy accuracy before and after RL and, for async runs, the async figures."""
    from jaxrl.infra.metrics import read_metrics

    records = read_metrics(metrics_path)
    evals = [r for r in records if "eval/accuracy" in r]
    first, final = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    text = f"greedy held-out accuracy {first:.3f} -> {final:.3f}"
    last = records[-1]
    if "async/staleness_mean" in last:
        text += (
            f"; async: mean staleness {last['async/staleness_mean']:.2f}, "
            f"{last['async/dropped_samples']:.0f} samples dropped, generation overlapped "
            f"training {100 * last['async/overlap_fraction']:.0f}% of the wall time"
        )
    return text


if __name__ == "__main__":
    from jaxrl.infra.user_code import keep_torch_out

    keep_torch_out()
    main()
