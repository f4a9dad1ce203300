"""Seconds per trainer step: role-split async on two pinned processes vs sync on one pinned core.

Side by side, the same workload (configs/rl/arith_tiny_roles.gin: the 0.4M-parameter arithmetic
Llama, 16 prompts x 8 samples trained per step, dynamic sampling over `--oversample` x as many
prompts (default 2), up to 6 new tokens; random initial weights, no SFT stage, no evaluation),
one CPU device per process. At oversample 2 generating a batch costs a little less than a train
step, so the trainer is the slower role and should never wait; at arith_tiny's 8 the generator
is the slower one (about 2.5 train steps a batch) and the trainer waits for it by design (its
idle time, and its weight push, which waits for the generator to free a buffer, grow with it).

- sync: one process pinned to core 0 (`taskset -c 0`): generate, score, train, in turn, on its
  one device (`RLConfig.mode = "sync"`).
- roles: `launch.local_cluster` with 2 processes of one device each, process i pinned to core i
  (`taskset -c $JAXRL_PROCESS_ID`): process 0 the trainer, process 1 the generator, fixed lag 2
  (`rl_main.roles`, jaxrl/loop/roles.py).

Per row: the median seconds per trainer step over the steps after `--warmup` (compiles), the
phases (generate + reward on the generator, train, weight push), the trainer's idle fraction
(waiting for rollouts, sum over the measured steps / their wall time), the fraction of the step
the trainer spent outside its train step (idle + push + logging), and the speed-up over sync
next to the bound (Tg + Tt) / max(Tg, Tt) from sync's own phase times. The machine is
shared: the load average before and after each run is recorded, and a loaded machine (load
above the core count) makes the figures unreliable; the table says so. `--repeats N` runs N
sync / roles pairs in turn (the load drifts alike for both) and judges the median speed-up.

    python -m bench.rl_roles                 # 40 steps each, ~3 minutes on an idle 2-core CPU
    python -m bench.rl_roles --steps 30 --repeats 3    # 3 pairs in turn; the median speed-up
    python -m bench.rl_roles --steps 12 --warmup 4
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import write_results
from jaxrl.infra.metrics import read_metrics
from jaxrl.infra.xla_cpu import cpu_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/rl/arith_tiny_roles.gin"
ONE_DEVICE = [
    "rl_main.sft = None",
    "RLConfig.eval_size = 0",
    "trainer/MeshConfig.axis_sizes = (1, 1)",
    "trainer/MeshConfig.num_devices = 1",
    "generator/MeshConfig.axis_sizes = (1, 1)",
    "generator/MeshConfig.first_device = 1",
    "generator/MeshConfig.num_devices = 1",
]
SYNC = ["RLConfig.mode = 'sync'", "rl_main.generator_mesh = None", "rl_main.roles = None"]


def _rl(workdir: str, params: list[str]) -> list[str]:
    command = [sys.executable, "-m", "launch.rl", f"--gin_file={CONFIG}", f"--workdir={workdir}"]
    return command + [f"--gin_param={p}" for p in params]


def _load() -> float:
    return os.getloadavg()[0]


def _launch(command: list[str], env: dict, log: str) -> tuple[float, float, float]:
    """Runs `command`; returns (wall seconds, load average before, after)."""
    before, start = _load(), time.perf_counter()
    with open(log, "a") as out:
        code = subprocess.call(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"{command[:6]} failed ({code}); see {log}")
    return time.perf_counter() - start, before, _load()


def _summary(name: str, workdir: str, warmup: int, wall: float, loads) -> dict:
    records = {r["step"]: r for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))}
    measured = [records[s] for s in sorted(records) if s > warmup]

    def median(key: str) -> float:
        values = [r[key] for r in measured if key in r]
        return statistics.median(values) if values else 0.0

    step_s = [r["time/step_s"] for r in measured]
    idle = sum(r.get("time/trainer_idle_s", 0.0) for r in measured)
    return {
        "run": name,
        "steps_measured": len(measured),
        "s_per_step": statistics.median(step_s),
        "generate_s": median("time/generate_s") + median("time/reward_s"),
        "train_s": median("time/train_s"),
        "sync_s": median("time/sync_s"),
        "trainer_idle": idle / sum(step_s),
        "not_training": 1 - sum(r["time/train_s"] for r in measured) / sum(step_s),
        "staleness": measured[-1].get("async/staleness_mean", 0.0),
        "load_before": round(loads[0], 2),
        "load_after": round(loads[1], 2),
        "wall_s": round(wall, 1),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--oversample", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="sync / roles pairs, in turn")
    parser.add_argument("--workdir", default="")
    parser.add_argument("--no_results", action="store_true", help="do not write bench/results")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="rl_roles_")
    os.makedirs(workdir, exist_ok=True)
    log = os.path.join(workdir, "log.txt")
    steps = [f"RLConfig.total_steps = {args.steps}", f"RLConfig.save_every_steps = {args.steps}"]
    steps.append(f"RLConfig.oversample = {args.oversample}")
    env = dict(os.environ, JAXRL_FAULT="", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH", "")]))

    rows, pairs = [], []
    for repeat in range(args.repeats):  # sync, roles, sync, roles, ...: the load drifts alike
        sync_dir = os.path.join(workdir, f"sync{repeat}")
        sync_env = env | {"XLA_FLAGS": cpu_xla_flags("", devices=1)}
        wall, *loads = _launch(
            ["taskset", "-c", "0", *_rl(sync_dir, steps + ONE_DEVICE + SYNC)], sync_env, log
        )
        sync = _summary("sync, 1 process on 1 core", sync_dir, args.warmup, wall, loads)
        print(json.dumps(sync), flush=True)

        roles_dir = os.path.join(workdir, f"roles{repeat}")
        roles_env = dict(env)
        roles_env.pop("XLA_FLAGS", None)  # local_cluster sets each process's device count
        pinned = shlex.join(_rl(roles_dir, steps + ONE_DEVICE))
        cluster = [sys.executable, "-m", "launch.local_cluster", "--num_processes", "2"]
        cluster += ["--devices_per_process", "1", "--"]
        command = cluster + ["sh", "-c", f'exec taskset -c "$JAXRL_PROCESS_ID" {pinned}']
        wall, *loads = _launch(command, roles_env, log)
        roles = _summary("roles, 2 processes on 1 core each", roles_dir, args.warmup, wall, loads)
        print(json.dumps(roles), flush=True)
        tg, tt = sync["generate_s"], sync["train_s"]
        sync["bound"] = (tg + tt) / max(tg, tt)
        roles["speedup"] = sync["s_per_step"] / roles["s_per_step"]
        sync["pair"] = roles["pair"] = repeat
        rows += [sync, roles]
        pairs.append((sync, roles))

    cores = os.cpu_count() or 1
    loaded = max(max(r["load_before"], r["load_after"]) for r in rows) > cores
    speedup = statistics.median(roles["speedup"] for _, roles in pairs)
    idle = statistics.median(roles["trainer_idle"] for _, roles in pairs)
    verdict = {
        "speedup_median": round(speedup, 3),
        "speedups": [round(roles["speedup"], 3) for _, roles in pairs],
        "bound_median": round(statistics.median(sync["bound"] for sync, _ in pairs), 3),
        "trainer_idle_median": round(idle, 4),
        "speedup_ge_1.3": speedup >= 1.3,
        "idle_le_10pct": idle <= 0.10,
        "machine_loaded": loaded,
    }
    print(json.dumps({"verdict": verdict}), flush=True)
    if not args.no_results:
        columns = [
            ("pair", "pair"), ("run", "run"), ("s_per_step", "s/step"),
            ("speedup", "speed-up"), ("bound", "bound"),
            ("generate_s", "generate+reward s"), ("train_s", "train s"),
            ("sync_s", "push s"), ("trainer_idle", "trainer idle"),
            ("not_training", "trainer not training"),
            ("staleness", "staleness"), ("load_before", "load before"),
            ("load_after", "load after"),
        ]  # fmt: skip
        note = (
            f"`python -m bench.rl_roles --steps {args.steps} --warmup {args.warmup} "
            f"--oversample {args.oversample} --repeats {args.repeats}`, "
            f"{cores} cpus; verdict {verdict}"
            + ("; LOADED machine: not a clean measurement" if loaded else "")
        )
        name = "rl_roles" if args.oversample == 2 else f"rl_roles_oversample{args.oversample}"
        print(write_results(name, rows, columns, note))
    print(f"runs: {workdir} (log: {log})")
    return {"rows": rows, "verdict": verdict}


if __name__ == "__main__":
    main(sys.argv[1:])
