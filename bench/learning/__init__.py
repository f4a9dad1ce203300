"""Does RL learn? One workload over experiments: each runs a config against its controls
(continued SFT, shuffled rewards, a sync or fixed-lag baseline, ...) and writes the curves'
summary to bench/results/NAME.{json,md} (and NAME.png).

    python -m bench learning --list                 # the experiments
    python -m bench learning EXPERIMENT --help      # its options
    python -m bench learning EXPERIMENT --smoke     # a few steps of everything: the plumbing

An experiment is a module of this package declaring `CONFIG` (its gin config), `RUNS` (the
config's run and its controls: name -> (label, gin overrides)), `RESULTS` (its results name),
`add_options(parser)` (its own options) and `run(args)`; this module parses the options every
experiment takes (`--smoke`, `--workdir`) and its own, then runs it. The module is imported only
when asked for (some set their simulated device count before JAX starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import sys
import tempfile


@dataclasses.dataclass(frozen=True)
class Experiment:
    module: str
    measures: str


EXPERIMENTS = {
    "rl-sync": Experiment(
        "bench.learning.rl_sync",
        "sync RL on arithmetic from an SFT warm start vs continued SFT and shuffled rewards",
    ),
    "rl-async": Experiment(
        "bench.learning.rl_async",
        "async RL (lag 2, lag 4 with and without AIPO's correction) vs sync, equal steps",
    ),
    "rl-lora": Experiment(
        "bench.learning.rl_lora",
        "LoRA RL vs full fine-tuning from one SFT start: gain, steps to +15, bytes per push",
    ),
    "rl-streaming": Experiment(
        "bench.learning.rl_streaming",
        "streaming RL vs fixed lag (and no correction) on chain sums, equal steps",
    ),
    "calc": Experiment(
        "bench.learning.calc",
        "tool use learned by RL on the calculator vs tool disabled, no mask, shuffled rewards",
    ),
    "calc-smollm2": Experiment(
        "bench.learning.calc_smollm2",
        "SmolLM2 learns ChatML tool calls by RL vs tool disabled, shuffled, single-turn; async",
    ),
    "smollm2": Experiment(
        "bench.learning.smollm2",
        "RL on SmolLM2-135M-Instruct (basic_arithmetic) vs shuffled rewards, on a wall budget",
    ),
    "quantized": Experiment(
        "bench.learning.quantized",
        "SmolLM2 RL with int8 rollouts vs fp32 and vs int8 left uncorrected, equal steps",
    ),
    "moe": Experiment(
        "bench.learning.moe",
        "a mixture-of-experts policy (8 experts, top-2) by sync and async RL from one SFT start",
    ),
}


def listing() -> str:
    width = max(map(len, EXPERIMENTS))
    return "\n".join(f"  {name:<{width}}  {e.measures}" for name, e in EXPERIMENTS.items())


def parser_for(name: str):
    """The experiment's module and its argument parser (the shared options and its own)."""
    module = importlib.import_module(EXPERIMENTS[name].module)
    doc = module.__doc__ or ""
    parser = argparse.ArgumentParser(
        prog=f"python -m bench learning {name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="a few steps of everything")
    parser.add_argument("--workdir", default="", help="the runs' directory (default: a new one)")
    module.add_options(parser)
    return module, parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("--list", "-h", "--help"):
        print(__doc__.splitlines()[0] + "\n\nexperiments:\n" + listing())
        return None
    name, rest = argv[0], argv[1:]
    if name not in EXPERIMENTS:
        close = difflib.get_close_matches(name, EXPERIMENTS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise SystemExit(
            f"unknown learning experiment {name!r}{hint}; "
            "`python -m bench learning --list` lists them"
        )
    module, parser = parser_for(name)
    args = parser.parse_args(rest)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix=f"{module.RESULTS}_")
    return module.run(args)
