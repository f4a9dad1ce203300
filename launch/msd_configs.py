"""The MSD config dataclasses, registered in gin once (gin names must be unique program-wide).

Gin files and --gin_param refer to them by class name, e.g. `StudyConfig.seeds = (0, 1, 2)`;
`MeshConfig` is the one `launch.configs` registers for every launcher.
"""

from jaxrl.infra.config import register_config
from launch.configs import MeshConfig
from msd_jax.data import DigitsCaptionConfig, JsonlDataConfig
from msd_jax.study import StudyConfig, TeacherConfig
from msd_jax.train import ModelSpec, TrainConfig

for _cls in (
    DigitsCaptionConfig,
    JsonlDataConfig,
    ModelSpec,
    TrainConfig,
    TeacherConfig,
    StudyConfig,
):
    register_config(_cls)

__all__ = [
    "DigitsCaptionConfig",
    "JsonlDataConfig",
    "MeshConfig",
    "ModelSpec",
    "StudyConfig",
    "TeacherConfig",
    "TrainConfig",
]
