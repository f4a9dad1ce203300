"""Modality-specific distillation study: teacher, cached logits, students of every method over
seeds, and the results table and plot.

    python -m launch.msd --gin_file=configs/msd/digits_caption.gin --workdir=runs/msd_digits

Recipe: config (validated by `launch`) -> data splits -> mesh and rules -> teacher (trained, or
resumed / read back from the workdir) -> its view logits, cached -> cross-fitted saliency (when a
method needs it) -> every method x seed a student run (resumable) -> results.md, results.json,
results.png in the workdir. Rerunning the same command continues an interrupted study.
"""

from __future__ import annotations

import json
from pathlib import Path

import gin

from jaxrl.infra.distributed import initialize_from_argv
from jaxrl.infra.launcher import launch
from jaxrl.infra.mesh import make_mesh
from launch.msd_configs import (
    DigitsCaptionConfig,
    JsonlDataConfig,
    MeshConfig,
    StudyConfig,
    TeacherConfig,
)
from msd_jax import models, report
from msd_jax import study as study_lib
from msd_jax.data import REGIMES, make_splits
from msd_jax.train import CompiledModel


def _notes(data, teacher: TeacherConfig, study: StudyConfig, splits, teacher_model, student):
    if isinstance(data, DigitsCaptionConfig):
        mix = ", ".join(f"{r} {f:g}" for r, f in zip(REGIMES, data.regime_mix, strict=True))
        source = f"DigitsCaption (regime mix: {mix}; image noise {data.image_noise:g})"
    else:
        source = f"the jsonl dataset in {data.data_dir}"
    sizes = "/".join(str(len(splits[s])) for s in ("train", "validation", "test"))
    return (
        f"Data: {source}; train/validation/test {sizes} samples. "
        f"Teacher: {teacher.model.summary()}, {teacher_model.num_params:,} params, "
        f"{teacher.train.steps} steps. Student: {study.model.summary()}, "
        f"{student.num_params:,} params, {study.train.steps} steps, seeds {list(study.seeds)}; "
        f"tau={study.tau:g}, alpha={study.alpha:g}, aux_scale={study.aux_scale:g}; "
        f"saliency {teacher.saliency} from {teacher.num_folds} cross-fitted teachers."
    )


@gin.configurable
def msd_main(
    workdir: str,
    data: DigitsCaptionConfig | JsonlDataConfig = gin.REQUIRED,
    teacher: TeacherConfig = gin.REQUIRED,
    study: StudyConfig = gin.REQUIRED,
    mesh: MeshConfig | None = None,
    rules: str = "data_parallel",
    title: str = "MSD study",
) -> dict:
    if rules not in models.RULES:
        raise SystemExit(f"msd_main.rules={rules!r}; known: {sorted(models.RULES)}")
    splits = make_splits(data)
    device_mesh = make_mesh(mesh or MeshConfig(("data",), (-1,)))
    rules_table = models.RULES[rules]
    eval_bs = study.eval_batch_size

    teacher_model = CompiledModel(
        teacher.model.model_config(splits["train"]), device_mesh, rules_table
    )
    logits = study_lib.teacher_logits(workdir, splits, teacher, teacher_model, eval_bs)
    saliency_nm = None
    if any(m in study_lib.NEEDS_SALIENCY for m in study.methods):
        saliency_nm = study_lib.cross_fitted_saliency(
            workdir, splits["train"], teacher, teacher_model, eval_bs
        )
    student = CompiledModel(study.model.model_config(splits["train"]), device_mesh, rules_table)
    results = []
    for method in study.methods:
        results += study_lib.run_students(
            workdir, method, splits, logits, saliency_nm, study, student
        )

    out = Path(workdir)
    summary = report.summarize(results)
    teacher_metrics = json.loads((out / "teacher" / "eval.json").read_text())
    notes = _notes(data, teacher, study, splits, teacher_model, student)
    markdown = report.results_markdown(title, summary, teacher_metrics, notes)
    (out / "results.md").write_text(markdown)
    study_lib.write_json(
        out / "results.json",
        {"summary": summary, "verdict": report.verdict(summary), "results": results,
         "teacher": teacher_metrics},
    )  # fmt: skip
    plot = report.write_plot({title: summary}, out / "results.png")
    print(markdown)
    print(f"results: {(out / 'results.md').absolute()}")
    print(f"plot:    {plot}")
    return {"workdir": workdir, "summary": summary, "results": results, "plot": plot}


if __name__ == "__main__":
    launch(msd_main, initialize_from_argv(), description=__doc__.splitlines()[0])
