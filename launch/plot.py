"""Plot a run's learning curves (reward, loss, held-out accuracy) to a PNG.

    python -m launch.plot runs/arith_sync [--out curves.png]

Reads WORKDIR/metrics.jsonl (and WORKDIR/sft/metrics.jsonl when the run had an SFT stage). An
SFT run alone (`launch.sft`) is plotted as SFT: its loss and its evaluations.
"""

from __future__ import annotations

import argparse
import os

from jaxrl.infra.metrics import read_metrics
from jaxrl.infra.paths import user_path


def _series(records, key):
    points = [(r["step"], r[key]) for r in records if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def _smoothed(ax, steps, values, color, label):
    window = max(1, len(values) // 50)
    smooth = [
        sum(values[max(0, i - window + 1) : i + 1]) / min(window, i + 1) for i in range(len(values))
    ]
    ax.plot(steps, values, alpha=0.3, color=color)
    ax.plot(steps, smooth, color=color, label=f"{label} (mean of {window})")


def _read(path: str) -> list[dict]:
    return read_metrics(path) if os.path.exists(path) else []


def write_plot(workdir: str, out: str | None = None) -> str:
    """Writes the PNG (default WORKDIR/curves.png) and returns its absolute path; raises
    FileNotFoundError when `workdir` holds no metrics.jsonl (nothing to plot)."""
    records = _read(os.path.join(workdir, "metrics.jsonl"))
    sft = _read(os.path.join(workdir, "sft", "metrics.jsonl"))
    if not records and not sft:
        raise FileNotFoundError(
            f"{workdir}: no metrics.jsonl (is it a run's workdir, and has the run logged a step?)"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = out or os.path.join(workdir, "curves.png")
    # RL runs log a reward; a run without one is an SFT run (launch.sft): its records are SFT's.
    is_rl = any("reward/mean" in r for r in records)
    if not is_rl:
        records, sft = [], records or sft
    panels = 3 if is_rl else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    if is_rl:
        ax_reward, ax_loss, ax_acc = axes
        steps, reward = _series(records, "reward/mean")
        _smoothed(ax_reward, steps, reward, "C0", "RL reward")
        ax_reward.set_xlabel("RL step")
        ax_reward.set_ylabel("reward / mean")
        ax_reward.legend(loc="best")
    else:
        ax_loss, ax_acc = axes
    for stage, stage_records, color in (("SFT", sft, "C3"), ("RL", records, "C0")):
        steps, loss = _series(stage_records, "loss")
        if steps:
            offset = steps[-1] if stage == "SFT" and is_rl else 0
            _smoothed(ax_loss, [s - offset for s in steps], loss, color, f"{stage} loss")
    ax_loss.set_xlabel("step (SFT steps before 0)" if is_rl and sft else "step")
    ax_loss.set_ylabel("loss")
    if ax_loss.get_legend_handles_labels()[0]:
        ax_loss.legend(loc="best")
    for key, label, color in (
        ("eval/accuracy", "greedy", "C1"),
        ("eval/accuracy_t1", "temperature 1", "C2"),
    ):
        s, v = _series(records, key)
        if s:
            ax_acc.plot(s, v, marker="o", color=color, label=f"RL, {label}")
        s, v = _series(sft, key)
        if s:
            offset = s[-1] if is_rl else 0  # RL runs: the SFT stage before step 0
            ax_acc.plot(
                [x - offset for x in s],
                v,
                marker=".",
                linestyle=":" if is_rl else "-",
                color=color,
                label=f"SFT, {label}",
            )
    if is_rl and sft:
        ax_acc.axvline(0, color="grey", linewidth=0.5)
        ax_acc.set_xlabel("step (SFT steps before 0)")
    else:
        ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("held-out accuracy")
    ax_acc.set_ylim(0, 1)
    if ax_acc.get_legend_handles_labels()[0]:
        ax_acc.legend(loc="best")
    fig.suptitle(os.path.basename(os.path.abspath(workdir)) + ("" if is_rl else " (SFT)"))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return os.path.abspath(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=user_path)
    parser.add_argument("--out", default=None, type=user_path)
    args = parser.parse_args(argv)
    try:
        print(write_plot(args.workdir, args.out))
    except FileNotFoundError as e:
        raise SystemExit(f"launch.plot: {e}") from None


if __name__ == "__main__":
    from jaxrl.infra.launcher import run_cli

    run_cli(main)
