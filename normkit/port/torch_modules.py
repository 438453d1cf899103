"""torch norm modules straight from a norms file: no model to mirror the file's layers."""

from __future__ import annotations

import os

import numpy as np
import torch

from normkit.port.files import load_norms
from normkit.port.torch import to_torch
from normkit.torch.kernels import Kernel
from normkit.torch.modules import DyT, GatedRMSNorm, LayerNorm, PartialRMSNorm, RMSNorm, from_spec

__all__ = ["norms_from_file"]

Module = RMSNorm | GatedRMSNorm | PartialRMSNorm | LayerNorm | DyT


def norms_from_file(
    path: str | os.PathLike[str], *, device: torch.device | str | None = None,
    kernel: Kernel = "auto",
) -> dict[str, Module]:
    """Every layer of the norms file ``path`` as a normkit torch module (`from_spec` of its
    spec), keyed by its path in the file, its parameters the file's (values and dtype; DyT's
    ``alpha`` included) on ``device``. Each module's ``spec`` is the file's."""
    modules: dict[str, Module] = {}
    for name, (params, spec) in load_norms(path, to="torch").items():
        shaped = [v for p, v in params.items() if p != "alpha"]
        shape = tuple(shaped[0].shape) if shaped else (1,) * np.size(spec.axis)
        dtype = to_torch(next(iter(params.values()))).dtype if params else None
        module = from_spec(spec, shape, device=device, dtype=dtype, kernel=kernel)
        with torch.no_grad():
            for param, value in params.items():
                getattr(module, param).copy_(to_torch(value))
        modules[name] = module
    return modules
