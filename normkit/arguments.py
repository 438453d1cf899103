"""Argument types shared by the ``normkit`` subcommands; each raises a one-line error.

Used as ``argparse`` ``type=`` functions: a ValueError or ArgumentTypeError becomes
``normkit COMMAND: error: argument --x: ...`` and exit status 2, before any work starts.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from normkit.backends import device_name
from normkit.files import irregular_kind, write_atomically


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def row_size(text: str) -> int:
    """An integer of at least 2 (a row to normalize)."""
    value = _int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def device(text: str) -> str:
    """A device name: ``cpu``, ``cuda:N`` (alias ``gpu:N``), ``tpu:N`` or ``mps``."""
    try:
        return device_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def devices(text: str) -> list[str]:
    """Comma-separated device names, at least one."""
    return [device(d) for d in names(text)]


def names(text: str) -> list[str]:
    """Comma-separated names, at least one and none empty; commas inside brackets belong to the
    name (``tf[jax,jit]``). A filter that names nothing would select nothing, so it is refused
    rather than read as "no filter"."""
    found, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            found.append(text[start:i])
            start = i + 1
    found.append(text[start:])
    stripped = [n.strip() for n in found]
    if not any(stripped):
        raise argparse.ArgumentTypeError(f"{text!r} names nothing: give at least one name")
    if not all(stripped):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name between its commas")
    return stripped


def output_path(text: str) -> str:
    """A file that can be written: ``-`` (stdout), or a path in an existing, writable folder
    where nothing but a regular file exists (it is replaced whole, see `write_text`)."""
    if text == "-":
        return text
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    if kind := irregular_kind(path):
        raise argparse.ArgumentTypeError(f"{text} is {kind}, not a regular file")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def add_output(parser: argparse.ArgumentParser, flag: str, what: str) -> None:
    """The option ``flag PATH``: write ``what`` to PATH, or to stdout for ``-`` (`output_path`)."""
    parser.add_argument(flag, metavar="PATH", type=output_path, help=f"write {what} (- for stdout)")


def output_file(text: str) -> str:
    """Like `output_path`, without ``-``: a binary file cannot go to a terminal."""
    if text == "-":
        raise argparse.ArgumentTypeError("this file cannot be written to stdout")
    return output_path(text)


def input_file(text: str) -> str:
    """A regular file that exists (not a folder, a named pipe or a device)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    if kind := irregular_kind(path):
        raise argparse.ArgumentTypeError(f"{text} is {kind}, not a regular file")
    return text


def write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, replacing it whole (`write_atomically`), or to stdout
    for ``-``."""
    if path == "-":
        print(text)
    else:
        write_atomically(path, lambda f: f.write(text.encode()))


def refuse_empty(**selections: object) -> None:
    """ValueError for a selection given as an empty list, which would select nothing (the
    library's functions take None for all)."""
    for name, given in selections.items():
        if given is not None and not given:
            raise ValueError(f"{name}=[] selects nothing: name at least one, or leave it out")
