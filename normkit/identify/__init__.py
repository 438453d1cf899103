"""Identify: the `NormSpec` an unknown norm implementation follows, found by probing it.

- `identify_forward` probes a numpy function ``forward(x, scale, bias) -> y`` (see
  `normkit.identify.forward` for the method).
- `identify` probes a torch, JAX or TensorFlow function through its backend's bridge.

``normkit identify LAYER`` probes one of the frameworks' built-in layers (the peers).
"""

from normkit.identify.forward import Forward, Identification, identify_forward
from normkit.identify.framework import identify

__all__ = ["Forward", "Identification", "identify", "identify_forward"]
