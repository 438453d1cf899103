"""normkit's own norms files (`normkit.port.save_norms`): every tensor with its layer's spec."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from normkit.doctor.checkpoint import Checkpoint
from normkit.port.files import load_norms
from normkit.spec import NormSpec

__all__ = ["read_norms_file"]


def read_norms_file(path: Path) -> Checkpoint:
    """The norms file ``path``, its tensors named ``"<layer path>.weight"`` / ``".bias"``
    (torch's names, whatever the file's convention), with their layers' specs. DyT's ``alpha``
    is not a norm's scale and is left out."""
    layers = load_norms(path, to="torch")
    tensors: dict[str, np.ndarray] = {}
    specs: dict[str, NormSpec] = {}
    for layer, (params, spec) in layers.items():
        for param in ("weight", "bias"):
            if param in params:
                name = f"{layer}.{param}" if layer else param
                tensors[name] = params[param]
                specs[name] = spec
    return Checkpoint(
        path=path,
        format="normkit",
        architecture=None,
        config={},
        names=tuple(tensors),
        load=tensors.__getitem__,
        specs=specs,
    )
