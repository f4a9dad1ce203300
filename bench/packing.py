"""The RL train step on padded vs packed batches (`jaxrl.rl.packing`), one CPU device.

Model: rlbench-tiny (Llama 3, vocab 512, hidden 256, MLP 768, 4 layers, 8 heads, 4 KV heads),
AIPO, AdamW. Two batches of 64 rollouts (8 prompts x 8 samples):

- "long tail": prompts of 8..64 tokens (uniform), completion lengths log-normal with median 32,
  capped at 256 (the shape of reasoning RL); padded to a prompt bucket of 64 and
  `max_new_tokens` 256, packed into rows of 320 tokens;
- "rlbench": 16-token prompts, 32-token completions (`bench.rl`'s workload with a random policy,
  which almost never stops early); padded to 16 + 32, packed into rows of 96: nothing to gain,
  the control that packing costs nothing where there is no padding.

Per batch and layout: tokens through the model, XLA's FLOPs for the step (`cost_analysis` of the
compiled program), the median of `--repeats` timed steps after a warm-up, and the packed step's
time as a fraction of the padded one (measured alternately, in one run). The loss of the two
layouts is printed side by side (equal to ~1e-6: tests/test_packing.py checks it with gradients).

    python -m bench.packing            # ~2 minutes on 2 cores
    python -m bench.packing --smoke    # 1 layer, the long-tail batch shrunk (a test runs it)
"""

from __future__ import annotations

from bench import cpu_devices

cpu_devices.simulate(1)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import command, machine, write_results  # noqa: E402
from jaxrl.infra.mesh import MeshConfig, make_mesh  # noqa: E402
from jaxrl.infra.sharding import TRAINER_RULES  # noqa: E402
from jaxrl.models.presets import rlbench_tiny  # noqa: E402
from jaxrl.rl import Rollout, collate_rollouts  # noqa: E402
from jaxrl.train.trainer import OptimizerConfig, Trainer  # noqa: E402


def _batch(kind: str, rows: int, smoke: bool):
    """(padded RolloutBatch, pack length) for workload `kind`."""
    rng = np.random.default_rng(0)
    if kind == "long tail":
        prompt_max, completion_max, pack = (16, 64, 80) if smoke else (64, 256, 320)
        prompts = rng.integers(prompt_max // 8, prompt_max + 1, rows)
        median = completion_max / 8
        completions = np.clip(rng.lognormal(np.log(median), 1.0, rows), 1, completion_max)
    else:
        prompt_max, completion_max, pack = (16, 8, 48) if smoke else (16, 32, 96)
        prompts = np.full(rows, prompt_max)
        completions = np.full(rows, completion_max)
    rollouts = [
        Rollout(
            rng.integers(3, 512, int(p)),
            rng.integers(3, 512, int(t)),
            rng.normal(-6.0, 0.5, int(t)).astype(np.float32),
            0,
            float(rng.random()),
            i // 8,
        )
        for i, (p, t) in enumerate(zip(prompts, completions, strict=True))
    ]
    batch = collate_rollouts(
        rollouts, prompt_len=prompt_max, completion_len=completion_max, pad_id=0
    )
    return batch, pack


def _measure(trainer: Trainer, batch, state, repeats: int) -> tuple[list[float], object, dict]:
    """Step times (state carried, so every step is a real update) and the last metrics."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = trainer.rl_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return times, state, jax.device_get(metrics)


def step_flops(trainer: Trainer, state, batch) -> float:
    """XLA's FLOPs of `trainer`'s RL step on `batch`, laid out as `rl_step` would."""
    batch = trainer.layout_batch(batch)
    with trainer._context():  # the lowered program's cost: no second compile
        lowered = trainer._rl.lower(state, trainer.place_batch(batch), None, None)
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--repeats", type=int, default=0)
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.smoke else 7)
    config = rlbench_tiny(**(dict(num_layers=1) if args.smoke else {}))
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1))
    optimizer = OptimizerConfig(learning_rate=1e-5).make(1000)
    rows = []
    for kind in ("long tail",) if args.smoke else ("long tail", "rlbench"):
        batch, pack = _batch(kind, 16 if args.smoke else 64, args.smoke)
        trainers = {
            # Packing alone: each rollout's prompt kept (shared prompts: bench.shared_prompt).
            layout: Trainer(
                config, mesh, TRAINER_RULES, optimizer, pack_length=length, share_prompts=False
            )
            for layout, length in (("padded", 0), ("packed", pack))
        }
        states = {k: t.init(t.init_params(0)) for k, t in trainers.items()}
        times = {k: [] for k in trainers}
        losses = {}
        for layout, trainer in trainers.items():  # warm-up: compiles
            _, states[layout], _ = _measure(trainer, batch, states[layout], 1)
        for _ in range(repeats):  # alternate, so drifts in the machine's speed hit both alike
            for layout, trainer in trainers.items():
                seconds, states[layout], metrics = _measure(trainer, batch, states[layout], 1)
                times[layout] += seconds
                losses[layout] = float(metrics["loss"])
        padded_s = statistics.median(times["padded"])
        for layout, trainer in trainers.items():
            packed = trainer.layout_batch(batch) if layout == "packed" else None
            tokens = (
                packed.tokens_rl.size
                if packed is not None
                else batch.batch_size * (batch.prompt_len + batch.completion_len)
            )
            row = {
                "workload": kind,
                "layout": layout if packed is None else f"packed ({pack}-token rows)",
                "real_tokens": int(batch.prompt_mask_bp.sum() + batch.completion_mask_bt.sum()),
                "model_tokens": int(tokens),
                "gflop": step_flops(trainer, states[layout], batch) / 1e9,
                "step_s": statistics.median(times[layout]),
                "loss": losses[layout],
            }
            row["vs_padded"] = row["step_s"] / padded_s
            print(json.dumps(row), flush=True)
            rows.append(row)

    note = f"`{command()}` on {machine()}, load average {os.getloadavg()[0]:.1f} at the end"
    columns = [
        ("workload", "workload"), ("layout", "layout"), ("real_tokens", "real tokens"),
        ("model_tokens", "tokens through the model"), ("gflop", "GFLOP / step"),
        ("step_s", "s / step"), ("vs_padded", "vs padded"), ("loss", "loss"),
    ]  # fmt: skip
    print(write_results("packing" + ("_smoke" if args.smoke else ""), rows, columns, note))
    return rows


if __name__ == "__main__":
    main()
