"""Whether a change leaves the CPU programs as they were: SHA-256 of the optimized HLO (source
tables and metadata stripped) of the engine's prefill and decode and of the RL train step
(padded and packed) of a tiny model, unrolled and scanned, on 8 simulated CPU devices.

    python -m bench.cpu_hlo_hash > new.txt
    git worktree add /tmp/old <commit> && (cd /tmp/old && python -m bench.cpu_hlo_hash > old.txt)
    diff old.txt new.txt     # equal: the same compiled CPU programs, so the same CPU speed

(run from the tree to hash, with the same venv: `python -m` imports `jaxrl` from the current
directory).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def normalized_hash(text: str) -> str:
    """The HLO without its source-location tables and instruction metadata, hashed."""
    text = re.sub(r",? ?metadata=\{[^}]*\}", "", text)
    text = re.sub(r"stack_frame_id=\d+", "", text)
    text = text[min(x for x in (text.find("\n%"), text.find("\nENTRY")) if x >= 0) :]
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    import jax
    from flax import nnx

    from jaxrl.generation.engine import Engine
    from jaxrl.generation.sampling import SamplingConfig
    from jaxrl.infra import sharding as ax
    from jaxrl.infra.mesh import MeshConfig, make_mesh
    from jaxrl.models.config import ModelConfig
    from jaxrl.models.transformer import Transformer
    from jaxrl.plan.programs import abstract_rollout_batch
    from jaxrl.train.trainer import LossConfig, OptimizerConfig, Trainer

    for scan in (False, True):
        c = ModelConfig(
            "llama", 256, 64, 128, 2, 4, 2, 16, max_position_embeddings=256, scan_layers=scan
        )
        model = Transformer(c, rngs=nnx.Rngs(0))
        engine, params = Engine.for_model(model, num_slots=8, steps_per_call=4, max_total_len=128)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        programs = (
            ("prefill", engine.lower_prefill(abstract, 2, 32)),
            ("decode", engine.lower_decode(abstract, SamplingConfig(16))),
        )
        for name, lowered in programs:
            print(f"{name} scan={scan}", normalized_hash(lowered.compile().as_text()))
        mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2)), jax.devices()[:4])
        for pack in (0, 96):
            trainer = Trainer(
                c, mesh, ax.TRAINER_RULES, OptimizerConfig(learning_rate=1e-5).make(10),
                loss=LossConfig(name="grpo"), pack_length=pack,
            )  # fmt: skip
            lowered = trainer.lower_rl_step(abstract_rollout_batch(8, 32, 32))
            print(f"train pack={pack} scan={scan}", normalized_hash(lowered.compile().as_text()))


if __name__ == "__main__":
    main()
