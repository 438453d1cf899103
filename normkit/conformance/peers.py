"""The frameworks' built-in norm layers, each paired with the NormSpec it appears to implement.

Each peer is checked as people use it: torch modules and Hugging Face's with parameters in the
input's dtype (``module.to(dtype)``), Keras layers under the ``mixed_<dtype>`` policy for half
inputs (float32 variables), Flax modules with their default float32 ``param_dtype``. Where a
peer departs from its spec, the conformance report shows where; `explain` says why.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

from normkit.conformance.cases import CASE_DTYPES, FULL_SHAPES, Case
from normkit.conformance.targets import Target
from normkit.spec import NormSpec

FLOAT32_EPS = float(np.finfo(np.float32).eps)
QUICK_SHAPES = ((5, 7), (8, 1024))


def _torch(name: str, claims: NormSpec, note: str, packages: tuple[str, ...] = ()) -> Target:
    return Target(
        name, ("torch",), "normkit.conformance.peers_torch", {"layer": name}, packages=packages,
        claims=claims, params_in_input_dtype=True, note=note,
    )


def _keras(name: str, claims: NormSpec, note: str) -> Target:
    return Target(
        name, ("tf",), "normkit.conformance.peers_keras", {"layer": name}, claims=claims, note=note
    )


def _flax(name: str, claims: NormSpec, note: str) -> Target:
    return Target(
        name, ("jax",), "normkit.conformance.peers_flax", {"layer": name}, claims=claims, note=note
    )


PEERS: tuple[Target, ...] = (
    _torch(
        "torch.nn.RMSNorm",
        NormSpec("rms", eps=FLOAT32_EPS),
        "eps=None: the float32 machine eps is the value it appears to use",
    ),
    _torch("torch.nn.LayerNorm", NormSpec("layer", eps=1e-5), "default eps 1e-5"),
    _torch(
        "transformers.LlamaRMSNorm",
        NormSpec("rms", eps=1e-6, cast="before_scale"),
        "Llama order: cast, then weight",
        ("transformers",),
    ),
    _torch(
        "transformers.GemmaRMSNorm",
        NormSpec("rms", eps=1e-6, scale_offset=1.0),
        "weight stored as w - 1",
        ("transformers",),
    ),
    _keras("keras.layers.RMSNormalization", NormSpec("rms", eps=1e-6), "default epsilon 1e-6"),
    _keras("keras.layers.LayerNormalization", NormSpec("layer", eps=1e-3), "default epsilon 1e-3"),
    _keras(
        "keras.layers.LayerNormalization(rms_scaling=True)",
        NormSpec("rms", eps=1e-3),
        "its name promises RMS scaling",
    ),
    _flax("flax.linen.RMSNorm", NormSpec("rms", eps=1e-6), "default epsilon 1e-6"),
    _flax("flax.linen.LayerNorm", NormSpec("layer", eps=1e-6), "default epsilon 1e-6"),
    _flax("flax.nnx.RMSNorm", NormSpec("rms", eps=1e-6), "default epsilon 1e-6"),
    _flax("flax.nnx.LayerNorm", NormSpec("layer", eps=1e-6), "default epsilon 1e-6"),
)


def cases(
    peer: Target, *, quick: bool = False, case_dtypes: Iterable[str] = CASE_DTYPES
) -> list[Case]:
    """The peer's claimed spec on every dtype and last-axis shape, params as the peer keeps them."""
    assert peer.claims is not None
    shapes = QUICK_SHAPES if quick else [shape for shape, axis in FULL_SHAPES if axis == (-1,)]
    found = []
    for dtype, shape in itertools.product(case_dtypes, shapes):
        param_dtype = dtype if peer.params_in_input_dtype else "float32"
        found.append(Case(peer.claims, shape, dtype, param_dtype))
    return found
