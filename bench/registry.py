"""Every benchmark workload, in one place: its name (`python -m bench NAME`), the module whose
`main(argv)` runs it, what it measures and the results it writes under bench/results/ (NAME.json
and NAME.md through `bench.common.write_results`, unless said otherwise; `*` stands for a
variant: `_smoke` for `--smoke`, or a name the options choose).

Imports nothing heavy: a workload's module is imported only when it runs (some set their
simulated device count or XLA flags at import, before JAX starts). Helper modules are not
workloads: bench/common.py, bench/cpu_devices.py (shared), bench/engine_host.py and
bench/scale.py (the speed-up model's pieces), bench/pipes.py and bench/rl_streaming_pinned.py
(settings of `rl` and `rl-streaming`), bench/gen_long_tail.py (`gen --long_tail`),
bench/peers/workload.py and bench/peers/*_side.py (the sides `peers-*` run, each in its own
venv), bench/learning/runner.py and the experiments of `learning`.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    module: str
    measures: str
    results: tuple[str, ...] = ()


WORKLOADS = (
    Workload(
        "gen", "bench.gen",
        "generation tokens/s: static sampler vs continuous-batching engine (--long_tail: "
        "the long-tail workload)",
        ("gen*", "gen_long_tail*"),
    ),
    Workload(
        "gguf-parity", "bench.gguf_parity",
        "GGUF import on a real model against transformers' loader: completions, tokenizer, logits",
        ("gguf_parity",),
    ),
    Workload(
        "load-memory", "bench.load_memory",
        "peak host memory of loading a HF checkpoint into a (fsdp=4, tp=2) sharding",
        ("one JSON line on stdout",),
    ),
    Workload(
        "cpu-hlo-hash", "bench.cpu_hlo_hash",
        "SHA-256 of the optimized CPU programs (engine, train step): a change that keeps CPU speed",
        ("hashes on stdout",),
    ),
    Workload(
        "quantized-gen", "bench.quantized_gen",
        "8-bit generator weights: decode tokens/s and the int8 matmul on this CPU",
        ("quantized_gen*", "quantized_matmul"),
    ),
    Workload(
        "multiturn", "bench.multiturn",
        "multi-turn tool-use episodes vs single-turn generation: sampled tokens/s",
        ("multiturn*",),
    ),
    Workload(
        "calc-smollm2-smoke", "bench.calc_smollm2_smoke",
        "a few sync RL steps of multi-turn tool use on SmolLM2's chat template, recorded",
        ("calc_smollm2_tool_use* (--out PATH: PATH.json, PATH.md)",),
    ),
    Workload(
        "task-probe", "bench.task_probe",
        "greedy start accuracy of a chat model (SmolLM2) on candidate reasoning-gym tasks",
        ("task_probe_smollm2", "task_probe_smoke (--smoke)"),
    ),
    Workload(
        "packing", "bench.packing",
        "the RL train step on padded vs packed batches, one CPU device",
        ("packing*",),
    ),
    Workload(
        "shared-prompt", "bench.shared_prompt",
        "the RL train step with each group's prompt repeated per sample vs shared once",
        ("shared_prompt",),
    ),
    Workload(
        "rl", "bench.rl",
        "seconds per RL step, sync (colocated) vs async (LlamaRL), with the phase breakdown",
        ("rl*",),
    ),
    Workload(
        "rl-step", "bench.rl_step",
        "the rlbench-tiny sync RL step on one CPU core, this tree vs an earlier commit, FLOPs",
        ("rl_step*",),
    ),
    Workload(
        "compare", "bench.compare",
        "any workload in this tree vs an earlier commit (a git worktree), alternating: each "
        "row's figures and their ratio (`compare --help`)",
        ("compare_* (--name NAME)",),
    ),
    Workload(
        "rl-roles", "bench.rl_roles",
        "seconds per trainer step: role-split async on two pinned processes vs sync on one",
        ("rl_roles*",),
    ),
    Workload(
        "rl-multiprocess", "bench.rl_multiprocess",
        "the async arithmetic run as one job of two processes vs one process, equal steps",
        ("rl_multiprocess",),
    ),
    Workload(
        "rl-streaming", "bench.rl_streaming",
        "trainer steps per hour on long-tailed chain sums: streaming vs fixed lag vs sync",
        ("rl_streaming*",),
    ),
    Workload(
        "soak", "bench.soak",
        "the async default over hundreds of steps: does RSS, queue depth or drops grow?",
        ("soak*",),
    ),
    Workload(
        "sync", "bench.sync",
        "weight-sync GB/s across trainer -> generator layouts, vs memcpy and device_put",
        ("sync*", "sync_xproc*"),
    ),
    Workload(
        "routing-replay", "bench.routing_replay",
        "MoE routing replay: behaviour/trainer mismatch with and without it",
        ("routing_replay",),
    ),
    Workload(
        "trainer-scale", "bench.trainer_scale",
        "the train step at depth: scanned vs unrolled compile time, activation memory per layer",
        ("trainer_compile*", "trainer_memory*"),
    ),
    Workload(
        "scale-llamarl", "bench.scale_llamarl",
        "the sync/async speed-up model on LlamaRL's 8B/70B/405B settings vs the paper",
        ("scale_llamarl", "scale_llamarl_* (--compiled)"),
    ),
    Workload(
        "plan-tables", "bench.plan_tables",
        "launch.plan's programs compiled deviceless: 8B H100 train step, XLA attention vs the "
        "Triton kernel; whole-step cost over the hand count of 7 GPU / TPU plans",
        ("plan_attention_h100", "plan_ratios"),
    ),
    Workload(
        "quantized-plans", "bench.quantized_plans",
        "launch.plan's generator on 8-bit weights vs bf16, deviceless: one matmul's forms on "
        "H100 / v5e, the 8B decode step (fp8 H100, int8 v5e), LlamaRL's rows",
        ("quantized_plans_matmul", "quantized_plans_decode", "quantized_plans_llamarl*"),
    ),
    Workload(
        "scale-validate", "bench.scale_validate",
        "the speed-up model against this machine's measured `rl` rows, phase by phase",
        (
            "scale_validate*", "scale_validate_programs*",
            "scale_validate_summary, scale_validate_runs (--summarize)",
        ),
    ),
    Workload(
        "msd", "bench.msd",
        "MSD train-step time against KD train-step time, same student and batch",
        ("msd_step*",),
    ),
    Workload(
        "msd-results", "bench.msd_results",
        "MSD vs KD, KD-aug and no KD on DigitsCaption over seeds: the results table",
        ("msd_results*", "msd_results_regimes*"),
    ),
    Workload(
        "gpu-check", "bench.gpu_check",
        "the programs launch.plan compiled for a GPU, run and timed on one (needs a GPU)",
        ("--results NAME",),
    ),
    Workload(
        "gpu-attention", "bench.gpu_attention",
        "the Pallas Triton flash attention on a GPU: errors and time vs XLA (needs a GPU)",
        ("stdout",),
    ),
    Workload(
        "decode-kernel-gpu", "bench.decode_kernel_gpu",
        "the in-place decode kernel on a GPU: errors and time vs the XLA path (needs a GPU)",
        ("decode_kernel_gpu",),
    ),
    Workload(
        "peers-rl-step", "bench.peers.rl_step",
        "one RL step side by side: this library, Tunix's GRPO learner, TRL's GRPOTrainer",
        ("peers_rl_step*",),
    ),
    Workload(
        "peers-gen", "bench.peers.gen",
        "generation alone side by side: the library's engine vs the peers' generate",
        ("peers_gen*",),
    ),
    Workload(
        "suite", "bench.suite",
        "the test suite's wall time (`make test`'s pytest), this commit against a baseline "
        "commit, alternating",
        ("suite*",),
    ),
    Workload(
        "learning", "bench.learning",
        "does RL learn? an experiment's config against its controls (`learning --list`)",
        (
            "rl_learning*", "rl_async_learning*", "rl_lora_learning* (--out NAME)",
            "rl_streaming_learning*", "rl_streaming_recipe (rl-streaming --recipe_table)",
            "calc_learning*", "smollm2_learning*", "moe_learning*",
        ),
    ),
)  # fmt: skip

BY_NAME = {w.name: w for w in WORKLOADS}

# The learning scripts that became experiments of `learning` (same options).
MERGED_INTO_LEARNING = {
    "bench.rl_learning": "rl-sync",
    "bench.rl_async_learning": "rl-async",
    "bench.rl_lora_learning": "rl-lora",
    "bench.rl_streaming_learning": "rl-streaming",
    "bench.calc_learning": "calc",
    "bench.smollm2_learning": "smollm2",
}


def runner_command(command: str) -> str:
    """`command` as the runner spells it today: `python -m bench.MODULE ARGS` becomes
    `python -m bench NAME ARGS` (and a merged learning script `python -m bench learning
    EXPERIMENT ARGS`); any other command comes back unchanged."""
    match = re.match(r"python -m (bench(?:\.\w+)+)(?=\s|$)", command)
    if not match:
        return command
    module, rest = match.group(1), command[match.end() :]
    if module in MERGED_INTO_LEARNING:
        return f"python -m bench learning {MERGED_INTO_LEARNING[module]}{rest}"
    names = [w.name for w in WORKLOADS if w.module == module]
    return f"python -m bench {names[0]}{rest}" if names else command
