"""`read_checkpoint`: recognise a checkpoint's format from its path and read it with that
format's reader (a directory with ``config.json``: a Hugging Face or mlx-lm model; a file
starting with ``GGUF``; a normkit norms file)."""

from __future__ import annotations

import os
from pathlib import Path

from normkit.doctor.checkpoint import Checkpoint
from normkit.files import open_regular

__all__ = ["read_checkpoint"]


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint at ``path``: a directory with ``config.json`` and safetensors (Hugging
    Face, or mlx-lm when its files say ``{"format": "mlx"}``), a GGUF file, or a normkit norms
    file (safetensors or ``.npz``).

    Raises ValueError naming the problem: a directory without ``config.json`` or with pickle
    weights only, a file of another kind; ImportError naming the extra for GGUF files.
    """
    path = Path(path)
    if path.is_dir():
        from normkit.doctor.read_safetensors import read_directory

        return read_directory(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    with open_regular(path) as f:
        head = f.read(4)
    if head == b"GGUF":
        from normkit.doctor.read_gguf import read_gguf

        return read_gguf(path)
    from normkit.doctor.read_norms import read_norms_file

    return read_norms_file(path)
