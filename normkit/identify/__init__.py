"""Identify: the `NormSpec` an unknown norm implementation follows, found by probing it.

- `identify_forward` probes a numpy function ``forward(x, scale, bias) -> y`` (see
  `normkit.identify.forward` for the method).
- `identify` probes a torch, JAX or TensorFlow function through its backend's bridge.
- `identify_gated` and `identify_gated_forward` do the same for gated norms
  ``fn(x, gate, ...)`` (see `normkit.identify.gated`).

``normkit identify LAYER`` probes one of the frameworks' built-in layers (the peers).
"""

from normkit.identify.forward import Forward, Identification, identify_forward
from normkit.identify.framework import identify
from normkit.identify.gated import identify_gated, identify_gated_forward

__all__ = [
    "Forward", "Identification", "identify", "identify_forward", "identify_gated",
    "identify_gated_forward",
]
