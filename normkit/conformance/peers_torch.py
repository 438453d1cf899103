"""Conformance hook for torch's and Hugging Face's built-in norm modules (see `peers`).

The Hugging Face modules are built from their classes with their configurations' default eps;
nothing is downloaded.
"""

from __future__ import annotations

import numpy as np
import torch

from normkit.bridges import FrameworkFn, TorchBridge
from normkit.conformance.harness import Harness
from normkit.spec import NormSpec

LAYERS = (
    "torch.nn.RMSNorm", "torch.nn.LayerNorm", "transformers.LlamaRMSNorm",
    "transformers.GemmaRMSNorm", "transformers.Gemma3RMSNorm", "transformers.T5LayerNorm",
    "transformers.Qwen3RMSNorm", "transformers.Olmo2RMSNorm", "transformers.CohereLayerNorm",
)
WEIGHTS = ("input", "float32")
VARIANTS: dict[str, tuple[object, ...] | None] = {"layer": LAYERS, "weights": WEIGHTS}


def _transformers(layer: str, n: int) -> torch.nn.Module:
    """The Hugging Face module of size ``n``, with the eps its model's configuration uses."""
    import transformers.models as hf

    if layer == "transformers.LlamaRMSNorm":
        eps = hf.llama.LlamaConfig().rms_norm_eps
        return hf.llama.modeling_llama.LlamaRMSNorm(n, eps=eps)
    if layer == "transformers.GemmaRMSNorm":
        return hf.gemma.modeling_gemma.GemmaRMSNorm(n, eps=hf.gemma.GemmaConfig().rms_norm_eps)
    if layer == "transformers.Gemma3RMSNorm":
        eps = hf.gemma3.Gemma3TextConfig().rms_norm_eps
        return hf.gemma3.modeling_gemma3.Gemma3RMSNorm(n, eps=eps)
    if layer == "transformers.T5LayerNorm":
        eps = hf.t5.T5Config().layer_norm_epsilon
        return hf.t5.modeling_t5.T5LayerNorm(n, eps=eps)
    if layer == "transformers.Qwen3RMSNorm":  # q_norm: Qwen3RMSNorm(head_dim)
        eps = hf.qwen3.Qwen3Config().rms_norm_eps
        return hf.qwen3.modeling_qwen3.Qwen3RMSNorm(n, eps=eps)
    if layer == "transformers.Olmo2RMSNorm":  # q_norm: Olmo2RMSNorm(heads * head_dim)
        eps = hf.olmo2.Olmo2Config().rms_norm_eps
        return hf.olmo2.modeling_olmo2.Olmo2RMSNorm(n, eps)
    if layer == "transformers.CohereLayerNorm":
        cohere_eps = hf.cohere.CohereConfig().layer_norm_eps
        return hf.cohere.modeling_cohere.CohereLayerNorm(n, eps=cohere_eps)
    raise ValueError(f"unknown torch peer {layer!r}")


def _module(layer: str, n: int) -> torch.nn.Module:
    if layer == "torch.nn.RMSNorm":
        return torch.nn.RMSNorm(n)
    if layer == "torch.nn.LayerNorm":
        return torch.nn.LayerNorm(n)
    return _transformers(layer, n)


def build(
    spec: NormSpec, shape: tuple[int, ...], param_dtype: np.dtype, *, dtype: np.dtype,
    device: str, layer: str, weights: str,
) -> FrameworkFn:
    """The built-in ``layer`` over the last axis of the input (`peer_function`)."""
    del spec, param_dtype, dtype  # the peer is what it is; the case's spec is what it claims
    return peer_function(layer, shape[-1], device, weights)


def peer_function(
    layer: str, n: int, device: str = "cpu", weights: str = "input"
) -> FrameworkFn:
    """``fn(x, scale, bias)``: the built-in ``layer`` of size ``n`` with those parameters, kept
    in the input's dtype (``weights="input"``: ``module.to(x.dtype)``) or in float32."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r} is invalid: expected one of {list(WEIGHTS)}")
    module = _module(layer, n).to(device)
    names = {name for name, _ in module.named_parameters()}

    def fn(
        x: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        dtype = x.dtype if weights == "input" else torch.float32
        given = (("weight", scale), ("bias", bias))
        params = {k: v.to(dtype) for k, v in given if v is not None and k in names}
        return torch.func.functional_call(module.to(dtype), params, (x,))

    return fn


_HARNESS = Harness(TorchBridge(), build, VARIANTS)
devices, evaluate, identify = _HARNESS.devices, _HARNESS.evaluate, _HARNESS.identify
