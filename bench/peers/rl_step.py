"""One RL step side by side: this library (public API, and its Controller), Tunix's GRPO learner
and TRL's GRPOTrainer on the same weights, one CPU core, generate and train phases split.

Each side is a fresh process pinned to one core (`taskset -c CORE`), the peers under their own
virtual environment's python (`--tunix_python`, `--trl_python`; docs/peers.md makes them); a
side whose python is not given is skipped. Rounds alternate the sides (each round starts with the
next side), so a drift in the machine's speed hits all alike; per side, the median over rounds of
each round's median step after warm-up (2 steps) and of its phases. A side that fails keeps its
error in the results and is not run again; the other rows stay.

Shapes (`bench.peers.workload`): "tiny" (rlbench-tiny: the library's seed-0 random-init
`rlbench_tiny` Llama exported to an HF folder, 8 prompts x 4 samples, prompts of 16 ids, 32 new
tokens) and "smol" (`--model`, an HF folder of SmolLM2-135M-Instruct: chat-templated arithmetic
prompts, 4 prompts x G = 8, 128 new tokens).

    python -m bench.peers.rl_step --tunix_python /tmp/peers/tunix/bin/python \
        --trl_python /tmp/peers/trl/bin/python                       # tiny, 3 rounds x 8 steps
    python -m bench.peers.rl_step --shape smol --model /tmp/smol/hf --rounds 1 --steps 4 \
        --tunix_python /tmp/peers/tunix/bin/python --trl_python /tmp/peers/trl/bin/python
    python -m bench.peers.rl_step --smoke        # the library side only, a 1-layer model
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHASES = ("step_s", "generate_s", "train_s")
LABELS = {
    "library": "this library, public API (GRPO)",
    "library_shared": "this library, public API (GRPO), shared prompts",
    "controller": "this library, its Controller (AIPO)",
    "tunix": "Tunix GRPOLearner",
    "trl": "TRL GRPOTrainer",
}


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cpus"


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def env(allocator: str = "keep") -> dict:
    """The sides' environment. allocator "keep": every side's malloc keeps freed memory (the
    library's launchers' setting, the peers through GLIBC_TUNABLES); "default": glibc's own."""
    from jaxrl.infra.xla_cpu import allocator_env, cpu_xla_flags

    out = allocator_env(dict(os.environ), allocator)
    out["XLA_FLAGS"] = cpu_xla_flags("", devices=1)
    out["JAX_PLATFORMS"] = "cpu"
    out["PYTHONPATH"] = REPO
    out["TOKENIZERS_PARALLELISM"] = "false"
    out["OMP_NUM_THREADS"] = "1"
    return out


def run_side(
    python: str, module: str, args: list[str], core: int, timeout: int, allocator: str = "keep"
) -> dict:
    """`python -m module args` pinned to `core`; its `ROW` line, or {"error": ...}."""
    cmd = ["taskset", "-c", str(core), python, "-m", module, *args]
    start = time.perf_counter()
    try:
        out = subprocess.run(
            cmd, cwd=REPO, env=env(allocator), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout}s: {' '.join(cmd)}"}
    rows = [line[4:] for line in out.stdout.splitlines() if line.startswith("ROW ")]
    if out.returncode or not rows:
        tail = [line for line in out.stderr.splitlines() if line.strip()][-12:]
        return {"error": f"exit {out.returncode}: " + " | ".join(tail)[-1500:]}
    return json.loads(rows[-1]) | {"wall_s": time.perf_counter() - start}


