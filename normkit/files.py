"""Reading and writing files safely: regular files only, and writes that replace a file whole.

Norms files (`normkit.port`) and the reports and figures of the ``normkit`` commands go through
these. A path that is not a regular file (a named pipe, a device, a directory, a symlink to one)
is refused without waiting on it, and a file is written to a temporary file beside it, flushed to
disk and renamed over the destination, so an interrupted write (a crash, a kill, a full disk)
leaves the previous file intact.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["irregular_kind", "open_regular", "write_atomically"]


def irregular_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is (after symlinks) when it exists and is not a regular file, e.g.
    ``"a named pipe (FIFO)"``; None for a regular file or a path where nothing exists."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return None if stat.S_ISREG(mode) else _kind(mode)


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for binary reading if it is a regular file (after symlinks).

    It is opened without blocking and checked before a byte is read, so a named pipe, a device,
    a socket or a directory (or a symlink to one) raises ValueError naming it instead of
    waiting for a writer or reading forever. A missing or unreadable file raises OSError.
    """
    if kind := irregular_kind(path):
        raise _not_regular(path, kind, "nothing was read")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # replaced since the check above
        os.close(fd)
        raise _not_regular(path, _kind(mode), "nothing was read")
    return os.fdopen(fd, "rb")


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """Write a file with ``write(file)``: into a new file beside ``path``, flushed and fsynced,
    then renamed over ``path`` (after symlinks, so a link keeps pointing to the new file).

    ``path`` therefore holds its old contents or the new ones, never part of either: if
    ``write`` raises (a full disk, an interrupt), the new file is removed and the old one is
    untouched; a process killed mid-write leaves the new file as ``.NAME.<hex>.tmp``. The file
    gets the mode of the file it replaces, else the umask's. A destination that exists and is
    not a regular file is refused (ValueError) rather than replaced.
    Returns the path written.
    """
    target = Path(os.path.realpath(path))
    if kind := irregular_kind(target):
        raise _not_regular(path, kind, "nothing was written")
    try:
        keep_mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        keep_mode = None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(temporary, flags, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            if keep_mode is not None:
                os.chmod(temporary, keep_mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _sync_folder(target.parent)
    return Path(path)


def _sync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries (the rename) to disk where the platform allows it."""
    with contextlib.suppress(OSError):  # Windows opens no folder; some file systems sync none
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _not_regular(path: str | os.PathLike[str], kind: str, outcome: str) -> ValueError:
    resolved = os.path.realpath(path)
    via = f" (a symlink to {resolved})" if resolved != os.path.abspath(path) else ""
    return ValueError(f"{path}: is {kind}{via}, not a regular file ({outcome})")
