"""normkit: one definition of RMSNorm, partial RMSNorm and LayerNorm, and layers that follow it.

``NormSpec`` describes a norm; ``normkit.reference`` computes it in numpy float64;
``normkit.tolerances`` says how close an implementation must come. The framework adapters live
in ``normkit.torch``, ``normkit.tf`` and ``normkit.jax``, each imported on its own.
"""

from normkit import dtypes, reference, tolerances
from normkit.spec import NormSpec

__version__ = "0.1.0"

__all__ = ["NormSpec", "dtypes", "reference", "tolerances", "__version__"]
