"""`python -m bench plan-tables [--table attention|ratios|all]`: docs/scale.md's tables of the
programs `launch.plan` compiles deviceless on this CPU (XLA:GPU through the CUDA plugin, the TPU
compiler through libtpu), from the same library calls (`launch.plan.plan_trainer_role`,
`plan_generator_role`, `table_cost`, `launch.plan_notes.whole_step_figures`).

- `attention` (bench/results/plan_attention_h100.json): the 8B H100 plan's train step per device
  (configs/plan/llama3_8b_grpo_h100.gin, the trainer only) with the XLA attention path
  (`PlanConfig.attention_impl="xla"`) against the fused Triton kernel (None, the GPU's own):
  temp and total GiB, FLOPs, bytes and the roofline as the plan's table prints them (XLA's cost
  analysis: one micro-batch and one layer, a kernel call's work not seen), and the largest
  buffer of `[T, T]` scores.
- `ratios` (bench/results/plan_ratios.json): for each plan of `PLANS`, the train step's
  whole-step bytes and FLOPs as compiled over its hand count (`jaxrl.plan.hand_count`), its
  FLOPs-time and bytes-time at the device's peaks, whether any buffer holds `[T, T]` scores,
  and the prefill's and decode step's ratios.
"""

from __future__ import annotations

import argparse
import json
import time

from jaxrl.infra import platforms

GiB = 1024**3

ATTENTION_CONFIG = "configs/plan/llama3_8b_grpo_h100.gin"
# (the attention path's name, `PlanConfig.attention_impl`)
ATTENTION_PATHS = (("XLA attention", "xla"), ("Triton kernel", None))
ATTENTION_COLUMNS = [
    ("path", "train_step (per device)"),
    ("temp", "temp GiB"),
    ("total", "total GiB"),
    ("flops", "FLOPs"),
    ("bytes", "bytes"),
    ("roofline", "roofline ms"),
    ("scores", "largest [T, T] scores"),
]

# (the plan's name in the table: model, trainer / generator devices; its config)
PLANS = (
    ("8B, 8 x H100", "configs/plan/llama3_8b_grpo_h100.gin"),
    ("8B, 2 x 8 H200", "configs/plan/llama3_8b_grpo_h200x2.gin"),
    ("70B, 4 x 8 H100 / 8 H100", "configs/plan/llama3_70b_grpo_h100x4.gin"),
    ("405B, 32 x 8 H100 / 8 H200", "configs/plan/llama3_405b_grpo_h100.gin"),
    ("1B, 1 H200", "configs/plan/llama3_1b_h200.gin"),
    ("8B, v5p:2x2x2 / v5e:2x2", "configs/plan/llama3_8b_grpo.gin"),
    ("70B, v5p:4x4x4 / v5p:2x2x1", "configs/plan/llama3_70b_grpo.gin"),
)
RATIO_COLUMNS = [
    ("plan", "plan (trainer / generator)"),
    ("train", "train_step bytes / FLOPs"),
    ("times", "FLOPs-time / bytes-time ms"),
    ("scores", "[T, T] scores"),
    ("prefill", "prefill bytes / FLOPs"),
    ("decode", "decode_step bytes / FLOPs"),
    ("config", "config"),
]


def load_config(gin_file: str, params: tuple[str, ...] = ()):
    """The `PlanConfig` that `python -m launch.plan --gin_file=gin_file --gin_param=...` plans."""
    import gin

    from launch.plan import plan_kwargs

    try:
        return plan_kwargs([gin_file], list(params))["config"]
    finally:
        gin.clear_config()


def _scores(square: list[tuple[str, int]] | None) -> str:
    """The largest buffer of `[T, T]` scores (`ProgramReport.square_buffers`), "none", or "not
    looked for" (None: the sequence length is one of the model's dimensions)."""
    if square is None:
        return "not looked for"
    return "none" if not square else f"{square[0][0]} {square[0][1] / GiB:.2f} GiB"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 1000 else f"{ms:.4g}"


