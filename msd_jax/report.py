"""The results of an MSD study: per-method means and standard errors over seeds, the weighting
chosen on the validation split, paired comparisons against KD, a markdown table and a plot.

Statistics over the S seeds of a method (x_s one seed's accuracy):

    mean = (1/S) sum_s x_s          SE = std(x, ddof=1) / sqrt(S)

Paired comparison of methods A and B over the seeds both ran (same initial params and batch
order per seed): d_s = x_s(A) - x_s(B), reported as mean(d) +- SE(d) and mean(d) / SE(d), the
difference in paired standard errors. The MSD weighting is selected by the highest mean
validation full-input accuracy; test numbers never take part in the choice.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from msd_jax.data import REGIMES
from msd_jax.views import VIEWS

VIEW_TITLES = {"full": "full input", "text": "text only", "image": "image only"}
METHOD_TITLES = {"ce": "no KD", "kd": "KD", "kd_aug": "KD-aug"}


def method_title(method: str) -> str:
    return METHOD_TITLES.get(method, method.replace("msd/", "MSD, "))


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (NaN with fewer than two values)."""
    x = np.asarray(values, np.float64)
    se = float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")
    return float(np.mean(x)), se


def _by_seed(results: list[dict], method: str, split: str, key: str) -> dict[int, float]:
    return {r["seed"]: r[split][key] for r in results if r["method"] == method}


def paired(results: list[dict], a: str, b: str, key: str = "accuracy/full") -> dict:
    """Test-split paired difference a - b over the seeds both ran."""
    xa, xb = _by_seed(results, a, "test", key), _by_seed(results, b, "test", key)
    seeds = sorted(set(xa) & set(xb))
    diffs = [xa[s] - xb[s] for s in seeds]
    mean, se = mean_se(diffs) if diffs else (float("nan"), float("nan"))
    ratio = mean / se if se > 0 else float("nan")
    return {"a": a, "b": b, "seeds": len(seeds), "diff": mean, "se": se, "diff_over_se": ratio}


def summarize(results: list[dict], baseline: str = "kd") -> dict:
    """Per-method statistics, the selected MSD weighting and the paired comparisons."""
    methods = list(dict.fromkeys(r["method"] for r in results))
    rows = []
    for method in methods:
        row = {"method": method, "seeds": sum(r["method"] == method for r in results)}
        for split in ("validation", "test"):
            for key in sorted({k for r in results for k in r[split]}):
                values = list(_by_seed(results, method, split, key).values())
                row[f"{split}/{key}"] = mean_se(values)
        rows.append(row)
    msd = [row for row in rows if row["method"].startswith("msd/")]
    selected = max(msd, key=lambda r: r["validation/accuracy/full"][0])["method"] if msd else None
    comparisons = []
    if baseline in methods:
        comparisons = [paired(results, m, baseline) for m in methods if m != baseline]
    return {"rows": rows, "selected": selected, "baseline": baseline, "comparisons": comparisons}


def verdict(summary: dict) -> dict | None:
    """The selected MSD weighting against the baseline: its paired comparison + `beats`
    (difference > 2 paired standard errors)."""
    if summary["selected"] is None:
        return None
    for c in summary["comparisons"]:
        if c["a"] == summary["selected"]:
            return c | {"beats": bool(c["diff"] > 2 * c["se"])}
    return None


def _pct(mean_and_se: tuple[float, float]) -> str:
    mean, se = mean_and_se
    if math.isnan(se):
        return f"{100 * mean:.1f}"
    return f"{100 * mean:.1f} ± {100 * se:.1f}"


