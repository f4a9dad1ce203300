"""Does RL learn? SFT warm start, then sync RL against two controls, on the arithmetic task.

1. SFT: `configs/rl/arith_tiny_sync.gin`'s warm start (lr decayed to 0), evaluated on the
   held-out set (>= 512 problems disjoint from training).
2. RL: sync mode from that checkpoint, evaluated every `eval_every_steps`.
3. Control A: continued SFT from the same checkpoint on the same demonstrations (the config's
   pool of `SFTConfig.num_demonstrations`, continuing from the SFT stage's data position) at the
   RL learning rate, for the same wall time as the RL run (a checkpoint cut off at full lr would
   "improve" under any low-lr training; ours is decayed to 0, and this control shows what plain
   extra training on the demonstrations there are buys).
4. Control B: RL with the rewards shuffled within each batch (no information in the signal).

Reports greedy and temperature-1 accuracy at the start and the mean of the last 3 evaluations,
as JSON and a markdown table (bench/results/rl_learning.*), plus a plot.

    python -m bench learning rl-sync              # the full experiment (~20 min on 2 CPU cores)
    python -m bench learning rl-sync --smoke      # seconds, checks the plumbing
"""

from __future__ import annotations

import json
import os
import time

from bench.learning import runner

CONFIG = runner.config_path("arith_tiny_sync.gin")
RESULTS = "rl_learning"
RUNS = {
    "rl": ("sync RL (AIPO)", []),
    "sft_continued": ("control: continued SFT, same wall time", None),  # not an RL run
    "rl_shuffled": (
        "control: RL, shuffled rewards",
        ["RLConfig.shuffle_rewards = True", "rl_main.sft = None"],  # + init_from the SFT stage
    ),
}
COLUMNS = [
    ("run", "run"), ("greedy_start", "greedy start"), ("greedy_end", "greedy end (last 3)"),
    ("greedy_gain_pts", "gain (pts)"), ("t1_start", "T=1 start"), ("t1_end", "T=1 end"),
    ("t1_gain_pts", "T=1 gain (pts)"), ("seconds", "wall s"),
]  # fmt: skip


def add_options(parser) -> None:
    parser.add_argument("--rl_steps", type=int, default=0, help="override RLConfig.total_steps")


def summarise(label: str, evaluations: list[dict], seconds: float) -> dict:
    """Start, end (the mean of the last 3 evaluations) and gain, greedy and T=1."""
    row = runner.curve_row(evaluations, digits=4)
    row = {k.replace("_last3", "_end"): v for k, v in row.items() if not k.endswith("_end")}
    return {"run": label, "seconds": round(seconds, 1)} | row


def config_values(overrides) -> dict:
    """The SFT demonstrations and the RL learning rate the config (with `overrides`) binds."""
    from bench.common import gin_values

    names = ("OptimizerConfig.learning_rate", "SFTConfig.num_demonstrations", "SFTConfig.steps")
    v = gin_values(CONFIG, overrides, *names, "SFTConfig.batch_size")
    return {
        "rl_learning_rate": v["OptimizerConfig.learning_rate"],
        "pool": v["SFTConfig.num_demonstrations"],
        "sft_position": v["SFTConfig.steps"] * v["SFTConfig.batch_size"],
    }


def continued_sft(
    sft_dir, out_dir, learning_rate, seconds, eval_every_steps, eval_size, pool, position
):
    """Control A: SFT from the finished SFT checkpoint at a constant `learning_rate` for
    `seconds` of wall time on the stage's demonstrations (`pool`, from data `position` on),
    evaluated like the RL run."""
    from flax import nnx

    from jaxrl.generation.placement import colocated_sampler
    from jaxrl.infra.metrics import MetricsWriter
    from jaxrl.infra.run_io import to_host
    from jaxrl.job.specs import TaskSpec, build_source
    from jaxrl.tasks.source import encode_prompts
    from jaxrl.train.evaluation import evaluate

    trainer, tokenizer, _, params = runner.restored_trainer(sft_dir, learning_rate=learning_rate)
    state = trainer.init(nnx.to_pure_dict(params))
    source = build_source(TaskSpec(), tokenizer)
    sampler = colocated_sampler(trainer, tokenizer)
    items = source.eval_items(eval_size)
    ids = encode_prompts(tokenizer, items, chat_formatted=False)
    writer = MetricsWriter(out_dir, tensorboard=False)

    def run_eval(step):
        m = evaluate(
            sampler, state.params, tokenizer, source.reward_name, items, ids,
            max_new_tokens=6, samples=4,
        )  # fmt: skip
        writer.write(step, m)

    run_eval(0)
    start, step = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        tokens, mask = source.demonstrations(position + step * 64, 64, tokenizer, 16, pool=pool)
        state, metrics = trainer.sft_step(state, {"tokens_bs": tokens, "loss_mask_bs": mask})
        step += 1
        if step % eval_every_steps == 0:
            writer.write(step, to_host(metrics))
            run_eval(step)
    run_eval(step)
    writer.close()
    return os.path.join(out_dir, "metrics.jsonl"), time.perf_counter() - start


