"""`load_modules`: a norms file's layers as modules of any framework, keyed by their paths."""

from __future__ import annotations

import importlib
import os
from typing import Any, Literal, TypeAlias

__all__ = ["FRAMEWORKS", "Framework", "load_modules"]

Framework: TypeAlias = Literal["torch", "keras", "nnx", "linen"]
FRAMEWORKS: dict[str, tuple[str, str, str]] = {
    "torch": ("normkit.port.torch_modules", "norms_from_file", "torch"),
    "keras": ("normkit.port.keras_modules", "norms_from_file", "tf"),
    "nnx": ("normkit.port.flax_modules", "nnx_norms_from_file", "jax"),
    "linen": ("normkit.port.flax_modules", "linen_norms_from_file", "jax"),
}


def load_modules(path: str | os.PathLike[str], framework: Framework, **kwargs: Any) -> dict[
        str, Any]:
    """Every layer of the norms file ``path`` as a normkit module of ``framework``, keyed by
    its path in the file, with the file's parameters and spec (``module.spec``): so porting a
    model's norms needs no model that mirrors their paths.

    ``framework``: ``"torch"`` (`normkit.port.torch_modules.norms_from_file`), ``"keras"``
    (built layers), ``"nnx"`` (Flax NNX modules) or ``"linen"`` (``(module, variables)``
    pairs). ``kwargs`` go to that function. ImportError naming the extra when the framework is
    not installed.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework={framework!r} is not one of {sorted(FRAMEWORKS)}")
    module_name, function, extra = FRAMEWORKS[framework]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"load_modules(framework={framework!r}) needs: pip install 'normkit[{extra}]' ({err})"
        ) from err
    loaded: dict[str, Any] = getattr(module, function)(path, **kwargs)
    return loaded
