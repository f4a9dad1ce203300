"""Paths as users type them: `~` expanded wherever a flag or a config field takes a path.

A shell expands `~` only at the start of a word (and after `=` in a variable assignment), so
`--hf_dir=~/models/x` and `PolicySpec.init_from = '~/models/x'` reach the program with the `~`
still in them. Launchers pass their path flags through `user_path` (an argparse `type=`), and
config fields that name files are stored absolute (`run_path`), so that a run's `config.gin`
finds them from any working directory.
"""

from __future__ import annotations

import os


def user_path(path: str) -> str:
    """`path` with a leading `~` / `~user` expanded; anything else (`-`, "") as given."""
    return os.path.expanduser(path) if isinstance(path, str) else path


def run_path(path: str) -> str:
    """`path` expanded (`user_path`) and made absolute against the working directory; "" stays
    "" (an unset path)."""
    return os.path.abspath(user_path(path)) if path else path


def missing_dir_message(path: str, what: str) -> str | None:
    """Why `path` is not a directory holding `what`, or None when it is a directory."""
    if os.path.isdir(path):
        return None
    if os.path.exists(path):
        return f"{path} is a file, not a directory ({what})"
    return f"{path} does not exist (expected {what})"
