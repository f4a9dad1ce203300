"""jaxrl: LlamaRL-style asynchronous RL for LLMs in JAX / Flax NNX.

Importing the package settles JAX's platform before JAX starts: on a machine with no GPU or TPU
attached, JAX_PLATFORMS=cpu unless set, and JAX's start without the log lines of installed
accelerator plugins that have nothing to drive (`jaxrl.infra.platforms`).
"""

from jaxrl.infra import platforms as _platforms

_platforms.prepare()