def run(args) -> list[dict]:
    import numpy as np

    from bench.common import LEARNING_SMOKE, RESULTS_DIR, command, machine, write_results

    workdir = args.workdir
    overrides = list(LEARNING_SMOKE) if args.smoke else []
    if args.rl_steps:
        overrides.append(f"RLConfig.total_steps = {args.rl_steps}")
    eval_every = 2 if args.smoke else 250
    eval_size = 16 if args.smoke else 512

    def evals_of(run_dir):
        return runner.evals(runner.read(os.path.join(run_dir, "metrics.jsonl")))

    rl_dir = os.path.join(workdir, "rl")
    total = time.perf_counter()
    runner.run_in_process(CONFIG, rl_dir, overrides + RUNS["rl"][1])
    sft_dir = os.path.join(rl_dir, "sft")
    sft_records = runner.read(os.path.join(sft_dir, "metrics.jsonl"))
    sft_seconds = sft_records[-1]["wall_time_s"] - sft_records[0]["wall_time_s"]
    rl_evals = evals_of(rl_dir)
    rl_only = rl_evals[-1]["wall_time_s"] - rl_evals[0]["wall_time_s"]

    shuffled_dir = os.path.join(workdir, "rl_shuffled")
    warm = [f"PolicySpec.init_from = '{sft_dir}'"]
    runner.run_in_process(CONFIG, shuffled_dir, overrides + RUNS["rl_shuffled"][1] + warm)

    values = config_values(overrides)
    control_path, control_seconds = continued_sft(
        sft_dir, os.path.join(workdir, "sft_continued"), values["rl_learning_rate"], rl_only,
        eval_every, eval_size, values["pool"], values["sft_position"],
    )  # fmt: skip
    sft_evals = runner.evals(sft_records)
    rows = [
        {
            "run": "SFT warm start",
            "seconds": round(sft_seconds, 1),
            "greedy_end": sft_evals[-1]["eval/accuracy"],
            "t1_end": sft_evals[-1]["eval/accuracy_t1"],
        },
        summarise(RUNS["rl"][0], rl_evals, rl_only),
        summarise(
            RUNS["sft_continued"][0], runner.evals(runner.read(control_path)), control_seconds
        ),  # fmt: skip
        summarise(RUNS["rl_shuffled"][0], evals_of(shuffled_dir), rl_only),
    ]
    for row in rows:
        print(json.dumps(row))
    rl_row, sft_ctl, shuf = rows[1], rows[2], rows[3]
    verdict = {
        "sft_in_15_60": 0.15 <= rows[0]["greedy_end"] <= 0.60,
        "rl_greedy_gain_ge_15": rl_row["greedy_gain_pts"] >= 15,
        "rl_t1_gain_ge_25": rl_row["t1_gain_pts"] >= 25,
        "rl_beats_controls": rl_row["greedy_end"] > max(sft_ctl["greedy_end"], shuf["greedy_end"]),
        "sft_plus_rl_within_10_min": sft_seconds + rl_only <= 600,
    }
    print(json.dumps({
        "verdict": verdict,
        "sft_plus_rl_s": round(sft_seconds + rl_only, 1),
        "total_s": round(time.perf_counter() - total, 1),
    }))  # fmt: skip
    name = RESULTS + ("_smoke" if args.smoke else "")
    print(write_results(name, rows, COLUMNS, f"`{command()}` on {machine()}"))
    if not args.smoke:
        from launch.plot import write_plot

        print(f"plot: {write_plot(rl_dir, os.path.join(RESULTS_DIR, RESULTS + '.png'))}")
    print(f"runs: {workdir}")
    if np.isnan(rl_row["greedy_end"]):
        raise SystemExit("no evaluation recorded")
    return rows
