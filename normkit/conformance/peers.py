"""The frameworks' built-in norm layers, each paired with the NormSpec it follows.

Each peer is checked as people use it: torch modules and Hugging Face's with parameters in the
input's dtype (``module.to(dtype)``) or, where a model keeps them so, in float32 with half
activations; Keras layers under the ``mixed_<dtype>`` policy for half inputs (float32
variables); Flax modules with their default float32 ``param_dtype``. Every module is built
locally from its class and its model configuration's default eps (no download). Where a peer
departs from its spec, the conformance report shows where.

The specs, from each installed source: Flax's LayerNorm uses ``use_fast_variance=True`` and
returns ``result_type(x, params)``; Keras' LayerNormalization on TensorFlow takes its variance
from ``tf.nn.moments`` (two-pass); Hugging Face's Gemma and Gemma3 compute ``1 + w`` in float32
and apply it before the single cast to the input dtype; T5 casts ``ŷ`` only to a half weight's
dtype, so a float32 weight gives a float32 result; Qwen3 normalizes the head dimension with
Llama's arithmetic, OLMo2 the whole projection with Gemma's order (``(w * ŷ).to(dtype)``);
Cohere's LayerNorm subtracts the mean and has no bias.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

from normkit.conformance.cases import CASE_DTYPES, FULL_SHAPES, Case
from normkit.conformance.targets import Target
from normkit.spec import NormSpec

FLOAT32_EPS = float(np.finfo(np.float32).eps)
QUICK_SHAPES: tuple[tuple[int, ...], ...] = ((5, 7), (8, 1024))

# Peers whose input has a fixed layout: the shapes of their cases (full, quick).
# Qwen3's q/k norm sees (tokens, heads, head_dim) and normalizes head_dim with one weight shared
# by every head; OLMo2's sees the whole projection (tokens, heads * head_dim). Hugging Face's
# rotary embeddings need an even head_dim.
LAYOUT_SHAPES: dict[str, tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]] = {
    "transformers.Qwen3RMSNorm[q_norm]": (
        ((6, 2, 2), (5, 3, 8), (4, 8, 128)),
        ((5, 3, 8), (4, 8, 128)),
    ),
    "transformers.Olmo2RMSNorm[q_norm]": (((6, 4), (5, 24), (4, 1024)), ((5, 24), (4, 1024))),
}


def _torch(
    name: str,
    claims: NormSpec,
    note: str,
    *,
    layer: str | None = None,
    weights: str = "input",
) -> Target:
    """A torch or Hugging Face module; ``weights`` the dtype its parameters are kept in:
    ``"input"`` (``module.to(dtype)``) or ``"float32"`` (with half activations)."""
    packages = ("transformers",) if name.startswith("transformers.") else ()
    return Target(
        name, ("torch",), "normkit.conformance.peers_torch",
        {"layer": layer or name, "weights": weights}, packages=packages, claims=claims,
        params_in_input_dtype=weights == "input", note=note,
    )


def _keras(name: str, claims: NormSpec, note: str) -> Target:
    return Target(
        name, ("tf",), "normkit.conformance.peers_keras", {"layer": name}, claims=claims, note=note
    )


def _flax(name: str, claims: NormSpec, note: str) -> Target:
    return Target(
        name, ("jax",), "normkit.conformance.peers_flax", {"layer": name}, claims=claims, note=note
    )


LLAMA = NormSpec("rms", eps=1e-6, cast="before_scale")
FLAX_RMS = NormSpec("rms", eps=1e-6, output_dtype="promote")
FLAX_LAYER = NormSpec("layer", eps=1e-6, variance="fast", output_dtype="promote")

PEERS: tuple[Target, ...] = (
    _torch(
        "torch.nn.RMSNorm",
        NormSpec("rms", eps=FLOAT32_EPS),
        "eps=None: the float32 machine eps is the value it appears to use",
    ),
    _torch("torch.nn.LayerNorm", NormSpec("layer", eps=1e-5), "default eps 1e-5"),
    _torch(
        "transformers.LlamaRMSNorm",
        LLAMA,
        "Llama order: cast, then weight; checked against the exact backward",
    ),
    _torch(
        "transformers.LlamaRMSNorm[autograd]",
        LLAMA.replace(backward="autograd"),
        "the same module checked against the rounding model of autograd",
        layer="transformers.LlamaRMSNorm",
    ),
    _torch(
        "transformers.LlamaRMSNorm[float32-weight]",
        LLAMA.replace(output_dtype="promote", backward="autograd"),
        "float32 weight, half activations: the float32 weight times the half ŷ is float32",
        layer="transformers.LlamaRMSNorm",
        weights="float32",
    ),
    _torch(
        "transformers.GemmaRMSNorm",
        NormSpec("rms", eps=1e-6, scale_offset=1.0),
        "weight stored as w - 1, 1 + w in float32",
    ),
    _torch(
        "transformers.Gemma3RMSNorm[float32-weight]",
        NormSpec("rms", eps=1e-6, scale_offset=1.0),
        "Gemma's order, (x * (1 + w)).type_as(x): the input dtype even with a float32 weight",
        layer="transformers.Gemma3RMSNorm",
        weights="float32",
    ),
    _torch(
        "transformers.T5LayerNorm[float32-weight]",
        NormSpec("rms", eps=1e-6, output_dtype="promote"),
        "float32 weight: no cast before the weight, the float32 result is returned",
        layer="transformers.T5LayerNorm",
        weights="float32",
    ),
    _torch(
        "transformers.Qwen3RMSNorm[q_norm]",
        LLAMA.replace(backward="autograd"),
        "q/k norm over head_dim of (tokens, heads, head_dim), one weight for every head",
        layer="transformers.Qwen3RMSNorm",
    ),
    _torch(
        "transformers.Olmo2RMSNorm[q_norm]",
        NormSpec("rms", eps=1e-5),
        "q/k norm over the whole projection (heads * head_dim); (w * ŷ).to(dtype)",
        layer="transformers.Olmo2RMSNorm",
    ),
    _torch(
        "transformers.CohereLayerNorm",
        NormSpec("layer", eps=1e-5, bias=False),
        "mean-subtracted, no bias (its bias argument is ignored)",
    ),
    _keras("keras.layers.RMSNormalization", NormSpec("rms", eps=1e-6), "default epsilon 1e-6"),
    _keras(
        "keras.layers.LayerNormalization",
        NormSpec("layer", eps=1e-3),
        "default epsilon 1e-3; two-pass variance on TensorFlow (tf.nn.moments)",
    ),
    _keras(
        "keras.layers.LayerNormalization(rms_scaling=True)",
        NormSpec("rms", eps=1e-3),
        "its name promises RMS scaling",
    ),
    _flax("flax.linen.RMSNorm", FLAX_RMS, "default epsilon 1e-6; result_type(x, params)"),
    _flax(
        "flax.linen.LayerNorm",
        FLAX_LAYER,
        "default epsilon 1e-6, use_fast_variance=True; result_type(x, params)",
    ),
    _flax("flax.nnx.RMSNorm", FLAX_RMS, "default epsilon 1e-6; result_type(x, params)"),
    _flax(
        "flax.nnx.LayerNorm",
        FLAX_LAYER,
        "default epsilon 1e-6, use_fast_variance=True; result_type(x, params)",
    ),
)


def cases(
    peer: Target, *, quick: bool = False, case_dtypes: Iterable[str] = CASE_DTYPES
) -> list[Case]:
    """The peer's claimed spec on every dtype and shape (last axis normalized), params as the
    peer keeps them: in the input dtype or float32."""
    assert peer.claims is not None
    if peer.name in LAYOUT_SHAPES:
        full, short = LAYOUT_SHAPES[peer.name]
        shapes: Iterable[tuple[int, ...]] = short if quick else full
    else:
        shapes = QUICK_SHAPES if quick else [shape for shape, axis in FULL_SHAPES if axis == (-1,)]
    found = []
    for dtype, shape in itertools.product(case_dtypes, shapes):
        param_dtype = dtype if peer.params_in_input_dtype else "float32"
        found.append(Case(peer.claims, shape, dtype, param_dtype))
    return found
