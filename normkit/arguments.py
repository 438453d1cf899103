"""Argument types shared by the ``normkit`` subcommands; each raises a one-line error.

Used as ``argparse`` ``type=`` functions: a ValueError or ArgumentTypeError becomes
``normkit COMMAND: error: argument --x: ...`` and exit status 2, before any work starts.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from normkit.backends import device_name


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
    """Comma-separated device names."""
    return [device(d) for d in text.split(",") if d]


def names(text: str) -> list[str]:
    """Comma-separated names; commas inside brackets belong to the name (``tf[jax,jit]``)."""
    found, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            found.append(text[start:i])
            start = i + 1
    found.append(text[start:])
    return [n.strip() for n in found if n.strip()]


def output_path(text: str) -> str:
    """A file that can be written: ``-`` (stdout), or a path in an existing, writable folder."""
    if text == "-":
        return text
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def output_file(text: str) -> str:
    """Like `output_path`, without ``-``: a binary file cannot go to a terminal."""
    if text == "-":
        raise argparse.ArgumentTypeError("this file cannot be written to stdout")
    return output_path(text)


def input_file(text: str) -> str:
    """A file that exists and is not a folder."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return text


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path``, or to stdout for ``-``."""
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text)
