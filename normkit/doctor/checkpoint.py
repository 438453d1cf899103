"""A checkpoint as the doctor reads it: its format, config and named tensors, whatever the file.

`read_checkpoint` recognises the format from the path (a directory with ``config.json``: a
Hugging Face or mlx-lm model; a file starting with ``GGUF``; a normkit norms file) and hands it
to that format's reader. Tensors are read one at a time, when asked for, and nothing is ever
unpickled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeAlias

import numpy as np

from normkit.files import open_regular
from normkit.spec import NormSpec

__all__ = ["FORMATS", "Checkpoint", "Format", "read_checkpoint"]

Format: TypeAlias = Literal["huggingface", "mlx-lm", "gguf", "normkit"]
FORMATS: tuple[Format, ...] = ("huggingface", "mlx-lm", "gguf", "normkit")


@dataclass(frozen=True)
class Checkpoint:
    """A read checkpoint.

    ``config``: ``config.json`` (Hugging Face, mlx-lm), the GGUF metadata (``{key: value}``) or
    the normkit file's metadata. ``names``: every tensor's name. ``specs``: for a normkit file,
    the `NormSpec` of each tensor's layer. ``files``: for a directory, the file holding each
    tensor.
    """

    path: Path
    format: Format
    architecture: str | None
    config: Mapping[str, Any]
    names: tuple[str, ...]
    load: Callable[[str], np.ndarray] = field(repr=False)
    specs: Mapping[str, NormSpec] = field(default_factory=dict)
    files: Mapping[str, Path] = field(default_factory=dict)

    def tensor(self, name: str) -> np.ndarray:
        """The stored tensor ``name`` (bfloat16 as ``ml_dtypes.bfloat16``)."""
        return self.load(name)


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