def attention_row(config, path: str, trainer=None) -> dict:
    """The train step of `config`'s trainer per device, as the plan's table gives it
    (`trainer`: its `plan_trainer_role`, compiled here if None)."""
    from launch.plan import plan_trainer_role, table_cost, trainer_scores_dims

    role = trainer or plan_trainer_role(config)
    (report,) = role.reports
    flops, bytes_, roofline = table_cost(report, role.spec, role.costs[report.name])
    sequence, dims = trainer_scores_dims(config, role.model_config)
    return {
        "path": path,
        "attention_impl": config.attention_impl,
        "temp_bytes": report.temp_bytes,
        "total_bytes": report.total_bytes,
        "flops_raw": flops,
        "bytes_raw": bytes_,
        "roofline_s": roofline,
        "compile_s": round(report.compile_seconds, 1),
        "temp": f"{report.temp_bytes / GiB:.2f}",
        "total": f"{report.total_bytes / GiB:.2f}",
        "flops": f"{flops:.3g}",
        "bytes": f"{bytes_:.3g}",
        "roofline": f"{roofline * 1e3:.3g}",
        "scores": _scores(None if sequence in dims else report.square_buffers(sequence)),
    }


def _pair(figures: dict | None) -> str:
    if figures is None:
        return "n/a"
    return f"{figures['bytes_ratio']:.2f} / {figures['flops_ratio']:.2f}"


def ratios_row(config, plan: str, gin_file: str = "", trainer=None) -> dict:
    """One plan's whole-step figures as compiled against its hand count (trainer and
    generator; `trainer`: the trainer's `plan_trainer_role`, compiled here if None)."""
    from launch.plan import plan_generator_role, plan_trainer_role, trainer_scores_dims
    from launch.plan_notes import whole_step_figures

    start = time.perf_counter()
    trainer = trainer or plan_trainer_role(config)
    sequence, dims = trainer_scores_dims(config, trainer.model_config)
    train = whole_step_figures(trainer.reports[0], trainer.spec, sequence, dims)
    generator = plan_generator_role(config)
    prefill, decode = (whole_step_figures(r, generator.spec) for r in generator.reports)
    row = {"plan": plan, "config": gin_file}
    for name, figures in (("train", train), ("prefill", prefill), ("decode", decode)):
        row[name] = _pair(figures)
        if figures is not None:
            row[f"{name}_bytes_ratio"] = figures["bytes_ratio"]
            row[f"{name}_flops_ratio"] = figures["flops_ratio"]
    if train is not None:
        row |= {key: train[key] for key in ("flops_s", "bytes_s", "bound")}
        row["times"] = f"{_ms(train['flops_s'])} / {_ms(train['bytes_s'])} ({train['bound']})"
        row["scores"] = _scores(train["scores"])
    row["plan_s"] = round(time.perf_counter() - start, 1)
    return row


def attention_table() -> list[dict]:
    rows = []
    for path, impl in ATTENTION_PATHS:
        config = load_config(ATTENTION_CONFIG, (f"PlanConfig.attention_impl={impl!r}",))
        rows.append(attention_row(config, path))
        print(json.dumps({"bench": "plan_attention_h100", **rows[-1]}), flush=True)
    return rows


def ratios_table(plans=PLANS) -> list[dict]:
    rows = []
    for plan, gin_file in plans:
        rows.append(ratios_row(load_config(gin_file), plan, gin_file))
        print(json.dumps({"bench": "plan_ratios", **rows[-1]}), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", choices=("attention", "ratios", "all"), default="all")
    args = parser.parse_args(argv)
    platforms.compile_only()
    from bench.common import write_results

    with platforms.without_plugin_noise():
        if args.table in ("attention", "all"):
            rows = attention_table()
            note = (
                f"the 8B H100 plan's train step per device ({ATTENTION_CONFIG}, the trainer), "
                "the XLA attention path against the fused Triton kernel; FLOPs / bytes / "
                "roofline: XLA's cost analysis (one micro-batch, one layer; kernels unseen)"
            )
            print(write_results("plan_attention_h100", rows, ATTENTION_COLUMNS, note))
        if args.table in ("ratios", "all"):
            rows = ratios_table()
            note = (
                "whole step per device as compiled (hlo_cost, kernels by their models) over "
                "the hand count (jaxrl.plan.hand_count), bytes / FLOPs; train step times at "
                "the device's peaks"
            )
            print(write_results("plan_ratios", rows, RATIO_COLUMNS, note))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
