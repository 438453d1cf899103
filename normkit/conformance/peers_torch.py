"""Conformance hook for torch's and Hugging Face's built-in norm modules (see `peers`)."""

from __future__ import annotations

import numpy as np
import torch

from normkit.spec import NormSpec
from normkit.torch.conformance import devices, to_numpy, to_torch

__all__ = ["devices", "evaluate"]


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
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(y, dx, dweight, dbias)`` of the built-in ``layer`` over the last axis of ``x``."""
    module = _module(layer, x.shape[-1])
    params = {"weight": scale, "bias": bias}
    for name, value in params.items():
        if value is not None:
            setattr(module, name, torch.nn.Parameter(to_torch(value, device)))
    xt = to_torch(x, device).requires_grad_(True)
    y = module(xt)
    y.backward(to_torch(dy, device).to(y.dtype))
    grads = [getattr(module, name).grad if value is not None else None for name, value in params.items()]
    return to_numpy(y), to_numpy(xt.grad), *(None if g is None else to_numpy(g) for g in grads)  # type: ignore[return-value]
