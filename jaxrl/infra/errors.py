"""Errors a launch reports in one line, without a traceback: the user's input is at fault."""

from __future__ import annotations


class DataError(ValueError):
    """A data file the run was pointed at is malformed or holds nothing usable; the message
    names the file (and the line) and what is wrong there."""
