"""MSD train-step time against KD train-step time, same student, same batch.

Workload (DigitsCaption-shaped): the "student" transformer (hidden 64, 2 layers, 4 heads, MLP 256),
batch 128, captions of 16 tokens (vocabulary 64), images as 16 patches of 4 values (8x8 digits in
2x2 patches), 10 classes; AdamW; fp32. Teacher logits are cached inputs (the teacher is frozen),
so neither step runs the teacher. Rows:

- kd: the student on the full input, L_KD.
- msd/<weighting>: the student on the three views in one batched forward (full row + one row
  packing the text-only and image-only views), L_MSD; "learned" adds the look-ahead meta step.
- msd/uniform, 3 rows: the same loss with each view as its own masked row (the layout packing
  avoids), for comparison.

Each step is compiled ahead (compile time reported on its own; XLA's FLOP count of the step
too), run `--warmup` times, then timed `--steps` times round robin over the rows (each call waits
for its result), so that load from other processes hits every row alike; the table reports the
median and its ratio to the KD step. The mesh is every device JAX sees, data parallel.

    python -m bench.msd            # the workload above
    python -m bench.msd --smoke    # tiny sizes, kd and msd/uniform only, a few steps (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bench.common import command, machine, write_results
from jaxrl.infra.mesh import MeshConfig, make_mesh
from msd_jax import models, step, weighting
from msd_jax.views import NUM_VIEWS, MultimodalBatch, stack_views


@dataclasses.dataclass(frozen=True)
class Workload:
    size: str = "student"
    batch_size: int = 128
    text_len: int = 16
    vocab_size: int = 64
    patches: int = 16
    patch_dim: int = 4
    num_classes: int = 10


SMOKE = Workload(size="tiny", batch_size=16, text_len=4, vocab_size=16, patches=4, patch_dim=4)


class UnpackedViewsTransformer(models.MultimodalTransformer):
    """The same model with each view as its own masked row (3 rows per sample)."""

    def view_logits(self, batch: MultimodalBatch) -> jax.Array:
        return self(stack_views(batch)).reshape(batch.batch_size, NUM_VIEWS, -1)


def make_inputs(w: Workload, seed: int = 0):
    rng = np.random.default_rng(seed)

    def batch():
        text_mask = rng.random((w.batch_size, w.text_len)) < 0.9
        text_mask[:, 0] = True
        return MultimodalBatch(
            text_ids_bt=jnp.asarray(rng.integers(0, w.vocab_size, text_mask.shape), jnp.int32),
            text_mask_bt=jnp.asarray(text_mask),
            image_bpd=jnp.asarray(
                rng.normal(size=(w.batch_size, w.patches, w.patch_dim)), jnp.float32
            ),
            image_mask_bp=jnp.ones((w.batch_size, w.patches), bool),
            label_b=jnp.asarray(rng.integers(0, w.num_classes, w.batch_size), jnp.int32),
        )

    targets = step.TeacherTargets(
        logits_bvc=jnp.asarray(rng.normal(size=(w.batch_size, 3, w.num_classes)), jnp.float32),
        saliency_bm=jnp.asarray(rng.random((w.batch_size, 2)), jnp.float32),
    )
    return batch(), targets, batch()


@dataclasses.dataclass
class Row:
    """One compiled train step, its live state and its timings."""

    name: str
    compiled: object
    state: step.TrainState
    args: tuple
    compile_s: float
    gflops: float
    times_s: list[float] = dataclasses.field(default_factory=list)

    def run_once(self) -> float:
        start = time.perf_counter()
        self.state, metrics = self.compiled(self.state, *self.args)
        jax.block_until_ready((self.state, metrics))
        if not np.isfinite(float(metrics["loss/total"])):
            raise FloatingPointError(f"{self.name}: non-finite loss {metrics['loss/total']}")
        return time.perf_counter() - start


def compile_row(name, graphdef, params, scheme, objective, inputs, mesh) -> Row:
    """A train step compiled ahead of time (its compile time and XLA's FLOP count)."""
    rules = models.DATA_PARALLEL_RULES
    optimizer = optax.adamw(1e-3)
    state, shardings = step.init_train_state(
        jax.tree.map(jnp.copy, params), optimizer, scheme, mesh, rules, jax.random.key(0)
    )
    train_step = step.make_train_step(
        graphdef, optimizer, scheme, step.StepConfig(objective=objective), mesh, rules, shardings
    )
    batch, targets, val_batch = inputs
    args = (batch, targets) + ((val_batch,) if scheme is not None and scheme.learned else ())
    start = time.perf_counter()
    compiled = train_step.lower(state, *args).compile()
    compile_s = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return Row(name, compiled, state, args, compile_s, float(cost.get("flops", 0.0)) / 1e9)


def run(w: Workload, warmup: int, steps: int, smoke: bool = False) -> list[dict]:
    mesh = make_mesh(MeshConfig(("data",), (-1,)))
    config = models.transformer_config(
        w.size,
        num_classes=w.num_classes,
        vocab_size=w.vocab_size,
        max_text_len=w.text_len,
        max_patches=w.patches,
        patch_dim=w.patch_dim,
    )
    # rbg keys: the jitted init compiles ~3x faster on CPU than threefry; the values don't matter.
    key = jax.random.key(0, impl="rbg")
    graphdef, params, _ = step.init_student(
        lambda: models.build_model(config, rngs=nnx.Rngs(key)), mesh, models.DATA_PARALLEL_RULES
    )
    unpacked_graphdef, _ = nnx.split(
        nnx.eval_shape(lambda: UnpackedViewsTransformer(config, rngs=nnx.Rngs(0)))
    )
    inputs = make_inputs(w)
    uniform = weighting.make_weighting("uniform")
    cases = [
        ("kd", graphdef, None, "kd"),
        ("msd/uniform", graphdef, uniform, "msd"),
        ("msd/instance", graphdef, weighting.make_weighting("instance"), "msd"),
        ("msd/learned", graphdef, weighting.make_weighting("learned"), "msd"),
        ("msd/uniform, 3 rows", unpacked_graphdef, uniform, "msd"),
    ]
    compiled = [
        compile_row(name, gdef, params, scheme, objective, inputs, mesh)
        for name, gdef, scheme, objective in (cases[:2] if smoke else cases)
    ]
    for row in compiled:
        for _ in range(warmup):
            row.run_once()
    # Round robin: every row sees the same machine conditions (the CPU may be shared).
    for _ in range(steps):
        for row in compiled:
            row.times_s.append(row.run_once())
    rows = [
        {
            "step": row.name,
            "median_ms": round(1e3 * statistics.median(row.times_s), 3),
            "min_ms": round(1e3 * min(row.times_s), 3),
            "compile_s": round(row.compile_s, 2),
            "gflops": round(row.gflops, 4),
        }
        for row in compiled
    ]
    kd_ms, kd_gflops = rows[0]["median_ms"], rows[0]["gflops"]
    num_params = sum(x.size for x in jax.tree.leaves(params))
    for row in rows:
        row |= {
            "ratio_to_kd": round(row["median_ms"] / kd_ms, 3),
            "flops_ratio_to_kd": round(row["gflops"] / kd_gflops, 3) if kd_gflops else None,
            "model": w.size,
            "params": num_params,
            "batch_size": w.batch_size,
            "devices": len(mesh.devices.flat),
        }
        print(json.dumps({"bench": "msd"} | row), flush=True)
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=Workload.batch_size)
    args = parser.parse_args(argv)
    if args.smoke:
        workload, warmup, steps = SMOKE, 1, 3
    else:
        workload = dataclasses.replace(Workload(), batch_size=args.batch_size)
        warmup, steps = args.warmup, args.steps
    rows = run(workload, warmup, steps, smoke=args.smoke)
    columns = [
        ("step", "step"),
        ("median_ms", "median ms"),
        ("min_ms", "min ms"),
        ("ratio_to_kd", "time / KD"),
        ("gflops", "GFLOP"),
        ("flops_ratio_to_kd", "FLOP / KD"),
        ("compile_s", "compile s"),
        ("model", "student"),
        ("params", "params"),
        ("batch_size", "batch"),
        ("devices", "devices"),
    ]
    name = "msd_step_smoke" if args.smoke else "msd_step"
    print(write_results(name, rows, columns, f"`{command()}` on {machine()}"))
    return rows


if __name__ == "__main__":
    main()
