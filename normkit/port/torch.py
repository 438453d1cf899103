"""PyTorch models: swap their norm layers for normkit's, and export or import their norms."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeAlias

import numpy as np
import torch
from torch import nn

from normkit import dtypes
from normkit.backends import bridge
from normkit.port.convert import to_numpy
from normkit.port.files import save_norms
from normkit.port.plan import plan_import
from normkit.spec import NormSpec
from normkit.torch.modules import LayerNorm, PartialRMSNorm, RMSNorm, from_spec

__all__ = ["HF_STYLES", "Swap", "swap_norms", "export_norms", "import_norms", "to_torch"]

Style: TypeAlias = Literal["llama", "gemma"]

#: Hugging Face RMSNorm classes by the order of their arithmetic (checked against the installed
#: transformers in tests/test_port_torch.py):
#: "llama": ``weight * (x * rsqrt(mean(x^2) + eps)).to(input_dtype)``, normalized in float32 and
#: cast before the scale (T5LayerNorm too when the weight and input share a dtype);
#: "gemma": ``(x * rsqrt(...) * (1 + weight)).type_as(x)``, the scale applied in float32 with
#: the offset 1.
HF_STYLES: dict[str, Style] = {
    "LlamaRMSNorm": "llama",
    "MistralRMSNorm": "llama",
    "MixtralRMSNorm": "llama",
    "Qwen2RMSNorm": "llama",
    "Qwen3RMSNorm": "llama",
    "T5LayerNorm": "llama",
    "GemmaRMSNorm": "gemma",
    "Gemma2RMSNorm": "gemma",
    "Gemma3RMSNorm": "gemma",
}

_NORMKIT = (RMSNorm, PartialRMSNorm, LayerNorm)


@dataclass(frozen=True)
class Swap:
    """One replaced module: its path in the model, its class name and the spec it follows."""

    path: str
    original: str
    spec: NormSpec


def swap_norms(
    module: nn.Module,
    eps: float | None = None,
    *,
    styles: Mapping[str, Style] | None = None,
) -> tuple[nn.Module, list[Swap]]:
    """Replace the norm layers in ``module`` by normkit modules computing the same function.

    Replaced: ``torch.nn.LayerNorm``, ``torch.nn.RMSNorm`` and the Hugging Face RMSNorm classes
    of `HF_STYLES` (or ``styles``, ``{class name: "llama" | "gemma"}``, for others). Each one's
    eps is read from the module (``eps`` or ``variance_epsilon``), its parameters are copied
    (same dtype, device and ``requires_grad``), and its convention becomes the spec's:

    - ``torch.nn.LayerNorm``: ``NormSpec("layer", eps, bias=<has bias>)``;
    - ``torch.nn.RMSNorm``: ``NormSpec("rms", eps)``; its ``eps=None`` (the input dtype's machine
      eps) becomes ``eps`` if given, else ``torch.finfo(torch.float32).eps`` (float32 inputs);
    - Llama style: ``NormSpec("rms", eps, cast="before_scale")``;
    - Gemma style: ``NormSpec("rms", eps, scale_offset=1.0)`` (weight stored as ``w - 1``).

    The swap is in place (a ``module`` that is itself a norm is returned replaced). A class
    whose name ends in ``RMSNorm`` and is neither known nor in ``styles`` raises ValueError
    rather than being left or guessed. Returns ``(module, swaps)``.
    """
    known = {**HF_STYLES, **(styles or {})}
    swaps: list[Swap] = []
    root = module
    for path, child in list(module.named_modules()):
        if isinstance(child, _NORMKIT):
            continue
        spec = _spec_of(path, child, eps, known)
        if spec is None:
            continue
        new = _replacement(child, spec)
        if path:
            parent, _, name = path.rpartition(".")
            setattr(module.get_submodule(parent), name, new)
        else:
            root = new
        swaps.append(Swap(path, type(child).__name__, spec))
    return root, swaps


def _spec_of(
    path: str, module: nn.Module, eps: float | None, styles: Mapping[str, Style]
) -> NormSpec | None:
    name = type(module).__name__
    where = f"{path or '<root>'} ({name})"
    if isinstance(module, nn.LayerNorm):
        return NormSpec("layer", eps=module.eps, axis=_trailing(module.normalized_shape),
                        scale=module.elementwise_affine, bias=module.bias is not None)
    if isinstance(module, nn.RMSNorm):
        if module.eps is not None:
            value = module.eps
        else:
            value = torch.finfo(torch.float32).eps if eps is None else eps
        return NormSpec("rms", eps=value, axis=_trailing(module.normalized_shape),
                        scale=module.elementwise_affine)
    style = styles.get(name)
    if style is None:
        if name.endswith("RMSNorm"):
            raise ValueError(
                f"{where}: unknown RMSNorm class; its cast order and offset decide its outputs. "
                f"Known: {sorted(styles)}; pass styles={{{name!r}: 'llama' or 'gemma'}}"
            )
        return None
    if style not in ("llama", "gemma"):
        raise ValueError(f"{where}: style {style!r} is not 'llama' or 'gemma'")
    value = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if not isinstance(value, (int, float)) or not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        raise ValueError(
            f"{where}: expected a float eps (or variance_epsilon) and a 1-d weight, got eps "
            f"{value!r} and weight {None if weight is None else tuple(weight.shape)}"
        )
    if style == "llama":
        return NormSpec("rms", eps=value, cast="before_scale")
    return NormSpec("rms", eps=value, scale_offset=1.0)


def _trailing(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(range(-len(shape), 0))


def _replacement(old: nn.Module, spec: NormSpec) -> nn.Module:
    weight = getattr(old, "weight", None)
    bias = getattr(old, "bias", None)
    if weight is not None:
        shape = tuple(weight.shape)
    else:
        shape = tuple(old.normalized_shape)
    like = weight if weight is not None else bias
    factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
    new = from_spec(spec, shape, **factory)
    with torch.no_grad():
        for name in ("weight", "bias"):
            source = getattr(old, name, None)
            if source is not None:
                target = getattr(new, name)
                target.copy_(source)
                target.requires_grad_(source.requires_grad)
    return new.train(old.training)


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
