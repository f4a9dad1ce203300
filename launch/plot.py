"""Plot a run's learning curves (reward, held-out accuracy) to a PNG.

    python -m launch.plot runs/arith_sync [--out curves.png]

Reads WORKDIR/metrics.jsonl (and WORKDIR/sft/metrics.jsonl when the run had an SFT stage).
"""

from __future__ import annotations

import argparse
import os

from jaxrl.infra.metrics import read_metrics


def _series(records, key):
    points = [(r["step"], r[key]) for r in records if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def write_plot(workdir: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = out or os.path.join(workdir, "curves.png")
    path = os.path.join(workdir, "metrics.jsonl")
    records = read_metrics(path) if os.path.exists(path) else []
    sft_path = os.path.join(workdir, "sft", "metrics.jsonl")
    sft = read_metrics(sft_path) if os.path.exists(sft_path) else []

    fig, (ax_reward, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    steps, reward = _series(records, "reward/mean")
    if steps:
        window = max(1, len(reward) // 50)
        smooth = [
            sum(reward[max(0, i - window + 1) : i + 1]) / min(window, i + 1)
            for i in range(len(reward))
        ]
        ax_reward.plot(steps, reward, alpha=0.3, color="C0")
        ax_reward.plot(steps, smooth, color="C0", label=f"RL reward (mean of {window})")
    ax_reward.set_xlabel("RL step")
    ax_reward.set_ylabel("reward / mean")
    ax_reward.legend(loc="lower right")
    for key, label, color in (
        ("eval/accuracy", "greedy", "C1"),
        ("eval/accuracy_t1", "temperature 1", "C2"),
    ):
        s, v = _series(records, key)
        if s:
            ax_acc.plot(s, v, marker="o", color=color, label=f"RL, {label}")
        s, v = _series(sft, key)
        if s:
            ax_acc.plot(
                [x - s[-1] for x in s],
                v,
                marker=".",
                linestyle=":",
                color=color,
                label=f"SFT, {label}",
            )
    ax_acc.axvline(0, color="grey", linewidth=0.5)
    ax_acc.set_xlabel("step (SFT steps before 0)")
    ax_acc.set_ylabel("held-out accuracy")
    ax_acc.set_ylim(0, 1)
    ax_acc.legend(loc="lower right")
    fig.suptitle(os.path.basename(os.path.abspath(workdir)))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return os.path.abspath(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    print(write_plot(args.workdir, args.out))


if __name__ == "__main__":
    main()
