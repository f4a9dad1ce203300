"""Errors a launch reports in one line, without a traceback: the user's input is at fault."""

from __future__ import annotations


class UserError(Exception):
    """An error in what the user gave the run (a data file, a process layout, a reward function);
    the message names what is wrong and the fix. `jaxrl.infra.launcher.launch` prints it as one
    line, `kind: message`, and exits with status 1."""

    kind = "error"
    # An instance whose `from_user_code` is True wraps an exception raised in the user's own
    # code, whose full traceback JAXRL_TRACEBACK=1 prints (the line says so). No class default:
    # gin re-raises an error as a proxy subclass, which finds the instance's attributes only
    # where its class has none.


class DataError(UserError, ValueError):
    """A data file the run was pointed at is malformed or holds nothing usable; the message
    names the file (and the line) and what is wrong there."""

    kind = "data error"
