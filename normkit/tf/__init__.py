"""Keras 3 layers that follow a `normkit.NormSpec`: `RMSNorm`, `PartialRMSNorm`, `LayerNorm`,
`DyT`.

They are written with ``keras.ops`` only, so they run on every Keras backend (TensorFlow, JAX,
PyTorch; chosen by ``KERAS_BACKEND`` before Keras is imported).
"""

try:
    import keras
except ImportError as err:
    raise ImportError(
        "normkit.tf needs Keras 3: pip install 'normkit[tf]' (Keras 3 with TensorFlow), or pip "
        "install 'normkit[keras]' (Keras 3 with JAX, then set KERAS_BACKEND=jax before Keras is "
        "imported)"
    ) from err

if int(keras.__version__.split(".")[0]) < 3:
    raise ImportError(
        f"normkit.tf needs Keras 3, found Keras {keras.__version__}: pip install 'normkit[tf]' "
        "(Keras 3 with TensorFlow), or pip install 'normkit[keras]' (Keras 3 with JAX, then set "
        "KERAS_BACKEND=jax before Keras is imported)"
    )

from normkit.tf.layers import DyT, LayerNorm, PartialRMSNorm, RMSNorm, from_spec

__all__ = ["RMSNorm", "PartialRMSNorm", "LayerNorm", "DyT", "from_spec"]
