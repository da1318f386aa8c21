"""Typed errors of spectune; the CLI prints them as one line and exits 2.

A leaf: standard library only, importable from every layer (kernels included).
"""

from __future__ import annotations

import os


class SpectuneError(ValueError):
    """Base of spectune's typed errors; the CLI prints them as one line and exits 2."""

    def __str__(self) -> str:
        # one line, whatever a key, a value or a file name in the message holds
        return super().__str__().replace("\r", "\\r").replace("\n", "\\n")


class TableError(SpectuneError):
    """A policy/profile table is malformed. ``field`` is the dotted path of the culprit."""

    def __init__(self, field: str, reason: str, file: str | os.PathLike[str] | None = None):
        self.field = field
        self.reason = reason
        self.file = str(file) if file is not None else None
        where = f"{self.file}: " if self.file else ""
        super().__init__(f"{where}{field}: {reason}" if field else f"{where}{reason}")
