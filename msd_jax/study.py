"""An MSD study: a teacher, its cached view logits, cross-fitted saliency, and students of each
method over several seeds; every training is a resumable run (`msd_jax.train.run_training`).

    WORKDIR/
      config.gin                        the operative config (written by the launcher)
      teacher/                          the distillation teacher: checkpoints/, metrics.jsonl
      teacher/logits.npz                its view logits on every split [N, 3, C] (the cache)
      teacher/eval.json                 its per-view accuracy on every split
      folds/fold_<k>/                   cross-fitting teachers (only for population / instance)
      folds/saliency.npz                held-out logits, folds and saliency of the train split
      students/<method>/seed_<s>/       checkpoints/, metrics.jsonl, result.json

A finished stage leaves its output file (written atomically) and is skipped on a rerun; an
unfinished one resumes from its newest checkpoint, so the same command continues a study.

Methods (all students of one seed share their initial params and their batch order, so the
comparisons across methods are paired):

    ce               no KD: cross-entropy on the full input (L_KD with alpha = 0)
    kd               L_KD on the full input
    kd_aug           the three views, every view's target the teacher's full-input logits
    msd/<weighting>  L_MSD with the weighting uniform, population, instance or learned
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from msd_jax import saliency as saliency_lib
from msd_jax import step as step_lib
from msd_jax import weighting as weighting_lib
from msd_jax.data import MultimodalDataset, batch_indices
from msd_jax.losses import DistillationLoss
from msd_jax.train import (
    CompiledModel,
    ModelSpec,
    TrainConfig,
    make_supervised_step,
    predict_views,
    run_training,
    view_metrics,
)

WEIGHTINGS = ("uniform", "population", "instance", "learned")
METHODS = ("ce", "kd", "kd_aug") + tuple(f"msd/{w}" for w in WEIGHTINGS)
NEEDS_SALIENCY = ("msd/population", "msd/instance")
# The validation batches of the learned weighting come from their own stream of seeds.
_VALIDATION_STREAM = 1_000_003


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """The frozen teacher and the cross-fitting teachers of the saliency.

    Attributes:
      model, train: its architecture and training run.
      unimodal_weight: u of the teacher loss (`train.make_supervised_step`).
      seed: its initial params and batch order.
      num_folds: K cross-fitting teachers (trained only if a method needs saliency).
      saliency: the score behind population / instance weights: "s1", "s2" or "s3".
    """

    model: ModelSpec = ModelSpec(kind="mlp", mlp_hidden_sizes=(512, 512))
    train: TrainConfig = TrainConfig(steps=2000)
    unimodal_weight: float = 1.0
    seed: int = 0
    num_folds: int = 3
    saliency: str = "s3"

    def validate(self) -> None:
        self.model.validate()
        self.train.validate()
        if not (math.isfinite(self.unimodal_weight) and self.unimodal_weight >= 0):
            raise ValueError(f"unimodal_weight={self.unimodal_weight} must be finite and >= 0")
        if self.num_folds < 2:
            raise ValueError(f"num_folds={self.num_folds} must be >= 2")
        if self.saliency not in saliency_lib.SALIENCY:
            raise ValueError(f"saliency={self.saliency!r}; known: {sorted(saliency_lib.SALIENCY)}")


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """The students: one run per (method, seed).

    Attributes:
      model, train: the student's architecture and training run.
      methods: names from `METHODS`.
      seeds: one student per seed and method (init params, batch order).
      tau, alpha: the distillation loss (`losses.DistillationLoss`).
      aux_scale: per-modality auxiliary weight of uniform (and the mass of every scheme).
      instance_normalisation: "sum" or "softmax" for the instance weighting.
      eval_batch_size: batch of the evaluation forward passes (a multiple of the devices).
    """

    model: ModelSpec = ModelSpec(kind="mlp", mlp_hidden_sizes=(32,))
    train: TrainConfig = TrainConfig(steps=3000)
    methods: tuple[str, ...] = METHODS
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    tau: float = 2.0
    alpha: float = 0.5
    aux_scale: float = 1.0
    instance_normalisation: str = "sum"
    eval_batch_size: int = 256

    def validate(self) -> None:
        self.model.validate()
        self.train.validate()
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"methods {unknown or '()'} unknown; choose from {METHODS}")
        if len(set(self.methods)) != len(self.methods) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"methods {self.methods} and seeds {self.seeds} must be distinct")
        if not self.seeds:
            raise ValueError("seeds is empty; give at least one")
        self.loss  # noqa: B018 (validates tau and alpha)
        weighting_lib.make_weighting(
            "instance", aux_scale=self.aux_scale, normalisation=self.instance_normalisation
        )
        if self.eval_batch_size < 1:
            raise ValueError(f"eval_batch_size={self.eval_batch_size} must be >= 1")

    @property
    def loss(self) -> DistillationLoss:
        return DistillationLoss(tau=self.tau, alpha=self.alpha)


def run_dir_name(method: str) -> str:
    """students/<this>/seed_<s>: the method with "/" made a "-"."""
    return method.replace("/", "-")


def _write_atomic(path: Path, write) -> None:
    """`write(tmp_path)`, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def write_json(path: Path, value) -> None:
    _write_atomic(path, lambda tmp: tmp.write_text(json.dumps(value, indent=1) + "\n"))


