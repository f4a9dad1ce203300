"""Generation alone, side by side: the library's continuous-batching `Engine` against
`transformers` `generate` (one left-padded batch) and, where the installed transformers has it,
`generate_batch` (its continuous batching), on the same HF folder and prompts, one CPU core.

64 chat-templated arithmetic prompts (`bench.peers.workload.smol_messages`), one sample each,
up to 128 new tokens at temperature 1 (no top-k / top-p), EOS respected; a completion's tokens
are counted through its first EOS. Each side is a fresh process pinned to one core, the
transformers sides under `--trl_python` (the TRL virtual environment: torch CPU and the
library's pinned transformers); a warm-up round, then `--rounds` timed rounds; sides alternate
per repeat (`--repeats`), and the table gives the median over repeats of tokens/s.

    python -m bench.peers.gen --model /tmp/smol/hf --trl_python /tmp/peers/trl/bin/python
    python -m bench.peers.gen --smoke        # the engine only, the tiny 1-layer model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench.peers.rl_step import REPO, env, load, machine, run_side

LABELS = {
    "engine": "this library, Engine (continuous batching)",
    "generate": "transformers generate (static batch)",
    "generate_batch": "transformers generate_batch (continuous batching)",
}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/smol/hf")
    parser.add_argument("--trl_python", default="")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds per process")
    parser.add_argument("--repeats", type=int, default=1, help="processes per side")
    parser.add_argument("--slots", type=int, default=64, help="the engine's decode slots")
    parser.add_argument("--sides", default="", help="comma list of engine,generate,generate_batch")
    parser.add_argument("--core", type=int, default=-1)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--smoke", action="store_true", help="the engine only, tiny model")
    args = parser.parse_args(argv)
    core = args.core if args.core >= 0 else sorted(os.sched_getaffinity(0))[-1]
    command = "python -m bench.peers.gen" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    command = os.environ.get("JAXRL_BENCH_COMMAND") or command  # `python -m bench`
    load_before = load()
    model = args.model
    if args.smoke:
        model = os.path.join(tempfile.mkdtemp(prefix="peers_gen_"), "tiny")
        export = ["bench.peers.library_side", "export", "--model", model, "--smoke"]
        subprocess.run(
            [sys.executable, "-m", *export], cwd=REPO, env=env(), check=True, capture_output=True
        )
        args.prompts, args.new_tokens, args.slots = 4, 4, 8
    elif not os.path.exists(os.path.join(model, "config.json")):
        raise SystemExit(f"--model {model!r} has no config.json; give an HF folder")
    common = ["--model", model, "--prompts", str(args.prompts)]
    common += ["--new_tokens", str(args.new_tokens), "--rounds", str(args.rounds)]
    sides = {
        "engine": (
            sys.executable, "bench.peers.library_side",
            ["generate", *common, "--slots", str(args.slots)],
        ),
    }  # fmt: skip
    if args.trl_python and not args.smoke:
        for way in ("generate", "generate_batch"):
            sides[way] = (args.trl_python, "bench.peers.trl_side", [way, *common])
    only = [s for s in args.sides.split(",") if s] if args.sides else list(sides)
    sides = {k: v for k, v in sides.items() if k in only}
    names = list(sides)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name in errors:
                continue
            before = os.getloadavg()[0]
            result = run_side(*sides[name], core, args.timeout)
            if "error" in result:
                errors[name] = result["error"]
                print(f"[peers.gen] {name}: FAILED {result['error'][-400:]}", flush=True)
                continue
            result["load_1min"] = [before, os.getloadavg()[0]]
            runs[name].append(result)
            print(f"[peers.gen] repeat {r + 1}/{args.repeats} {name}: "
                  f"{result['tokens_per_s']:.1f} tokens/s ({result['tokens']:.0f} tokens in "
                  f"{result['seconds']:.1f}s; load {before:.1f})", flush=True)  # fmt: skip
    rows = []
    for name in names:
        row = {"side": LABELS[name], "key": name, "repeats": len(runs[name])}
        if runs[name]:
            for key in ("tokens_per_s", "seconds", "tokens", "prompt_tokens_mean"):
                row[key] = statistics.median(x[key] for x in runs[name])
            row["load_1min"] = [x["load_1min"] for x in runs[name]]
            if "versions" in runs[name][0]:
                row["versions"] = runs[name][0]["versions"]
        if name in errors:
            row["error"] = errors[name]
        rows.append(row)
    engine = next((row for row in rows if row["key"] == "engine" and "tokens_per_s" in row), None)
    for row in rows:
        if engine is not None and "tokens_per_s" in row:
            row["engine_speedup"] = engine["tokens_per_s"] / row["tokens_per_s"]
    for row in rows:
        print(json.dumps(row), flush=True)

    from bench.common import write_results

    note = (
        f"`{command}`; {args.prompts} prompts x 1 sample, {args.new_tokens} new tokens, "
        f"{args.rounds} timed round(s) after a warm-up per process, {args.repeats} process(es) "
        f"per side, one core (taskset -c {core}); {machine()}; {load_before} before, {load()} "
        "after"
    )
    columns = [
        ("side", "side"), ("tokens_per_s", "tokens/s"), ("seconds", "s / round"),
        ("tokens", "completion tokens / round"), ("engine_speedup", "engine speed-up"),
        ("prompt_tokens_mean", "prompt tokens"), ("error", "error"),
    ]  # fmt: skip
    print(write_results("peers_gen" + ("_smoke" if args.smoke else ""), rows, columns, note))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
