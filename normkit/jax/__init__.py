"""normkit for JAX: Flax linen modules (here), Flax NNX modules (`normkit.jax.nnx`) and pure
functions with an analytic VJP (`normkit.jax.functional`), each computing a `NormSpec` exactly.
"""

try:
    import flax  # noqa: F401
    import jax  # noqa: F401
except ImportError as error:
    raise ImportError("normkit.jax needs JAX and Flax: pip install 'normkit[jax]'") from error

from normkit.jax import functional, nnx
from normkit.jax.linen import DyT, LayerNorm, PartialRMSNorm, RMSNorm, from_spec

__all__ = ["RMSNorm", "PartialRMSNorm", "LayerNorm", "DyT", "from_spec", "functional", "nnx"]
