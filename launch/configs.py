"""The config dataclasses every launcher binds in gin, registered once (gin names must be unique).

Gin files and --gin_param refer to them by class name, e.g. `RLConfig.total_steps = 2000`.
"""

from jaxrl.generation.episodes import EpisodeBudget
from jaxrl.generation.placement import GeneratorConfig
from jaxrl.infra.config import register_config
from jaxrl.infra.mesh import MeshConfig
from jaxrl.job.specs import PolicySpec, TaskSpec
from jaxrl.loop.config import RLConfig
from jaxrl.train.lora import LoraConfig
from jaxrl.train.sft import SFTConfig
from jaxrl.train.trainer import LossConfig, OptimizerConfig

for _cls in (RLConfig, MeshConfig, SFTConfig, PolicySpec, TaskSpec, LossConfig, OptimizerConfig):
    register_config(_cls)
register_config(LoraConfig)
register_config(GeneratorConfig)
register_config(EpisodeBudget)

__all__ = [
    "EpisodeBudget",
    "GeneratorConfig",
    "LoraConfig",
    "LossConfig",
    "MeshConfig",
    "OptimizerConfig",
    "PolicySpec",
    "RLConfig",
    "SFTConfig",
    "TaskSpec",
]
