"""jaxrl: LlamaRL-style asynchronous RL for LLMs in JAX / Flax NNX.

Importing the package settles JAX's platform before JAX starts: on a machine with no GPU or TPU
attached, JAX_PLATFORMS=cpu unless set, and JAX's start without the log lines of installed
accelerator plugins that have nothing to drive (`jaxrl.infra.platforms`). It also keeps the old
paths of moved modules importable for one release (`jaxrl.trainer` -> `jaxrl.train.trainer`, ...:
`jaxrl.infra.moved_modules`), each name warning with its new home.
"""

import importlib as _importlib

from jaxrl.infra import moved as _moved
from jaxrl.infra import moved_modules as _moved_modules
from jaxrl.infra import platforms as _platforms

_platforms.prepare()
_moved.install_aliases(_moved_modules.MOVED_MODULES)


def __getattr__(name: str):
    """`jaxrl.<old module>` read before anything imported it (e.g. `jaxrl.workdir` after
    `import jaxrl`): the alias module, imported now."""
    if f"{__name__}.{name}" in _moved_modules.MOVED_MODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
