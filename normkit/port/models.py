"""Whole models: every normkit norm layer's parameters and spec, keyed by its path in the model.

The path of a layer is the chain of attribute names from the model to it, joined by ``"."``,
with list and tuple positions as decimal indices: ``model.layers[0].input_layernorm`` is
``"layers.0.input_layernorm"``. torch's ``named_modules`` and Flax NNX's ``iter_modules`` give
these paths; for Keras, normkit walks the layer's public attributes the same way (the layers of a
``Sequential`` or functional model by their ``name``). The same architecture written with the
same attribute names in two frameworks therefore has the same paths.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

from normkit.port.plan import plan_import

__all__ = ["export_norms", "import_norms", "plan_import"]


def export_norms(model: Any, path: str | os.PathLike[str]) -> Path:
    """Write every normkit norm layer of ``model`` (a torch ``nn.Module``, a Keras layer or
    model, or a Flax NNX module) to ``path``, keyed by its path in the model; see
    `normkit.port.load_norms` for the file. For a Flax linen model use
    `normkit.port.flax.export_linen_norms`. Returns the path written."""
    return _framework(model).export_norms(model, path)


def import_norms(model: Any, path: str | os.PathLike[str]) -> list[str]:
    """Load the norms in ``path`` into ``model``'s normkit norm layers, matched by path, in place.

    Every layer of the model must be in the file and every layer of the file in the model, with
    the same spec up to ``scale_offset`` (the scale is then converted, see `convert`) and the
    same parameter shapes; otherwise ValueError naming the layers. Returns the paths loaded.
    """
    return _framework(model).import_norms(model, path)


def _framework(model: Any) -> Any:
    """The ``normkit.port`` module for ``model``'s framework, found without importing any."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return importlib.import_module("normkit.port.torch")
    if "keras" in sys.modules and isinstance(model, sys.modules["keras"].layers.Layer):
        return importlib.import_module("normkit.port.keras")
    if "flax.nnx" in sys.modules and isinstance(model, sys.modules["flax.nnx"].Module):
        return importlib.import_module("normkit.port.flax")
    raise TypeError(
        f"export_norms/import_norms take a torch nn.Module, a Keras layer or a Flax NNX "
        f"module, got {type(model).__module__}.{type(model).__name__} (for Flax linen use "
        "normkit.port.flax.export_linen_norms / import_linen_norms)"
    )