def side_commands(args, model: str) -> dict[str, tuple[str, str, list[str]]]:
    """(python, module, args) per side to run."""
    steps = ["--steps", str(args.steps)]
    shape = ["--shape", args.shape_name]
    for flag in ("num_prompts", "samples", "new_tokens"):
        if getattr(args, flag):
            shape += [f"--{flag}", str(getattr(args, flag))]
    sides = {
        "library": (
            sys.executable,
            "bench.peers.library_side",
            ["public", "--model", model, *shape, *steps],
        )
    }
    if args.pack_length:
        sides["library_shared"] = (
            sys.executable,
            "bench.peers.library_side",
            ["public", "--model", model, *shape, *steps, "--pack_length", str(args.pack_length)],
        )
    if args.shape_name.startswith("tiny"):
        smoke = ["--smoke"] if args.smoke else []
        controller = ["controller", "--model", model, *steps, *smoke]
        sides["controller"] = (sys.executable, "bench.peers.library_side", controller)
    if args.tunix_python and not args.smoke:
        sides["tunix"] = (
            args.tunix_python,
            "bench.peers.tunix_side",
            ["--model", model, *shape, *steps],
        )
    if args.trl_python and not args.smoke:
        sides["trl"] = (
            args.trl_python,
            "bench.peers.trl_side",
            ["rl", "--model", model, *shape, *steps],
        )
    only = [s for s in args.sides.split(",") if s] if args.sides else list(sides)
    return {k: v for k, v in sides.items() if k in only}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", "smol"])
    parser.add_argument("--model", default="", help="HF folder (smol: required; tiny: exported)")
    parser.add_argument("--tunix_python", default="")
    parser.add_argument("--trl_python", default="")
    parser.add_argument("--sides", default="", help="comma list of library,controller,tunix,trl")
    parser.add_argument("--num_prompts", type=int, default=0, help="override the shape's")
    parser.add_argument("--samples", type=int, default=0, help="override the shape's G")
    parser.add_argument("--new_tokens", type=int, default=0, help="override the shape's")
    parser.add_argument(
        "--pack_length", type=int, default=0,
        help="> 0: also the library with packed rows of this length, each group's prompt once",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--core", type=int, default=-1, help="default: the last allowed core")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per side per round")
    parser.add_argument("--smoke", action="store_true", help="library sides only, 1-layer model")
    parser.add_argument(
        "--allocator", default="keep", choices=["keep", "default"],
        help="keep: every side's malloc keeps freed memory (the launchers' setting); "
        "default: glibc's",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.smoke and args.shape != "tiny":
        raise SystemExit("--smoke runs the tiny shape only")
    args.shape_name = "tiny-smoke" if args.smoke else args.shape
    args.rounds = args.rounds or 1 if args.smoke else args.rounds or 3
    args.steps = args.steps or (3 if args.smoke else 8)
    core = args.core if args.core >= 0 else sorted(os.sched_getaffinity(0))[-1]
    command = "python -m bench.peers.rl_step" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    command = os.environ.get("JAXRL_BENCH_COMMAND") or command  # `python -m bench`
    load_before = load()
    scratch = tempfile.mkdtemp(prefix="peers_rl_step_")
    model = args.model
    if args.shape == "tiny":
        model = model or os.path.join(scratch, "tiny")
        if not os.path.exists(os.path.join(model, "config.json")):
            export = ["export", "--model", model] + (["--smoke"] if args.smoke else [])
            subprocess.run(
                [sys.executable, "-m", "bench.peers.library_side", *export],
                cwd=REPO, env=env(), check=True, capture_output=True,
            )  # fmt: skip
    elif not os.path.exists(os.path.join(model, "config.json")):
        raise SystemExit(f"--model {model!r} has no config.json; give the SmolLM2 HF folder")
    sides = side_commands(args, model)
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    errors: dict[str, str] = {}
    names = list(sides)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if name in errors:
                continue
            python, module, side_args = sides[name]
            before = os.getloadavg()[0]
            result = run_side(python, module, side_args, core, args.timeout, args.allocator)
            result["load_1min"] = [before, os.getloadavg()[0]]
            if "error" in result:
                errors[name] = result["error"]
                print(
                    f"[peers] round {r + 1}/{args.rounds} {name}: FAILED {result['error'][-400:]}",
                    flush=True,
                )
                continue
            runs[name].append(result)
            print(f"[peers] round {r + 1}/{args.rounds} {name}: {result['step_s']:.3f} s/step "
                  f"(generate {result['generate_s']:.3f}, train {result['train_s']:.3f}; "
                  f"{result['wall_s']:.0f}s wall, load {before:.1f})", flush=True)  # fmt: skip
    rows = []
    for name in names:
        label = LABELS[name]
        if name == "library_shared":
            label += f" (rows of {args.pack_length})"
        row = {"side": label, "key": name, "rounds": len(runs[name])}
        if runs[name]:
            row |= {k: statistics.median(r[k] for r in runs[name]) for k in PHASES}
            row["per_round_step_s"] = [round(r["step_s"], 4) for r in runs[name]]
            row["steps_s"] = [r.get("steps_s") for r in runs[name]]
            row["load_1min"] = [r["load_1min"] for r in runs[name]]
            if "completion_tokens" in runs[name][0]:  # the Controller side does not count them
                tokens = [r["completion_tokens"] for r in runs[name]]
                row["completion_tokens"] = statistics.median(tokens)
            if "versions" in runs[name][0]:
                row["versions"] = runs[name][0]["versions"]
        if name in errors:
            row["error"] = errors[name]
        rows.append(row)
    by_key = {row["key"]: row for row in rows if "step_s" in row}
    for row in rows:
        for peer in ("tunix", "trl"):
            if "step_s" in row and peer in by_key and row["key"] != peer:
                row[f"vs_{peer}"] = row["step_s"] / by_key[peer]["step_s"]
    for row in rows:
        print(json.dumps(row), flush=True)

    from bench.common import write_results
    from bench.peers import workload

    shape = workload.shape(
        args.shape_name,
        num_prompts=args.num_prompts,
        samples=args.samples,
        new_tokens=args.new_tokens,
    )
    note = (
        f"`{command}`; shape {shape}, {args.steps} steps x {args.rounds} rounds per "
        f"side, one core (taskset -c {core}); malloc: "
        + ("every side keeps freed memory" if args.allocator == "keep" else "glibc defaults")
        + f"; {machine()}; {load_before} before, {load()} after"
    )
    columns = [
        ("side", "side"), ("step_s", "RL step s"), ("generate_s", "generate s"),
        ("train_s", "train s"), ("vs_tunix", "vs Tunix"), ("vs_trl", "vs TRL"),
        ("completion_tokens", "completion tokens / step"), ("rounds", "rounds"), ("error", "error"),
    ]  # fmt: skip
    name = "peers_rl_step" + ("_smoke" if args.smoke else "" if args.shape == "tiny" else "_smol")
    print(write_results(name, rows, columns, note))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
