"""The train step at depth: compile time of scanned vs unrolled layers, and activation memory per
remat policy, both read from XLA on one CPU device (the program sizes and buffer plans are the
compiler's, not timings of this machine's cores).

- compile: the SFT train step (forward, backward, AdamW) of a model of rlbench-tiny width
  (hidden 256, MLP 768, 8 heads, 4 KV heads, vocab 512), 4 and 32 layers, scanned and unrolled,
  lowered and compiled ahead of time from abstract inputs (batch 8 x 128 tokens): seconds to
  trace + lower and to compile, and the number of HLO instructions.
- memory: the same step of a 16-layer model at sequence length 1024 (batch 4) under every remat
  policy: `compiled.memory_analysis()` temp bytes (activations kept for the backward pass and
  scratch), against the policy "none".

    python -m bench.trainer_scale            # the settings above
    python -m bench.trainer_scale --smoke    # tiny sizes (CI)
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import optax

from bench.common import command, machine, write_results
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.models.config import ModelConfig
from jaxrl.models.remat import REMAT_POLICIES
from jaxrl.train.trainer import Trainer


def _config(layers: int, scan: bool, remat: str, width: int) -> ModelConfig:
    return ModelConfig(
        "llama", 512, width, 3 * width, layers, 8, 4, width // 8,
        scan_layers=scan, remat_policy=remat,
    )  # fmt: skip


def compile_step(config: ModelConfig, batch: int, length: int) -> dict:
    """Lowers and compiles the SFT step from abstract inputs; returns timings and XLA's figures."""
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1))
    trainer = Trainer(config, mesh, TRAINER_RULES, optax.adamw(1e-3))
    batch_spec = {
        "tokens_bs": jax.ShapeDtypeStruct((batch, length), jnp.int32),
        "loss_mask_bs": jax.ShapeDtypeStruct((batch, length), jnp.bool_),
    }
    start = time.perf_counter()
    with trainer._context():
        lowered = trainer._sft.lower(trainer.abstract_state(), batch_spec, None)
    lowered_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "lower_s": round(lowered_s, 3),
        "compile_s": round(compile_s, 3),
        "hlo_instructions": compiled.as_text().count("\n"),
        "temp_mb": round(memory.temp_size_in_bytes / 2**20, 2),
        "argument_mb": round(memory.argument_size_in_bytes / 2**20, 2),
        "gflop": round(float(cost.get("flops", 0.0)) / 1e9, 3),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    width, (shallow, deep), mem_layers, mem_len, mem_batch = 256, (4, 32), 16, 1024, 4
    policies = [p for p in REMAT_POLICIES if p != "offload_qkv_proj"]  # no host space on CPU
    if args.smoke:
        width, (shallow, deep), mem_layers, mem_len, mem_batch = 32, (2, 3), 2, 32, 2
        policies = ["none", "full"]
    layouts = (True,) if args.smoke else (True, False)
    # The smoke's compile rows take the memory rows' batch, so that its `none` memory row is the
    # shallow compile row's program (same layers, layout, remat, shapes): compiled once.
    batch, length = (mem_batch, 32) if args.smoke else (8, 128)
    compiled: dict[tuple, dict] = {}

    def compile_once(layers, scan, remat, batch, length) -> dict:
        key = (layers, scan, remat, batch, length)
        if key not in compiled:
            compiled[key] = compile_step(_config(layers, scan, remat, width), batch, length)
        return compiled[key]

    compile_rows = []
    for scan in layouts:
        for layers in (shallow, deep):
            row = {"layers": layers, "layout": "scanned" if scan else "unrolled"}
            row |= compile_once(layers, scan, "none", batch, length)
            print(json.dumps({"bench": "trainer_compile", **row}), flush=True)
            compile_rows.append(row)
    by = {(r["layout"], r["layers"]): r for r in compile_rows}
    for layout in {r["layout"] for r in compile_rows}:
        ratio = by[(layout, deep)]["compile_s"] / by[(layout, shallow)]["compile_s"]
        by[(layout, deep)]["vs_shallow"] = round(ratio, 2)

    memory_rows = []
    for policy in policies:
        row = {"policy": policy, "layers": mem_layers, "length": mem_len, "batch": mem_batch}
        row |= compile_once(mem_layers, True, policy, mem_batch, mem_len)
        print(json.dumps({"bench": "trainer_memory", **row}), flush=True)
        memory_rows.append(row)
    none = next(r for r in memory_rows if r["policy"] == "none")["temp_mb"]
    for row in memory_rows:
        row["temp_vs_none"] = round(row["temp_mb"] / none, 3)

    note = f"`{command()}` on {machine()}"
    print(
        write_results(
            "trainer_compile" + ("_smoke" if args.smoke else ""),
            compile_rows,
            [
                ("layout", "layout"), ("layers", "layers"), ("lower_s", "trace + lower s"),
                ("compile_s", "compile s"), ("vs_shallow", f"compile vs {shallow} layers"),
                ("hlo_instructions", "HLO lines"), ("gflop", "GFLOP / step"),
            ],
            note,
        )
    )  # fmt: skip
    print(
        write_results(
            "trainer_memory" + ("_smoke" if args.smoke else ""),
            memory_rows,
            [
                ("policy", "remat policy"), ("layers", "layers"), ("length", "sequence"),
                ("batch", "batch"), ("temp_mb", "temp MB"), ("temp_vs_none", "vs none"),
                ("gflop", "GFLOP / step"), ("compile_s", "compile s"),
            ],
            note,
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
