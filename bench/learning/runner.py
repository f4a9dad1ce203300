"""What every learning experiment shares: reading a run's evaluations and summarising its curve,
launching `launch.rl` runs (in this process or as child processes, with a wall-time budget),
the plot of the curves, the machine's load and the record of the commands that launched a
workdir's runs. Imports no JAX (an experiment sets its devices first)."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What the curves are read for: (metrics key, its short name in rows).
GREEDY, T1 = ("eval/accuracy", "greedy"), ("eval/accuracy_t1", "t1")


def config_path(name: str) -> str:
    """configs/rl/NAME (absolute)."""
    return os.path.join(REPO, "configs", "rl", name)


def read(metrics_path: str, until_step: int = 0) -> list[dict]:
    """A run's metrics.jsonl records, those of steps <= `until_step` if it is > 0 (a run stopped
    early, or cut to the step every run reached: the RL learning rate is constant after warmup,
    so the first N steps of a longer run are an N-step run but for the final evaluation)."""
    from jaxrl.infra.metrics import read_metrics

    records = read_metrics(metrics_path)
    return [r for r in records if r["step"] <= until_step] if until_step > 0 else records


def evals(records: list[dict], key: str = "eval/accuracy") -> list[dict]:
    """The evaluation records (step 0's: the start) of a run."""
    return [r for r in records if key in r]


def mean(values) -> float:
    values = list(values)
    return statistics.mean(values) if values else float("nan")


def curve(evaluations: list[dict], key: str) -> dict:
    """One metric's curve in four figures: `start` (the first evaluation), `end` (the last),
    `last3` (the mean of the last 3: one evaluation of 512 problems has a ~2-point standard
    error) and `gain_pts` (last3 - start, in points)."""
    values = [r.get(key, float("nan")) for r in evaluations]
    last3 = mean(values[-3:])
    return {"start": values[0], "end": values[-1], "last3": last3,
            "gain_pts": 100 * (last3 - values[0])}  # fmt: skip


def curve_row(evaluations: list[dict], metrics=(GREEDY, T1), digits: int | None = None) -> dict:
    """`curve` of each (key, short) metric as SHORT_start, SHORT_end, SHORT_last3,
    SHORT_gain_pts (rounded to `digits`, and the gain to 1, if `digits` is given)."""
    row = {}
    for key, short in metrics:
        for name, value in curve(evaluations, key).items():
            if digits is not None:
                value = round(value, 1 if name == "gain_pts" else digits)
            row[f"{short}_{name}"] = value
    return row


def seconds_per_step(records: list[dict]) -> float:
    """The median step time, the first step (it compiles) left out."""
    return statistics.median(r["time/step_s"] for r in records if r["step"] > 1)


def run_row(name: str, label: str, workdir: str, digits: int) -> tuple[dict, list, list]:
    """A run's first columns (run, name, RL steps; once it has evaluated, its wall seconds since
    the first evaluation and its mean seconds per RL step, to `digits`), with its evaluation
    records and its RL-step records."""
    records = read(os.path.join(workdir, "metrics.jsonl"))
    evaluations = evals(records)
    steps = [r for r in records if "reward/mean" in r]
    row = {"run": label, "name": name, "steps": max((r["step"] for r in steps), default=0)}
    if evaluations:
        t0 = evaluations[0]["wall_time_s"]
        row["wall_s"] = round(max(r["wall_time_s"] for r in records) - t0, 1)
        if len(steps) >= 2:
            span = steps[-1]["wall_time_s"] - steps[0]["wall_time_s"]
            row["s_per_step"] = round(span / (len(steps) - 1), digits)
    return row, evaluations, steps


def restored_trainer(workdir: str, **optimizer):
    """`workdir`'s newest checkpoint (a run's or an SFT stage's) on a one-device trainer:
    (trainer, tokenizer, step, params); `optimizer`: OptimizerConfig fields for its optimizer."""
    from jaxrl.infra.mesh import MeshConfig, make_mesh
    from jaxrl.infra.sharding import TRAINER_RULES
    from jaxrl.job import workdir as run_dir
    from jaxrl.train.trainer import OptimizerConfig, Trainer

    config, tokenizer = run_dir.load_model_spec(workdir)
    step, params = run_dir.restore_params(workdir, config)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1)))
    trainer = Trainer(config, mesh, TRAINER_RULES, OptimizerConfig(**optimizer).make(1))
    return trainer, tokenizer, step, params


def run_in_process(config: str, workdir: str, params: list[str]) -> float:
    """`launch.rl` on `config` in this process (bench.common.run_rl); its wall seconds."""
    from bench.common import run_rl

    return run_rl(config, workdir, params)


def log_tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def first_record_time(workdir: str) -> float | None:
    """When the run's first metrics record (its step-0 evaluation) appeared, else None."""
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path) and os.path.getsize(path) > 0:
        return os.path.getmtime(path)
    return None


