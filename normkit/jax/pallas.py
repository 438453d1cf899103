"""normkit.jax's Pallas kernels (experimental; docs/jax.md): ``implementation="pallas"`` (or
``NORMKIT_JAX_KERNELS=pallas``) runs them on NVIDIA GPUs, and inside `interpreted` in Pallas'
interpreter on any platform (slowly: tests and debugging without a GPU). The kernels live in
`normkit._pallas`, which imports JAX alone, so that normkit.tf on Keras' JAX backend runs the
same ones."""

from normkit._pallas import KERNELS_VARIABLE, MAX_BLOCK, interpreted, supports

__all__ = ["KERNELS_VARIABLE", "MAX_BLOCK", "interpreted", "supports"]
