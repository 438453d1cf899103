"""Conformance hook for torch's and Hugging Face's built-in norm modules (see `peers`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from normkit.backends import FrameworkFn, Outputs
from normkit.bridges import TorchBridge
from normkit.conformance.targets import check_variant
from normkit.identify import Identification
from normkit.identify import identify as identify_fn
from normkit.spec import NormSpec

LAYERS = ("torch.nn.RMSNorm", "torch.nn.LayerNorm", "transformers.LlamaRMSNorm",
               "transformers.GemmaRMSNorm")
VARIANTS: dict[str, tuple[object, ...] | None] = {"layer": LAYERS}
BRIDGE = TorchBridge()
devices = BRIDGE.devices


def _module(layer: str, n: int) -> torch.nn.Module:
    if layer == "torch.nn.RMSNorm":
        return torch.nn.RMSNorm(n)
    if layer == "torch.nn.LayerNorm":
        return torch.nn.LayerNorm(n)
    if layer == "transformers.LlamaRMSNorm":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        return LlamaRMSNorm(n, eps=1e-6)
    if layer == "transformers.GemmaRMSNorm":
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

        return GemmaRMSNorm(n, eps=1e-6)
    raise ValueError(f"unknown torch peer {layer!r}")


def evaluate(
    spec: NormSpec,
    x: np.ndarray,
    dy: np.ndarray,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    device: str = "cpu",
    **variant: Any,
) -> Outputs:
    """``(y, dx, dweight, dbias)`` of the built-in ``layer`` over the last axis of ``x``."""
    check_variant(variant, VARIANTS)
    layer = str(variant["layer"])
    return BRIDGE.vjp(peer_function(layer, x.shape[-1], device), x, dy, scale, bias, device)


def peer_function(layer: str, n: int, device: str = "cpu") -> FrameworkFn:
    """``fn(x, weight, bias)``: the built-in ``layer`` of size ``n`` with those parameters."""
    module = _module(layer, n).to(device)
    names = {name for name, _ in module.named_parameters()}

    def fn(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        given = (("weight", weight), ("bias", bias))
        params = {k: v.to(x.dtype) for k, v in given if v is not None and k in names}
        return torch.func.functional_call(module.to(x.dtype), params, (x,))

    return fn


def identify(*, layer: str, n: int = 64, device: str = "cpu") -> Identification:
    """What the built-in ``layer`` computes, probed with parameters in the input's dtype."""
    return identify_fn(
        peer_function(layer, n, device), (n,), backend="torch", params=True, device=device
    )
