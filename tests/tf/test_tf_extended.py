"""normkit.tf's own on the spec's extended fields: the requests its conformance hook refuses,
and, on the JAX and torch Keras backends, the handful of extended cases
tests/tf/test_tf_keras.py runs there in a process of their own.

Every field, kind and dtype against the reference on the TensorFlow backend (eager and under
jit), with the other targets, is tests/conformance/test_every_target.py's.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

# Keras imports its backend's framework (TensorFlow unless KERAS_BACKEND names another); where
# that is missing, the module skips with the missing module's name.
keras = pytest.importorskip("keras")

from normkit import NormSpec, tolerances  # noqa: E402
from normkit.conformance import compare  # noqa: E402
from normkit.conformance.cases import Case  # noqa: E402
from normkit.conformance.targets_keras import evaluate  # noqa: E402
from tests.conformance.test_every_target import (  # noqa: E402
    AUTOGRAD_MODELS,
    HANDFUL,
    HANDFUL_JIT,
    autograd_inputs,
)
from tests.helpers.targets import VARIANTS, check  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy:DeprecationWarning"
)

on_other_backends = pytest.mark.skipif(
    keras.backend.backend() == "tensorflow",
    reason="on the TensorFlow backend tests/conformance/test_every_target.py runs these cases",
)


def _case(name: str) -> tuple[NormSpec, compare.Inputs]:
    spec, shape, dtype, param_dtype = HANDFUL[name]
    return spec, Case(spec, shape, dtype.name, param_dtype.name).arrays()


@on_other_backends
@pytest.mark.parametrize("name", HANDFUL)
def test_handful_on_every_backend(name):
    check(VARIANTS["tf"], *_case(name))


@on_other_backends
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jit_on_every_backend(jit):
    if jit and keras.backend.backend() == "torch":
        pytest.skip("the torch Keras backend has no jit")
    for name in HANDFUL_JIT:
        check(VARIANTS["tf[jit]" if jit else "tf"], *_case(name))


@on_other_backends
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "name", ["llama-bfloat16_weights", "layer-residual-bfloat16_weights"],
    ids=["llama", "layer-residual"],
)
def test_autograd_is_the_eager_rounding_model_to_the_bit_on_every_backend(name, jit):
    """bfloat16 with bfloat16 weights: the autograd gradients are the reference's autograd
    model to the bit, where the exact ones are more than the tolerance away from it."""
    if jit and keras.backend.backend() == "torch":
        pytest.skip("the torch Keras backend has no jit")
    exact, _, _, bitwise, _ = AUTOGRAD_MODELS[name]
    autograd = exact.replace(backward="autograd")
    inputs = autograd_inputs(name)
    variant = VARIANTS["tf[jit]" if jit else "tf"]
    got = check(variant, autograd, inputs)
    model, ideal = compare.expected(autograd, inputs), compare.expected(exact, inputs)
    for quantity in bitwise:
        np.testing.assert_array_equal(got[quantity], model[quantity], err_msg=quantity)
        assert not tolerances.measure(model[quantity], ideal[quantity], quantity="grad").passed
    check(variant, exact, inputs)


DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16)}


def test_evaluate_rejects_bad_extended_requests():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"residual and dh are given exactly when the spec has a residual; the spec has residual=None"):
        evaluate(NormSpec(), x, x, residual=x, dh=x)
    with pytest.raises(ValueError, match=r"the spec has residual='rounded', residual given: True, dh given: False"):
        evaluate(NormSpec(residual="rounded"), x, x, residual=x)
    with pytest.raises(ValueError, match=r"dh has shape \(4,\), expected the shape of x, \(2, 4\)"):
        evaluate(NormSpec(residual="rounded"), x, x, residual=x, dh=x[0])
    with pytest.raises(ValueError, match=r"alpha was given but the spec has kind='rms'"):
        evaluate(NormSpec(), x, x, alpha=np.ones(1, np.float32))
    with pytest.raises(ValueError, match=r"alpha has shape \(2,\), expected \(1,\)"):
        evaluate(NormSpec("dyt"), x, x, alpha=np.ones(2, np.float32))
    with pytest.raises(NotImplementedError, match=r"one dtype \(param_dtype\); got scale bfloat16, bias float32"):
        evaluate(NormSpec(bias=True), x, x, np.ones(4, DTYPES["bfloat16"]), np.zeros(4, np.float32))
