"""Trainer steps per hour on the long-tailed chain-sum task: streaming vs fixed-lag vs sync.

Workload: configs/rl/chain_tiny_streaming.gin (the 0.4M-parameter Llama with a 128-token
context; chain sums of 2..16 operands, completions of 2..50 tokens, up to 52 new tokens), 16
prompts x 8 samples per trainer step, no evaluation. Every row starts from one short SFT
checkpoint (made first, `--sft_steps`), so completions have the task's long-tailed lengths (an
untrained policy would run every row to max_new_tokens and there would be no tail), and every
row runs in a fresh `launch.rl` process:

- sync: colocated on the trainer's devices (generate all 128 rows, score, train, in turn);
- fixed_lag: async, lag 1, the generator samples whole batches (the engine drains each one);
- streaming (keep / recompute): async, the engine never drains, weights swapped in between decode
  steps (`RLConfig.kv_on_update`).

Settings: "8 devices" (`8dev`: trainer FSDP 2 x TP 2 on devices 0-3, generator 2 x TP 2 on 4-7,
as the config); `8dev_gen1` (the same with the generator on device 4 alone: XLA:CPU runs one
multi-device program at a time in a process, so `8dev`'s generator makes no progress while a
train step runs and the roles take turns, while a one-device generator runs beside the trainer;
`python -m bench.scale_validate --turns` measures it); "2 devices, 2 cores" (one device per role
in one `launch.rl` process pinned to cores 0-1 with `os.sched_setaffinity`: both roles' threads
share the two cores, since XLA:CPU cannot pin one process's threads per role); and "pinned"
(`--settings pinned`,
`bench/rl_streaming_pinned.py`), bench/rl's one-core-per-role CPU proxy, labelled a proxy: each
role its own process pinned to its own core with one CPU device (sync: one process on core 0;
fixed lag 1 and streaming keep: the trainer on core 0, the generator on core 1), the weights
sent host to host through a pipe, every scored group (streaming) or batch (fixed lag) sent back
through another as it is done. The library's own loops run in those processes (the engine with
in-flight swaps, `StreamProducer` / `BatchProducer`, `GroupQueue`'s staleness bound and drops,
the loss's `rl_step`); only the queue and the device-to-device push are pipes. (A role-split job,
`jaxrl.loop.roles`, runs fixed lag only, hence the proxy.) In the pinned rows, sync's trainer idle
is the share of each step spent generating and scoring (the same core does both), and its
generator idle the share spent training.

Per row: median seconds per trainer step after `--warmup` steps (compiles), trainer steps per
hour (3600 / median), trainer idle and generator idle fractions (sums over the measured steps /
their wall time), the engine's utilisation (kept tokens / decode slot-steps; streaming rows),
mean per-token staleness, groups dropped, time from a push to its first use. This machine is
shared; the load average is recorded with each row, and a load above the core count makes the
seconds unreliable (the table says so).

    python -m bench.rl_streaming                     # ~30 minutes on an idle 2-core CPU
    python -m bench.rl_streaming --steps 30 --warmup 5 --settings 8dev,8dev_gen1
    python -m bench.rl_streaming --settings pinned --sft_dir RUN/sft --steps 16 --warmup 4
    python -m bench.rl_streaming --smoke   # pinned rows, random weights, 3 steps (a test runs it)
    python -m bench.rl_streaming --settings pinned --sft_dir RUN/sft \
        --gin_param "RLConfig.queue_size = 2" --name rl_streaming_queue2   # a variant, apart

Rows of settings not run are kept in bench/results/rl_streaming.{json,md} (with their note).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import RESULTS_DIR, write_results
from jaxrl.infra.metrics import read_metrics
from jaxrl.infra.xla_cpu import cpu_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/rl/chain_tiny_streaming.gin"
COMMON = ["RLConfig.eval_size = 0", "RLConfig.save_every_steps = 100000", "RLConfig.lag = 1"]
MODES = {
    "sync": [
        "RLConfig.mode = 'sync'",
        "RLConfig.schedule = 'fixed_lag'",
        "rl_main.generator_mesh = None",
    ],
    "fixed_lag": ["RLConfig.schedule = 'fixed_lag'", "RLConfig.max_staleness = 1"],
    "streaming_keep": ["RLConfig.kv_on_update = 'keep'"],
    "streaming_recompute": ["RLConfig.kv_on_update = 'recompute'"],
}
SETTINGS = {
    "8dev": {"devices": 8, "cores": None, "params": []},
    "8dev_gen1": {
        "devices": 8,
        "cores": None,
        "params": [
            "generator/MeshConfig.axis_sizes = (1, 1)",
            "generator/MeshConfig.num_devices = 1",
        ],
    },
    "2dev": {
        "devices": 2,
        "cores": [0, 1],
        "params": [
            "trainer/MeshConfig.axis_sizes = (1, 1)",
            "trainer/MeshConfig.num_devices = 1",
            "generator/MeshConfig.axis_sizes = (1, 1)",
            "generator/MeshConfig.first_device = 1",
            "generator/MeshConfig.num_devices = 1",
        ],
    },
}


def _launch(workdir: str, params: list[str], devices: int, cores) -> float:
    env = dict(os.environ, XLA_FLAGS=cpu_xla_flags("", devices=devices))
    env["PYTHONPATH"] = REPO
    flags = ["--gin_file", CONFIG, "--workdir", workdir]
    for p in params:
        flags += ["--gin_param", p]
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "launch.rl", *flags],
        cwd=REPO,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    )
    return time.perf_counter() - start


def make_sft(root: str, steps: int) -> str:
    """One SFT checkpoint for every row (launch.rl's SFT stage, then one RL step)."""
    workdir = os.path.join(root, "sft_run")
    _launch(
        workdir,
        COMMON + [f"SFTConfig.steps = {steps}", "SFTConfig.eval_size = 64",
                  "RLConfig.total_steps = 1"],
        8,
        None,
    )  # fmt: skip
    return os.path.join(workdir, "sft")


def summarise(records: list[dict], warmup: int) -> dict:
    rows = [r for r in records if r["step"] > warmup]
    wall = sum(r["time/step_s"] for r in rows)

    def total(key):
        return sum(r.get(key, 0.0) for r in rows)

    def mean(key):
        values = [r[key] for r in rows if key in r]
        return statistics.mean(values) if values else float("nan")

    step_s = statistics.median(r["time/step_s"] for r in rows)
    return {
        "step_s": step_s,
        "steps_per_hour": 3600.0 / step_s,
        "trainer_idle": total("time/trainer_idle_s") / wall,
        "generator_idle": total("time/generator_idle_s") / wall
        if "time/generator_idle_s" in rows[0]
        else float("nan"),
        "train_s": statistics.median(r["time/train_s"] for r in rows),
        "engine_util": mean("stream/engine_utilisation"),
        "token_staleness": mean("stream/token_staleness_mean"),
        "mixed_rows": mean("stream/mixed_version_rows"),
        "push_to_use_s": mean("stream/push_to_use_s"),
        "dropped_groups": rows[-1].get("stream/dropped_groups", 0.0),
        "completion_tokens": mean("completion/mean_tokens"),
        "measured_steps": len(rows),
    }


def _earlier_rows(settings: list[str]) -> tuple[list[dict], str]:
    """The results file's rows of the settings not run now (kept), and their note."""
    path = os.path.join(RESULTS_DIR, "rl_streaming.json")
    if not os.path.exists(path):
        return [], ""
    with open(path) as f:
        earlier = json.load(f)
    kept = [r for r in earlier["rows"] if r.get("setting") not in settings]
    return kept, f" | earlier rows: {earlier['note']}; {earlier['date']}" if kept else ""


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sft_steps", type=int, default=300)
    parser.add_argument("--settings", default="8dev,8dev_gen1,pinned")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workdir", default="")
    parser.add_argument("--sft_dir", default="", help="an existing SFT run dir to start from")
    parser.add_argument("--modes_2dev", default="sync,fixed_lag,streaming_keep")
    parser.add_argument(
        "--gin_param", action="append", default=[], help="a binding added to every row"
    )
    parser.add_argument(
        "--name", default="", help="results name; given, the rows are not merged with earlier ones"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the pinned setting only, random weights, 4 prompts x 4 samples, 8 new tokens, "
        "3 steps (checks the plumbing; writes rl_streaming_smoke)",
    )
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    if args.smoke:
        settings, args.steps, args.warmup = ["pinned"], 3, 1
    root = args.workdir or tempfile.mkdtemp(prefix="rl_streaming_")
    sft = args.sft_dir or ("" if args.smoke else make_sft(root, args.sft_steps))
    rows = []
    for setting in settings:
        if setting == "pinned":
            from bench.rl_streaming_pinned import pinned_rows

            cores = sorted(os.sched_getaffinity(0))
            modes = args.modes_2dev.split(",")
            for row in pinned_rows(
                CONFIG, sft, args.steps, args.warmup, args.smoke, modes, cores, args.gin_param
            ):
                print(json.dumps(row), flush=True)
                rows.append(row)
            continue
        s = SETTINGS[setting]
        for mode in (args.modes_2dev if setting == "2dev" else args.modes).split(","):
            workdir = os.path.join(root, f"{setting}_{mode}")
            params = COMMON + s["params"] + MODES[mode] + [
                "rl_main.sft = None", f"PolicySpec.init_from = '{sft}'",
                f"RLConfig.total_steps = {args.steps}",
            ] + args.gin_param  # fmt: skip
            load = os.getloadavg()[0]
            seconds = _launch(workdir, params, s["devices"], s["cores"])
            records = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))
                       if r["step"] > 0]  # fmt: skip
            row = {"setting": setting, "mode": mode, **summarise(records, args.warmup)}
            row |= {"wall_s": seconds, "load_before": load, "load_after": os.getloadavg()[0]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    cores = os.cpu_count()
    loaded = any(r["load_before"] > cores or r["load_after"] > cores for r in rows)
    note = (
        ("python -m bench.rl_streaming --smoke" if args.smoke else
         f"python -m bench.rl_streaming --steps {args.steps} --warmup {args.warmup} "
         f"--sft_steps {args.sft_steps} --settings {','.join(settings)}"
         + (f" --sft_dir {args.sft_dir}" if args.sft_dir else "")
         + "".join(f" --gin_param {p!r}" for p in args.gin_param))
        + f"; {cores} cores"
        + ("; LOADED MACHINE (load average above the core count): seconds unreliable"
           if loaded else "")
    )  # fmt: skip
    if not args.smoke and not args.name:
        earlier, earlier_note = _earlier_rows(settings)
        rows, note = earlier + rows, note + earlier_note
    columns = [
        ("setting", "setting"), ("mode", "mode"), ("step_s", "s/step"),
        ("steps_per_hour", "steps/h"), ("trainer_idle", "trainer idle"),
        ("generator_idle", "generator idle"), ("engine_util", "engine util"),
        ("token_staleness", "token staleness"), ("mixed_rows", "mixed-version rows"),
        ("push_to_use_s", "push->use s"), ("dropped_groups", "dropped groups"),
        ("completion_tokens", "mean completion"), ("load_before", "load"),
        ("token_staleness_max", "max token staleness"), ("train_s", "train s"),
        ("load_after", "load after"),
    ]  # fmt: skip
    name = args.name or ("rl_streaming_smoke" if args.smoke else "rl_streaming")
    print(write_results(name, rows, columns, note))
    if not args.workdir:  # the runs' scratch directory made above
        shutil.rmtree(root, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
