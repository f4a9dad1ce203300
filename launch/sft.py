"""Supervised warm start on the task's demonstrations.

python -m launch.sft --gin_file=configs/sft/arith_tiny.gin --workdir=runs/sft
"""

from __future__ import annotations

import gin

from jaxrl.infra.distributed import initialize_from_argv
from jaxrl.infra.launcher import launch
from jaxrl.infra.user_code import keep_torch_out
from jaxrl.train.sft import run_sft
from launch.configs import MeshConfig, PolicySpec, SFTConfig, TaskSpec


@gin.configurable
def sft_main(
    workdir: str,
    policy: PolicySpec = gin.REQUIRED,
    task: TaskSpec = gin.REQUIRED,
    sft: SFTConfig = gin.REQUIRED,
    mesh: MeshConfig = MeshConfig(("fsdp", "tp"), (1, 1)),
) -> None:
    run_sft(workdir, policy, task, sft, mesh)
    print(f"SFT finished: checkpoints in {workdir}/checkpoints, metrics in {workdir}/metrics.jsonl")


if __name__ == "__main__":
    keep_torch_out()
    launch(sft_main, initialize_from_argv(), description=__doc__.splitlines()[0])
