"""The reference checks of tests/tf_backend_checks.py, on the Keras backend of this process
(TensorFlow unless KERAS_BACKEND says otherwise); test_tf_keras.py runs them on JAX and torch."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tf_backend_checks import *  # noqa: E402,F403
