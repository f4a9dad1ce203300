"""Smoke of multi-turn tool use on a real chat template: a few sync RL steps of
configs/rl/calc_smollm2.gin (the calculator in ChatML tool-call form on SmolLM2-135M-Instruct),
with every environment step recorded, then a summary: seconds per step, reward, turns, episode
status fractions, the tool-call rate and one decoded episode.

    python -m bench.calc_smollm2_smoke --init_from ~/.cache/jaxrl/smollm2-135m-instruct

writes bench/results/calc_smollm2_tool_use.{json,md}. The run is `python -m launch.rl` on the config
with `TaskSpec.name = "bench.calc_smollm2_smoke:recorded_task"`: the "calculator_chat" task
whose environments also append each step (turn and reply, decoded with their special tokens) to
WORKDIR/episodes.jsonl; the run itself is in WORKDIR/run, its log WORKDIR/run.log. A turn that
ran out of tokens reaches no environment, so it is not in the record (its episode's status
"truncated" is in the run's metrics).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/rl/calc_smollm2.gin"
RECORD_ENV = "JAXRL_CALC_SMOKE_RECORD"  # the jsonl the environments append to
EXAMPLES_ENV = "JAXRL_CALC_SMOKE_EXAMPLES"  # worked exchanges before each question: "12*34,..."


class RecordingEnv:
    """`env`, with each step appended to the record file as one JSON line."""

    def __init__(self, env, tokenizer, path: str):
        self.env, self.tokenizer, self.path = env, tokenizer, path

    def reset(self, item):
        self.prompt = list(self.env.reset(item))
        self.key = uuid.uuid4().hex
        self.turn = 0
        return self.prompt

    def step(self, turn_ids):
        step = self.env.step(turn_ids)
        self.turn += 1
        line = {
            "episode": self.key,
            "turn": self.turn,
            "prompt": self.tokenizer.decode(self.prompt) if self.turn == 1 else None,
            "model": self.tokenizer.decode(list(turn_ids)),
            "observation": self.tokenizer.decode(list(step.observation)),
            "status": step.status,
            "done": step.done,
            "reward": step.reward,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return step


def recorded_task(spec, tokenizer):
    """The "calculator_chat" task, its environments recorded (module docstring)."""
    from jaxrl.tasks.source import get_task

    source = get_task("calculator_chat")(spec, tokenizer)
    source.examples = tuple(
        tuple(map(int, pair.split("*"))) for pair in os.environ[EXAMPLES_ENV].split(",") if pair
    )
    make_env, path = source.make_env, os.environ[RECORD_ENV]
    source.make_env = lambda **kw: RecordingEnv(make_env(**kw), tokenizer, path)
    return source


def summarise(workdir: str, run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    keys = ("time/step_s", "reward/mean", "episode/turns_mean", "episode/bad_step_fraction")
    keys += tuple(f"episode/{s}_fraction" for s in ("done", "truncated", "tool_error", "timeout"))
    steps = [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in rows if keys[1] in r]
    with open(os.path.join(workdir, "episodes.jsonl")) as f:
        record = [json.loads(line) for line in f if line.strip()]
    calls = [r for r in record if not r["done"]]  # every step that did not end its episode
    by_episode: dict[str, list[dict]] = {}
    for r in record:
        by_episode.setdefault(r["episode"], []).append(r)
    episodes = list(by_episode.values())
    with_call = [e for e in episodes if any(not r["done"] for r in e)]
    example = max(
        episodes, key=lambda e: (any(r["status"] == "ok" and not r["done"] for r in e), len(e))
    )
    evals = [{k: v for k, v in r.items() if k == "step" or k.startswith("eval/")} for r in rows]
    return {
        "steps": steps,
        "evaluations": [e for e in evals if len(e) > 1],
        "episodes_recorded": len(episodes),
        "environment_steps": len(record),
        "well_formed_calls": sum(r["status"] == "ok" for r in calls),
        "malformed_calls": sum(r["status"] == "malformed" for r in calls),
        "final_answers": sum(r["done"] for r in record),
        "correct_final_answers": sum(r["done"] and r["reward"] > 0 for r in record),
        "episode_tool_call_rate": len(with_call) / max(len(episodes), 1),
        "example": example,
    }


def write_markdown(path: str, result: dict) -> None:
    s = result["summary"]
    lines = [
        f"<!-- {result['command']} -->",
        f"<!-- started {result['date']}; machine load (1-min average) then {result['load']} -->",
        "# Multi-turn tool use on SmolLM2-135M-Instruct (smoke)",
        "",
        f"`{result['command']}` ({result['wall_s']:.0f} s wall, CPU).",
        "",
        "| step | s/step | reward | turns | done | truncated | tool_error | timeout | bad steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["steps"]:
        cells = [r.get(k, float("nan")) for k in (
            "time/step_s", "reward/mean", "episode/turns_mean", "episode/done_fraction",
            "episode/truncated_fraction", "episode/tool_error_fraction",
            "episode/timeout_fraction", "episode/bad_step_fraction",
        )]  # fmt: skip
        lines.append(f"| {r['step']} | " + " | ".join(f"{c:.3g}" for c in cells) + " |")
    for e in s.get("evaluations", []):
        lines.append(
            f"\nGreedy evaluation at step {e['step']} (held-out problems, RLConfig.eval_size): "
            + ", ".join(f"{k[5:]} {v:.3g}" for k, v in e.items() if k != "step")
        )
    lines += [
        "",
        "The record holds the evaluations' episodes and the training episodes. "
        f"Recorded: {s['environment_steps']} environment steps of {s['episodes_recorded']} "
        f"episodes (turns that ran out of tokens reach no environment): "
        f"{s['well_formed_calls']} well-formed tool calls, {s['malformed_calls']} malformed, "
        f"{s['final_answers']} final answers ({s['correct_final_answers']} correct); "
        f"episodes with a call attempt: {s['episode_tool_call_rate']:.1%}.",
        "",
        "One episode, decoded with its special tokens (model turns sampled, replies appended by "
        "the environment):",
        "",
        "```",
        s["example"][0]["prompt"],
    ]
    for r in s["example"]:
        lines += [f"[model, turn {r['turn']}]", r["model"]]
        if r["observation"]:
            lines += [f"[environment: {r['status']}]", r["observation"]]
        else:
            lines.append(f"[environment: done, reward {r['reward']}]")
    lines.append("```")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init_from", required=True, help="a save_pretrained dir of the model")
    p.add_argument("--workdir", default="/tmp/calc_smollm2_smoke")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=os.path.join(REPO, "bench/results/calc_smollm2_tool_use"))
    p.add_argument("--examples", default="", help="few-shot exchanges, e.g. 12*34,56*78")
    p.add_argument("--gin_param", action="append", default=[], help="more bindings (repeatable)")
    args = p.parse_args(argv)
    if os.path.exists(args.workdir):
        raise SystemExit(f"{args.workdir} exists; remove it or pass another --workdir")
    os.makedirs(args.workdir)
    params = [
        f"PolicySpec.init_from = '{os.path.abspath(os.path.expanduser(args.init_from))}'",
        "TaskSpec.name = 'bench.calc_smollm2_smoke:recorded_task'",
        f"RLConfig.total_steps = {args.steps}",
        *args.gin_param,
    ]
    run_dir = os.path.join(args.workdir, "run")  # launch.rl's workdir; the log and record beside
    command = [sys.executable, "-m", "launch.rl", "--gin_file", CONFIG, "--workdir", run_dir]
    for param in params:
        command += ["--gin_param", param]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env[RECORD_ENV] = os.path.join(args.workdir, "episodes.jsonl")
    env[EXAMPLES_ENV] = args.examples
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    load, start = os.getloadavg()[0], time.perf_counter()
    with open(os.path.join(args.workdir, "run.log"), "w") as log:
        code = subprocess.call(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"launch.rl failed (exit {code}); see {args.workdir}/run.log")
    result = {
        "command": os.environ.get("JAXRL_BENCH_COMMAND")  # set by `python -m bench`
        or shlex.join(["python", "-m", "bench.calc_smollm2_smoke", *sys.argv[1:]]),
        "date": date,  # the start
        "load": round(load, 2),
        "wall_s": time.perf_counter() - start,
        "summary": summarise(args.workdir, run_dir),
    }
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(args.out + ".md", result)
    print(open(args.out + ".md").read())


if __name__ == "__main__":
    main()
