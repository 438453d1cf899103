"""The marks of test modules that exercise what only Keras' TensorFlow backend produces (its
eager ops, its XLA programs)."""

from __future__ import annotations

import keras
import pytest


def tensorflow_backend_only(reason: str) -> list[pytest.MarkDecorator]:
    """A module's ``pytestmark``: skipped on Keras' other backends, with ``reason``; numpy's
    copy-keyword deprecation from TensorFlow tensors ignored."""
    return [
        pytest.mark.filterwarnings(
            "ignore:__array__ implementation doesn't accept a copy:DeprecationWarning"
        ),
        pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason=reason),
    ]