def markdown_table(summary: dict) -> str:
    """Accuracy (%) per method: validation full input, test per view; mean ± SE over seeds."""
    rows = summary["rows"]
    auroc = any("test/auroc/full" in r for r in rows)
    diff = {c["a"]: c for c in summary["comparisons"]}
    header = ["method", "seeds", "val full", *(f"test {VIEW_TITLES[v]}" for v in VIEWS)]
    header += ["test AUROC full"] if auroc else []
    header += [f"test full − {method_title(summary['baseline'])} (paired)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        title = method_title(r["method"])
        if r["method"] == summary["selected"]:
            title += " (selected on val)"
        cells = [title, str(r["seeds"]), _pct(r["validation/accuracy/full"])]
        cells += [_pct(r[f"test/accuracy/{v}"]) for v in VIEWS]
        cells += [_pct(r["test/auroc/full"])] if auroc else []
        c = diff.get(r["method"])
        if c is None or math.isnan(c["diff"]):
            cells.append("—")
        else:
            cells.append(
                f"{100 * c['diff']:+.1f} ± {100 * c['se']:.1f} ({c['diff_over_se']:+.1f} SE)"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def regime_rows(summary: dict) -> list[dict]:
    """Test full-input accuracy (%) within each DigitsCaption regime, one row per method: its
    title under "method" and "mean ± SE" under each regime of `REGIMES` the study's test split
    has (no rows without regimes)."""
    rows = summary["rows"]
    regimes = [r for r in REGIMES if f"test/by_regime/{r}" in rows[0]]
    if not regimes:
        return []
    return [
        {"method": method_title(r["method"])}
        | {regime: _pct(r[f"test/by_regime/{regime}"]) for regime in regimes}
        for r in rows
    ]


def regime_table(summary: dict) -> str:
    """`regime_rows` as a markdown table ("" without regimes)."""
    rows = regime_rows(summary)
    if not rows:
        return ""
    header = ["method", *(regime.replace("_", " ") for regime in list(rows[0])[1:])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r.values()) + " |" for r in rows]
    return "\n".join(lines)


def verdict_line(summary: dict) -> str:
    v = verdict(summary)
    if v is None:
        return "No MSD method in this study, or no KD baseline: no verdict."
    name = method_title(v["a"])
    outcome = "beats" if v["beats"] else "does NOT beat"
    return (
        f"{name} (the weighting selected on validation) {outcome} KD on test full-input accuracy "
        f"by more than 2 paired standard errors: {100 * v['diff']:+.2f} ± {100 * v['se']:.2f} "
        f"points ({v['diff_over_se']:+.1f} SE, {v['seeds']} paired seeds)."
    )


def write_plot(summaries: dict[str, dict], path: str | Path) -> str:
    """One row per study (e.g. main and control): test accuracy per view and method (mean ± SE,
    the y axis zoomed on the bars), and each method's paired difference to KD on the full input
    with ± 2 paired standard errors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(summaries), 2, figsize=(13, 3.8 * len(summaries)), squeeze=False,
        gridspec_kw={"width_ratios": [3, 2]},
    )  # fmt: skip
    for (ax_views, ax_diff), (title, summary) in zip(axes, summaries.items(), strict=True):
        rows = summary["rows"]
        width = 0.8 / len(rows)
        lowest = 100.0
        for i, r in enumerate(rows):
            means = [100 * r[f"test/accuracy/{v}"][0] for v in VIEWS]
            errors = [100 * np.nan_to_num(r[f"test/accuracy/{v}"][1]) for v in VIEWS]
            x = np.arange(len(VIEWS)) + (i - (len(rows) - 1) / 2) * width
            ax_views.bar(x, means, width, yerr=errors, capsize=2, label=method_title(r["method"]))
            lowest = min(lowest, *means)
        ax_views.set_xticks(np.arange(len(VIEWS)), [VIEW_TITLES[v] for v in VIEWS])
        ax_views.set_ylabel("test accuracy (%)")
        ax_views.set_ylim(max(0.0, 10 * math.floor(lowest / 10) - 5), 100)
        ax_views.set_title(f"{title}: test accuracy, mean ± SE over seeds")
        comparisons = [c for c in summary["comparisons"] if not math.isnan(c["diff"])]
        names = [method_title(c["a"]) for c in comparisons]
        diffs = [100 * c["diff"] for c in comparisons]
        errors = [200 * np.nan_to_num(c["se"]) for c in comparisons]
        ax_diff.barh(np.arange(len(names)), diffs, xerr=errors, capsize=3, color="C3")
        ax_diff.set_yticks(np.arange(len(names)), names, fontsize=8)
        ax_diff.axvline(0, color="black", linewidth=0.8)
        ax_diff.invert_yaxis()
        ax_diff.set_xlabel("test full-input accuracy − KD (points), ± 2 paired SE")
        ax_diff.set_title(f"{title}: paired difference to KD")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 / len(summaries), 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(Path(path).absolute())


def teacher_line(teacher_metrics: dict) -> str:
    test = teacher_metrics["test"]
    views = ", ".join(f"{VIEW_TITLES[v]} {100 * test[f'accuracy/{v}']:.1f}" for v in VIEWS)
    return f"Teacher test accuracy (%): {views}."


def results_markdown(title: str, summary: dict, teacher_metrics: dict, notes: str = "") -> str:
    """The study's results.md: the table, the verdict and the teacher's accuracy."""
    parts = [f"# {title}", ""]
    if notes:
        parts += [notes, ""]
    parts += [
        "Accuracy in %, mean ± standard error over seeds; the last column is the paired "
        "difference to KD over the same seeds (same initial student and batch order).",
        "",
        markdown_table(summary),
        "",
        verdict_line(summary),
        "",
        teacher_line(teacher_metrics),
        "",
    ]
    by_regime = regime_table(summary)
    if by_regime:
        parts += ["Test full-input accuracy (%) within each regime:", "", by_regime, ""]
    return "\n".join(parts)
