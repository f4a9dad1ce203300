"""The async arithmetic run as one job of two processes vs one process, at equal trainer steps.

Both runs start from the same SFT warm start (`--sft`: a run directory, e.g. the `sync/sft` of
`python -m bench learning rl-async`; trained here first when not given) and run
`configs/rl/arith_tiny.gin` (one process, 8 devices) and `configs/rl/arith_tiny_2proc.gin` (two
processes x 4 devices under `launch.local_cluster`, every mesh spanning both) for `--steps`
trainer steps. The two-process job is killed (process 1, by the fault hook, after step
`--kill_at`) and started again: it resumes from its last checkpoint and finishes. Reports held-out
accuracy (greedy and T=1, 512 problems) at the end of each run, seconds per step and the
difference, and writes bench/results/rl_multiprocess.{json,md}.

    python -m bench.rl_multiprocess --sft /tmp/asyncE/sync/sft       # 500 steps each
    python -m bench.rl_multiprocess --steps 20 --kill_at 10          # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import RESULTS_DIR, write_results
from jaxrl.infra.metrics import read_metrics
from jaxrl.infra.xla_cpu import cpu_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(command: list[str], env: dict, log: str) -> tuple[int, float]:
    start = time.perf_counter()
    with open(log, "a") as out:
        code = subprocess.call(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return code, time.perf_counter() - start


def _rl(config: str, workdir: str, params: list[str]) -> list[str]:
    flags = [f"--gin_file=configs/rl/{config}", f"--workdir={workdir}"]
    return [sys.executable, "-m", "launch.rl", *flags, *(f"--gin_param={p}" for p in params)]


def _summary(name: str, workdir: str, seconds: float, launches: int) -> dict:
    records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    last = {r["step"]: r for r in records}
    evals = [last[s] for s in sorted(last) if "eval/accuracy" in last[s]]
    return {
        "run": name,
        "steps": max(last),
        "launches": launches,
        "greedy_start": evals[0]["eval/accuracy"],
        "greedy_end": evals[-1]["eval/accuracy"],
        "t1_end": evals[-1]["eval/accuracy_t1"],
        "staleness_mean": last[max(last)].get("async/staleness_mean", 0.0),
        "s_per_step": statistics.median(last[s]["time/step_s"] for s in last if s > 1),
        "seconds": round(seconds, 1),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", default="", help="SFT run directory to start from")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--kill_at", type=int, default=0, help="default: steps * 3 // 5")
    parser.add_argument("--workdir", default="")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="rl_multiprocess_")
    os.makedirs(workdir, exist_ok=True)
    log = os.path.join(workdir, "log.txt")
    kill_at = args.kill_at or args.steps * 3 // 5
    every = max(args.steps // 4, 1)
    params = [
        f"RLConfig.total_steps = {args.steps}",
        f"RLConfig.eval_every_steps = {every}",
        f"RLConfig.save_every_steps = {every}",
    ]
    env = dict(os.environ, JAXRL_FAULT="")
    single_env = env | {
        "XLA_FLAGS": cpu_xla_flags("", devices=8),
        "JAX_PLATFORMS": "cpu",
    }
    env.pop("XLA_FLAGS", None)  # local_cluster sets each process's device count
    sft = args.sft
    if not sft:  # the SFT stage of the one-process run, then both start from it
        sft = os.path.join(workdir, "one_process", "sft")
        params_single = params
    else:
        params_single = params + ["rl_main.sft = None", f"PolicySpec.init_from = '{sft}'"]
    params_two = params + ["rl_main.sft = None", f"PolicySpec.init_from = '{sft}'"]

    one_dir = os.path.join(workdir, "one_process")
    code, one_s = _launch(_rl("arith_tiny.gin", one_dir, params_single), single_env, log)
    if code:
        raise SystemExit(f"the one-process run failed ({code}); see {log}")
    rows = [_summary("one process, 8 devices", one_dir, one_s, 1)]
    print(json.dumps(rows[-1]), flush=True)

    two_dir = os.path.join(workdir, "two_processes")
    cluster = [sys.executable, "-m", "launch.local_cluster", "--num_processes", "2"]
    cluster += ["--devices_per_process", "4", "--heartbeat_timeout_s", "5", "--"]
    command = cluster + _rl("arith_tiny_2proc.gin", two_dir, params_two)
    killed, killed_s = _launch(command, env | {"JAXRL_FAULT": f"kill_at_step={kill_at}@1"}, log)
    checkpoints = sorted(int(s) for s in os.listdir(os.path.join(two_dir, "checkpoints")))
    code, two_s = _launch(command, env, log)
    if killed == 0 or code:
        raise SystemExit(f"expected a killed launch then a finished one, got {killed}, {code}")
    rows.append(_summary("two processes x 4 devices", two_dir, killed_s + two_s, 2))
    print(json.dumps(rows[-1]), flush=True)
    verdict = {
        "within_5_points_greedy": abs(rows[1]["greedy_end"] - rows[0]["greedy_end"]) <= 0.05,
        "killed_exit_status": killed,
        "checkpoints_after_kill": checkpoints,
        "resumed_and_finished": code == 0 and rows[1]["steps"] == args.steps,
    }
    print(json.dumps({"verdict": verdict}))
    columns = [
        ("run", "run"), ("steps", "steps"), ("launches", "launches"),
        ("greedy_start", "greedy start"), ("greedy_end", "greedy end"), ("t1_end", "T=1 end"),
        ("staleness_mean", "mean staleness"), ("s_per_step", "s/step"), ("seconds", "wall s"),
    ]  # fmt: skip
    command_line = "python -m bench.rl_multiprocess" + "".join(f" {a}" for a in (argv or []))
    command_line = os.environ.get("JAXRL_BENCH_COMMAND") or command_line  # `python -m bench`
    print(write_results("rl_multiprocess", rows, columns, f"`{command_line}`; verdict {verdict}"))
    print(f"runs: {workdir} (log: {log})")
    return {"rows": rows, "verdict": verdict, "results_dir": RESULTS_DIR}


if __name__ == "__main__":
    main(sys.argv[1:])
