"""A checkpoint as the doctor reads it: its format, config and named tensors, whatever the file
(`normkit.doctor.read.read_checkpoint` makes one). Tensors are read one at a time, when asked
for, and nothing is ever unpickled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeAlias

import numpy as np

from normkit.spec import NormSpec

__all__ = ["FORMATS", "Checkpoint", "Format"]

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