def _save_npz(path: Path, **arrays) -> None:
    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    _write_atomic(path, write)


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as f:  # never unpickle
        return {k: f[k] for k in f.files}


def _check_batch(batch_size: int, mesh, what: str) -> None:
    if batch_size % mesh.size:
        raise ValueError(
            f"{what}={batch_size} does not divide over the {mesh.size} devices of the mesh; use "
            f"a multiple of {mesh.size}"
        )


@functools.cache
def _teacher_step(model: CompiledModel, config: TeacherConfig) -> step_lib.ShardedFunction:
    """The teacher's jitted step, one per (model, config): shared by the teacher and its folds."""
    optimizer = config.train.optimizer()
    shardings = model.state_shardings(optimizer, None)
    return make_supervised_step(
        model.graphdef, optimizer, config.unimodal_weight, model.mesh, model.rules, shardings
    )


def _train_teachers(
    run_dirs: list[Path],
    datasets: list[MultimodalDataset],
    config: TeacherConfig,
    model: CompiledModel,
) -> list:
    """Trains (or restores) one teacher per (run_dir, dataset); returns their params."""
    _check_batch(config.train.batch_size, model.mesh, "TeacherConfig.train.batch_size")
    all_params = []
    for run_dir, data in zip(run_dirs, datasets, strict=True):
        state, _ = model.init_state(config.seed, config.train.optimizer(), None)

        def step_inputs(s, data=data):
            return (data.batch(batch_indices(len(data), config.train.batch_size, config.seed, s)),)

        train_step = _teacher_step(model, config)
        state = run_training(
            run_dir, config.train, state, train_step, step_inputs, desc=run_dir.name
        )
        all_params.append(state.params)
    return all_params


def teacher_logits(
    workdir: str | Path,
    splits: dict[str, MultimodalDataset],
    config: TeacherConfig,
    model: CompiledModel,
    eval_batch_size: int,
) -> dict[str, np.ndarray]:
    """The teacher's view logits `[N, 3, C]` on every split: trained (or resumed) on the train
    split, then cached in WORKDIR/teacher/logits.npz; read from there when it exists.

    `model` is the teacher (`CompiledModel(config.model.model_config(train), mesh, rules)`).
    """
    run_dir = Path(workdir) / "teacher"
    cache = run_dir / "logits.npz"
    if cache.exists():
        print(f"[teacher] cached logits in {cache}", flush=True)
        return _load_npz(cache)
    _check_batch(eval_batch_size, model.mesh, "StudyConfig.eval_batch_size")
    (params,) = _train_teachers([run_dir], [splits["train"]], config, model)
    logits = {
        name: predict_views(model.predict, params, data, eval_batch_size)
        for name, data in splits.items()
    }
    metrics = {name: view_metrics(logits[name], data) for name, data in splits.items()}
    write_json(run_dir / "eval.json", metrics)
    _save_npz(cache, **logits)
    print(f"[teacher] {json.dumps(metrics['validation'])} (validation)", flush=True)
    return logits


def cross_fitted_saliency(
    workdir: str | Path,
    train: MultimodalDataset,
    config: TeacherConfig,
    model: CompiledModel,
    eval_batch_size: int,
) -> np.ndarray:
    """Saliency `[N, 2]` of the train split from K teachers, each trained without one fold and
    scoring only that fold (`msd_jax.saliency`); cached in WORKDIR/folds/saliency.npz."""
    fold_root = Path(workdir) / "folds"
    cache = fold_root / "saliency.npz"
    if cache.exists():
        return _load_npz(cache)["saliency_nm"]
    fold_n = saliency_lib.fold_assignment(len(train), config.num_folds, config.seed)
    run_dirs = [fold_root / f"fold_{k}" for k in range(config.num_folds)]
    subsets = [train.subset(np.flatnonzero(fold_n != k)) for k in range(config.num_folds)]
    fold_params = _train_teachers(run_dirs, subsets, config, model)
    held_out = np.zeros((len(train), 3, train.num_classes), np.float32)
    for k, params in enumerate(fold_params):
        rows = np.flatnonzero(fold_n == k)
        held_out[rows] = predict_views(model.predict, params, train.subset(rows), eval_batch_size)
    scores = saliency_lib.saliency(config.saliency, held_out, train.label_n)
    saliency_nm = np.asarray(scores, np.float32)
    fold_root.mkdir(parents=True, exist_ok=True)
    _save_npz(cache, saliency_nm=saliency_nm, held_out_logits=held_out, fold_n=fold_n)
    print(f"[folds] mean {config.saliency} saliency (text, image): "
          f"{saliency_lib.mean_saliency(saliency_nm)}", flush=True)  # fmt: skip
    return saliency_nm


