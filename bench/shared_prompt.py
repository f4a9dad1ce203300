"""The RL train step with each group's prompt repeated per sample vs shared once per group
(`Trainer(share_prompts)`), one CPU device.

Model: rlbench-tiny (Llama 3, vocab 512, hidden 256, MLP 768, 4 layers, 8 heads, 4 KV heads),
GRPO, AdamW. Batch: 8 prompts of 128 tokens x G = 8 samples of 32 tokens (64 rollouts; random
tokens: the step's cost does not depend on them). Layouts:

- padded: `[B, P + T]`, each prompt repeated per sample (the trainer without `pack_length`);
- packed, repeated: rows of 384 tokens (2 sequences of 160 a row), `share_prompts=False`;
- packed, shared: the same rows, `share_prompts=True` (the default with packing): one
  `[prompt, c_1, ..., c_8]` unit of 384 tokens per group, one group a row.

A first run also had rows of 1920 tokens (12 sequences of 160, or 5 shared groups, a row): the
dense `[L, L]` attention made the repeated step 6.5x the padded one (shared: 2.1x), so long rows
are left out: pack in rows about as long as one group's unit.

Per layout: tokens through the model, XLA's FLOPs for the step (`cost_analysis` of the lowered
program), the median of `--repeats` timed steps after a warm-up (layouts interleaved, so drifts in
the machine's speed hit all alike), the step time as a fraction of the padded one and the loss
(equal across layouts to ~1e-6; tests/test_shared_prompts.py checks loss and gradients).
The predicted FLOPs fall of sharing, at equal rows: (G - 1) / G x P / (P + T) = 0.7.

    python -m bench.shared_prompt               # ~4 minutes on 2 loaded cores
    python -m bench.shared_prompt --repeats 1   # a quick look
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
from bench.packing import step_flops  # noqa: E402
from jaxrl.infra.mesh import MeshConfig, make_mesh  # noqa: E402
from jaxrl.infra.sharding import TRAINER_RULES  # noqa: E402
from jaxrl.models.presets import rlbench_tiny  # noqa: E402
from jaxrl.rl import Rollout, collate_rollouts  # noqa: E402
from jaxrl.train.trainer import LossConfig, OptimizerConfig, Trainer  # noqa: E402

PROMPTS, G, PROMPT_LEN, COMPLETION_LEN = 8, 8, 128, 32
LAYOUTS = (  # (name, pack_length, share_prompts)
    ("padded", 0, False),
    ("packed, repeated (384-token rows)", 384, False),
    ("packed, shared (384-token rows)", 384, True),
)


def _batch():
    rng = np.random.default_rng(0)
    rollouts = []
    for group in range(PROMPTS):
        prompt = rng.integers(3, 512, PROMPT_LEN)
        for _ in range(G):
            rollouts.append(
                Rollout(
                    prompt,
                    rng.integers(3, 512, COMPLETION_LEN),
                    rng.normal(-6.0, 0.5, COMPLETION_LEN).astype(np.float32),
                    0,
                    float(rng.random()),
                    group,
                )
            )
    return collate_rollouts(
        rollouts, prompt_len=PROMPT_LEN, completion_len=COMPLETION_LEN, pad_id=0
    )


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    config = rlbench_tiny()
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1))
    optimizer = OptimizerConfig(learning_rate=1e-5).make(1000)
    loss = LossConfig(name="grpo")
    batch = _batch()
    trainers = {
        name: Trainer(
            config,
            mesh,
            TRAINER_RULES,
            optimizer,
            loss=loss,
            pack_length=length,
            share_prompts=share if length else None,
        )
        for name, length, share in LAYOUTS
    }
    for name, trainer in trainers.items():
        assert trainer.share_prompts == dict((n, s) for n, _, s in LAYOUTS)[name]
    states = {k: t.init(t.init_params(0)) for k, t in trainers.items()}
    host = {k: t.layout_batch(batch) for k, t in trainers.items()}  # packed once, as a loop would
    times = {k: [] for k in trainers}
    losses = {}

    def one_step(name):
        start = time.perf_counter()
        states[name], metrics = trainers[name].rl_step(states[name], host[name])
        jax.block_until_ready(metrics)
        return time.perf_counter() - start, float(metrics["loss"])

    for name in trainers:  # warm-up: compiles
        one_step(name)
    for _ in range(args.repeats):
        for name in trainers:
            seconds, losses[name] = one_step(name)
            times[name].append(seconds)
    pack_s = {}
    for name, trainer in trainers.items():  # the host-side packing, timed apart
        start = time.perf_counter()
        trainer.layout_batch(batch)
        pack_s[name] = time.perf_counter() - start
    rows = []
    padded_s = statistics.median(times["padded"])
    padded_flops = None
    for name, trainer in trainers.items():
        b = host[name]
        tokens = (
            b.tokens_rl.size
            if trainer.pack_length
            else batch.batch_size * (PROMPT_LEN + COMPLETION_LEN)
        )
        flops = step_flops(trainer, states[name], b)
        padded_flops = padded_flops or flops
        row = {
            "layout": name,
            "model_tokens": int(tokens),
            "gflop": flops / 1e9,
            "flops_vs_padded": flops / padded_flops,
            "step_s": statistics.median(times[name]),
            "step_s_all": times[name],
            "pack_s": pack_s[name],
            "loss": losses[name],
        }
        row["vs_padded"] = row["step_s"] / padded_s
        print(json.dumps(row), flush=True)
        rows.append(row)
    note = (
        f"`{command()}` on {machine()}, load average {os.getloadavg()[0]:.1f} at the end "
        "(shared machine, other jobs running); medians of interleaved steps"
    )
    columns = [
        ("layout", "layout"), ("model_tokens", "tokens through the model"),
        ("gflop", "GFLOP / step"), ("flops_vs_padded", "FLOPs vs padded"),
        ("step_s", "s / step"), ("vs_padded", "time vs padded"),
        ("pack_s", "host packing s"), ("loss", "loss"),
    ]  # fmt: skip
    print(write_results("shared_prompt", rows, columns, note))
    return rows


if __name__ == "__main__":
    main()
