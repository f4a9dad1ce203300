"""`make demo`: the main job on its embedded default, on 8 simulated CPU devices.

Runs `launch.rl` with `configs/rl/arith_tiny_sync.gin` (SFT warm start, then sync RL with AIPO on
1-2 digit addition, a 0.4M-parameter Llama) into `runs/demo`, with a shorter RL schedule so it
ends in a few minutes, then prints where the metrics, the plot and the checkpoints are. Rerunning
resumes (or, when finished, only reports).

    python -m launch.demo [--workdir runs/demo] [--rl_steps 400]
"""

from __future__ import annotations

import argparse
import os
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--rl_steps", type=int, default=400)
    args = parser.parse_args(argv)

    import jax

    from jaxrl.infra.config import launch
    from launch.rl import rl_main

    devices = jax.devices()
    print(f"JAX {jax.__version__}: {len(devices)} {devices[0].platform} devices")
    start = time.perf_counter()
    result = launch(
        rl_main,
        [
            "--gin_file", os.path.join(REPO, "configs", "rl", "arith_tiny_sync.gin"),
            "--workdir", args.workdir,
            "--gin_param", f"RLConfig.total_steps = {args.rl_steps}",
            "--gin_param", f"RLConfig.eval_every_steps = {max(args.rl_steps // 4, 1)}",
            "--gin_param", f"RLConfig.save_every_steps = {max(args.rl_steps // 4, 1)}",
        ],
    )
    print(f"demo finished in {time.perf_counter() - start:.0f}s (workdir {result['workdir']})")


if __name__ == "__main__":
    main()
