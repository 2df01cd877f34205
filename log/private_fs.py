"""Steward's files are its own: data files 0600, directories 0700, whatever the umask.

Ledgers, snapshots, the code store and the worker's artifact cache hold tenants' code,
parameters and results; other local users must not read them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

FILE_MODE: Final = 0o600
DIR_MODE: Final = 0o700


def make_private_dirs(directory: str | os.PathLike[str]) -> None:
    """Create ``directory`` and its missing parents with mode 0700.

    Directories that already exist keep their mode: one given by an operator (``/srv``,
    ``/tmp``) is not ours to change.
    """
    path = Path(os.path.abspath(directory))
    missing: list[Path] = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for created in reversed(missing):
        try:
            os.mkdir(created, DIR_MODE)
        except FileExistsError:
            if not created.is_dir():
                raise
            continue  # made by another process meanwhile: its creator set the mode
        os.chmod(created, DIR_MODE)  # mkdir's mode is filtered by the umask


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open`` creating the file with mode 0600 (an existing file keeps its mode)."""
    return os.open(path, flags, FILE_MODE)