def make_method(
    method: str, config: StudyConfig, saliency_nm: np.ndarray | None
) -> tuple[step_lib.StepConfig, weighting_lib.Weighting | None]:
    """The step config and weighting scheme of a method name."""
    if method == "ce":
        loss = DistillationLoss(tau=config.tau, alpha=0.0)
        return step_lib.StepConfig(objective="kd", loss=loss), None
    if method == "kd":
        return step_lib.StepConfig(objective="kd", loss=config.loss), None
    if method == "kd_aug":
        scheme = weighting_lib.make_weighting("uniform", aux_scale=config.aux_scale)
        return step_lib.StepConfig(objective="kd_aug", loss=config.loss), scheme
    name = method.removeprefix("msd/")
    hparams = {"aux_scale": config.aux_scale}
    if name == "population":
        hparams["mean_saliency"] = saliency_lib.mean_saliency(saliency_nm)
    elif name == "instance":
        hparams["normalisation"] = config.instance_normalisation
    return step_lib.StepConfig(objective="msd", loss=config.loss), weighting_lib.make_weighting(
        name, **hparams
    )


def run_students(
    workdir: str | Path,
    method: str,
    splits: dict[str, MultimodalDataset],
    logits: dict[str, np.ndarray],
    saliency_nm: np.ndarray | None,
    config: StudyConfig,
    model: CompiledModel,
) -> list[dict]:
    """Every seed's student of `method` (trained, resumed or read back); their result.json.

    `model` is the student (`CompiledModel(config.model.model_config(train), mesh, rules)`),
    shared by every method so that its init and forward compile once.
    """
    train, validation = splits["train"], splits["validation"]
    bs = config.train.batch_size
    _check_batch(bs, model.mesh, "StudyConfig.train.batch_size")
    _check_batch(config.eval_batch_size, model.mesh, "StudyConfig.eval_batch_size")
    if method in NEEDS_SALIENCY and saliency_nm is None:
        raise ValueError(f"method {method!r} needs the cross-fitted saliency")
    step_config, scheme = make_method(method, config, saliency_nm)
    learned = scheme is not None and scheme.learned
    if learned and bs > len(validation):
        raise ValueError(f"batch_size={bs} exceeds the {len(validation)} validation samples")
    with_saliency = scheme is not None and scheme.needs_saliency
    optimizer = config.train.optimizer()
    train_step, results = None, []
    for seed in config.seeds:
        run_dir = Path(workdir) / "students" / run_dir_name(method) / f"seed_{seed}"
        if (run_dir / "result.json").exists():
            results.append(json.loads((run_dir / "result.json").read_text()))
            continue
        state, shardings = model.init_state(seed, optimizer, scheme)
        if train_step is None:
            train_step = step_lib.make_train_step(
                model.graphdef, optimizer, scheme, step_config, model.mesh, model.rules, shardings
            )

        def step_inputs(s, seed=seed):
            idx = batch_indices(len(train), bs, seed, s)
            targets = step_lib.TeacherTargets(
                logits_bvc=logits["train"][idx],
                saliency_bm=saliency_nm[idx] if with_saliency else None,
            )
            if not learned:
                return train.batch(idx), targets
            val_idx = batch_indices(len(validation), bs, seed + _VALIDATION_STREAM, s)
            return train.batch(idx), targets, validation.batch(val_idx)

        started = time.perf_counter()
        desc = f"{method}/seed_{seed}"
        state = run_training(run_dir, config.train, state, train_step, step_inputs, desc=desc)
        result = {"method": method, "seed": seed, "steps": int(state.step)}
        result["train_s"] = round(time.perf_counter() - started, 2)
        for split in ("validation", "test"):
            data = splits[split]
            student_logits = predict_views(
                model.predict, state.params, data, config.eval_batch_size
            )
            result[split] = view_metrics(student_logits, data)
        write_json(run_dir / "result.json", result)
        print(f"[{desc}] test {json.dumps(result['test'])}", flush=True)
        results.append(result)
    return results
