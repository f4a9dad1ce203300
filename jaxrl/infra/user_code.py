"""Code a launch imports by name, and code it keeps out: a user's reward or task factory named
`"package.module:attribute"` (`import_user_callable`), and torch, which no JAX launch needs
(`keep_torch_out`, `torch_hint`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable


def keep_torch_out() -> None:
    """Makes `import torch` fail in this process from now on (unless torch is imported already,
    or the environment sets JAXRL_ALLOW_TORCH=1).

    A launch never needs torch, but where it is installed `transformers` (its config modules, on
    the first `ModelConfig.to_hf()` / `load_config`) and `tensorboardX` import it at module level
    only to support torch tensors: seconds and ~1 GB of address space per process. Launchers call
    this first in their `__main__`; never in a process that may want torch later (transformers
    caches `is_torch_available()`, and a module imported meanwhile keeps no `torch` name). The
    None marker (rather than a finder that raises) keeps `importlib.util.find_spec("torch")`
    answering None, which is how transformers asks; a user module whose import then fails on
    torch gets `torch_hint` in its error.
    """
    if "torch" not in sys.modules and os.environ.get("JAXRL_ALLOW_TORCH") != "1":
        sys.modules["torch"] = None  # the import system's "not importable" marker
        # transformers would then log "PyTorch was not found ..." on import, on every launch
        logging.getLogger("transformers").addFilter(_drop_torch_notice)


def _drop_torch_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("PyTorch was not found")


def import_user_callable(name: str, what: str) -> Callable:
    """The callable `"package.module:attribute"` names (a user's reward, task factory, ...),
    with an error naming `what` it was for and the fix when it cannot be imported."""
    import importlib

    module_name, _, attribute = name.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise KeyError(
            f"{what} {name!r}: cannot import {attribute!r} from {module_name!r} ({e}"
            f"{torch_hint(e)}); is the module's directory on PYTHONPATH?"
        ) from None
    if not callable(found):
        raise TypeError(f"{what} {name!r} is not callable")
    return found


def torch_hint(error: BaseException) -> str:
    """A note for an ImportError caused by `keep_torch_out` (empty for any other error)."""
    if (
        isinstance(error, ImportError)
        and error.name == "torch"
        and sys.modules.get("torch", 0) is None
    ):
        return (
            "; jaxrl launches keep torch out of the process (transformers and tensorboardX "
            "would import it for nothing): set JAXRL_ALLOW_TORCH=1 if your code needs torch"
        )
    return ""


def raised_at(error: BaseException) -> str:
    """Where `error` was raised in the user's code, `FILE:LINE in FUNCTION: SOURCE`: the innermost
    frame of its traceback outside this library, the standard library and installed packages
    (the innermost frame when every frame is in one of them; "" without a traceback)."""
    import sysconfig
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    library = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../jaxrl
    paths = sysconfig.get_paths()
    outside = tuple(
        os.path.join(os.path.abspath(p), "")
        for p in (library, paths["stdlib"], paths["purelib"], paths["platlib"])
    )
    user = [f for f in frames if not os.path.abspath(f.filename).startswith(outside)]
    frame = (user or frames)[-1]
    where = f"{frame.filename}:{frame.lineno} in {frame.name}"
    return f"{where}: {frame.line}" if frame.line else where
