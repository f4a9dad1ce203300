"""One benchmark runner: `python -m bench WORKLOAD [options]` runs a workload (its options go
to its own `main(argv)`; `python -m bench WORKLOAD --help` shows them) and `python -m bench
--list` lists the workloads (bench/registry.py) with what each measures.

The command as typed is what the results record (`JAXRL_BENCH_COMMAND`, read by
`bench.common.command`). The workload's module is imported only once it is chosen: this module
imports no JAX, so a workload can still set its device count and XLA flags at import.
"""

from __future__ import annotations

import difflib
import importlib
import os
import shlex
import sys

from bench.registry import BY_NAME, WORKLOADS


def listing() -> str:
    width = max(len(w.name) for w in WORKLOADS)
    lines = [f"  {w.name:<{width}}  {w.measures}" for w in WORKLOADS]
    return "workloads (python -m bench WORKLOAD [options]; WORKLOAD --help for its options):\n" + (
        "\n".join(lines)
    )


def unknown(name: str) -> str:
    close = difflib.get_close_matches(name, BY_NAME, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"unknown workload {name!r}{hint} (`python -m bench --list` lists them)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m bench WORKLOAD [options] | --list\n\n" + listing())
        return 0 if argv else 2
    if argv[0] == "--list":
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BY_NAME:
        print(unknown(name), file=sys.stderr)
        return 2
    workload = BY_NAME[name]
    os.environ["JAXRL_BENCH_COMMAND"] = shlex.join(["python", "-m", "bench", name, *rest])
    sys.argv = [f"python -m bench {name}", *rest]  # for workloads that read flags at import
    module = importlib.import_module(workload.module)
    result = module.main(rest)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


if __name__ == "__main__":
    sys.exit(main())
