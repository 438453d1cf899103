"""Conformance hook for torch's and Hugging Face's built-in norm modules (see `peers`)."""

from __future__ import annotations

import numpy as np
import torch

from normkit.conformance.bridges import Outputs, TorchBridge
from normkit.spec import NormSpec

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
    layer: str,
) -> Outputs:
    """``(y, dx, dweight, dbias)`` of the built-in ``layer`` over the last axis of ``x``."""
    module = _module(layer, x.shape[-1]).to(device)

    def fn(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        params = {k: v for k, v in (("weight", weight), ("bias", bias)) if v is not None}
        return torch.func.functional_call(module, params, (x,))

    return BRIDGE.vjp(fn, x, dy, scale, bias, device)