def launch_child(
    config: str,
    workdir: str,
    params: list[str],
    *,
    devices: int = 0,
    seconds: float = float("inf"),
    budget_from_first_record: bool = False,
    module: str = "launch.rl",
    module_args: tuple[str, ...] = (),
    must_succeed: bool = True,
    env: dict[str, str] | None = None,
) -> tuple[int, float]:
    """`python -m MODULE [MODULE_ARGS] --gin_file CONFIG --workdir WORKDIR --gin_param ...` in a
    child process on the CPU (`devices` simulated devices, if > 0), its output appended to
    WORKDIR.log. The child is interrupted (SIGINT: the loop saves and stops at the end of its
    step) `seconds` after its start, or after its first metrics record with
    `budget_from_first_record` (the step-0 evaluation: an SFT stage before it is not counted).
    A child that fails (exit other than 0 or SIGINT's) raises SystemExit with its log's tail,
    unless `must_succeed` is off and it wrote metrics. `env`: more environment variables for
    the child. Returns (exit code, wall seconds)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **(env or {}))
    if devices:
        from jaxrl.infra.xla_cpu import cpu_xla_flags

        env["XLA_FLAGS"] = cpu_xla_flags("", devices=devices)
    command = [sys.executable, "-m", module, *module_args]
    command += ["--gin_file", config, "--workdir", workdir]
    for p in params:
        command += ["--gin_param", p]
    log_path = workdir.rstrip("/") + ".log"
    start = time.perf_counter()
    with open(log_path, "a") as log:
        child = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while child.poll() is None:
            t0 = first_record_time(workdir) if budget_from_first_record else None
            elapsed = time.time() - t0 if t0 is not None else time.perf_counter() - start
            if (t0 is not None or not budget_from_first_record) and elapsed > seconds:
                child.send_signal(signal.SIGINT)
                try:
                    child.wait(timeout=600)
                except subprocess.TimeoutExpired:
                    child.kill()
                break
            time.sleep(1)
        child.wait()
    code = child.returncode
    wrote = os.path.exists(os.path.join(workdir, "metrics.jsonl"))
    if code not in (0, 130, -signal.SIGINT) and (must_succeed or not wrote):
        raise SystemExit(f"{workdir}: {module} failed (exit {code}):\n{log_tail(log_path)}")
    return code, time.perf_counter() - start


def load() -> str:
    """The machine's load average, 1/5/15 minutes (the machine may be shared)."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f}/{five:.1f}/{fifteen:.1f}"


def note_launch(workdir: str, text: str, stamp: bool = True) -> None:
    """Appends `text` (the launching command, dated unless `stamp` is off) to
    WORKDIR/launched_by.txt: the runs of one workdir may come from several invocations."""
    if stamp:
        text = time.strftime("%Y-%m-%d %H:%M UTC: ", time.gmtime()) + text
    with open(os.path.join(workdir, "launched_by.txt"), "a") as f:
        f.write(text)


def launches(workdir: str) -> str:
    """ "; runs launched by `A` then `B`" from WORKDIR/launched_by.txt, or ""."""
    path = os.path.join(workdir, "launched_by.txt")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return "; runs launched by " + " then ".join(f"`{line.strip()}`" for line in f)


def write_report(
    name: str,
    rows: list[dict],
    columns: list,
    note: str,
    workdir: str,
    labels: dict[str, str],
    panels: list[tuple[str, str]],
    **plot,
) -> None:
    """Writes bench/results/NAME.{json,md} (`note` followed by the commands that launched
    WORKDIR's runs) and NAME.png (`plot_curves` of `labels`' runs, `plot` its options), printing
    each path and the runs' directory."""
    from bench.common import RESULTS_DIR, write_results

    print(write_results(name, rows, columns, note + launches(workdir)))
    png = os.path.join(RESULTS_DIR, name + ".png")
    print(f"plot: {plot_curves(labels, png, panels, **plot)}")
    print(f"runs: {workdir}")


def plot_curves(
    runs: dict[str, str],
    path: str,
    panels: list[tuple[str, str]],
    *,
    x: str = "step",
    title: str = "",
    until_step: int = 0,
    bar: float | None = None,
    dpi: int = 100,
) -> str:
    """One panel per (metrics key, title) of `panels`, one line per run ({label: workdir}),
    against trainer steps (`x` "step") or wall minutes from the run's first record
    ("minutes"); `bar`: a dotted line on the first panel at the first run's start + `bar`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A common y axis only where every panel is a rate in [0, 1] (accuracies, rewards).
    share = x == "step" and all(key.startswith(("eval/", "reward/")) for key, _ in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(max(11, 3.6 * len(panels)), 4.4),
                             sharey=share)  # fmt: skip
    axes = list(axes) if len(panels) > 1 else [axes]
    start = None
    # One colour per run, not per panel's own cycle: a run missing from a panel (a single-turn
    # run has no tool-call rate) must not shift the colours of the runs after it.
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, workdir) in enumerate(runs.items()):
        records = read(os.path.join(workdir, "metrics.jsonl"), until_step)
        for ax, (key, _) in zip(axes, panels, strict=True):
            points = [r for r in records if key in r]
            if not points:
                continue
            if x == "step":
                xs = [r["step"] for r in points]
            else:
                xs = [(r["wall_time_s"] - records[0]["wall_time_s"]) / 60 for r in points]
            style = {"marker": "o"} if key.startswith("eval/") else {"alpha": 0.7}
            style["color"] = cycle[i % len(cycle)]
            ax.plot(xs, [r[key] for r in points], label=label, **style)
            if start is None and ax is axes[0]:
                start = points[0][key]
    for ax, (_, panel_title) in zip(axes, panels, strict=True):
        ax.set_title(panel_title)
        ax.set_xlabel("trainer step" if x == "step" else "wall minutes")
        ax.grid(alpha=0.3)
    if bar is not None and start is not None:
        axes[0].axhline(start + bar, color="gray", linestyle=":", label=f"start + {bar:g}")
    handles, labels = axes[0].get_legend_handles_labels()  # one legend, below the panels
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(labels) - 1) // 3), 1, 1))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
