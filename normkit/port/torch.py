"""PyTorch models: export or import their normkit norms (`normkit.port.huggingface.swap_norms`
turns a model's own norms into normkit's)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from normkit import dtypes
from normkit.backends import bridge
from normkit.port.convert import to_numpy
from normkit.port.files import save_norms
from normkit.port.plan import plan_import
from normkit.spec import NormSpec

__all__ = ["export_norms", "import_norms", "to_torch"]

_PARAMS = ("weight", "bias", "alpha")


def _norms(model: nn.Module) -> dict[str, nn.Module]:
    """The normkit norm layers (every module with a `NormSpec` ``spec``, DyT included)."""
    return {
        path: m
        for path, m in model.named_modules()
        if isinstance(getattr(m, "spec", None), NormSpec)
    }


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n in _PARAMS if (p := getattr(module, n, None)) is not None}


def _shape(module: nn.Module) -> tuple[int, ...]:
    """The shape of the layer's ``w`` and ``b``."""
    for name in ("weight", "bias"):
        if (p := getattr(module, name, None)) is not None:
            return tuple(p.shape)
    return tuple(getattr(module, "normalized_shape", ()))


def export_norms(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write every normkit norm of ``model`` (``named_modules`` paths, torch convention), DyT's
    ``alpha`` included."""
    layers = {name: (_params(m), m.spec) for name, m in _norms(model).items()}
    return save_norms(path, layers, convention="torch")


def import_norms(model: nn.Module, path: str | os.PathLike[str]) -> list[str]:
    """Load ``path`` into ``model``'s normkit norms in place; see `normkit.port.import_norms`."""
    norms = _norms(model)
    shapes = {name: (m.spec, _shape(m)) for name, m in norms.items()}
    planned = plan_import(path, shapes, "torch")
    with torch.no_grad():
        for name, params in planned.items():
            for param, value in params.items():
                target = getattr(norms[name], param)
                dtype = str(target.dtype).removeprefix("torch.")
                target.copy_(to_torch(dtypes.round_to(value, dtype)))
    return list(planned)


def to_torch(value: np.ndarray) -> torch.Tensor:
    """A numpy array as a torch tensor (a copy), bfloat16 included."""
    tensor: torch.Tensor = bridge("torch").to_tensor(to_numpy(value))
    return tensor
