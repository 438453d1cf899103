"""normkit.jax's own on the extended spec: the DyT modules' parameters, from_spec, and the
errors of residual and alpha arguments (modules, functions, the conformance hook).

Every output of every field against the reference, for the linen and nnx modules and the
functions, jitted and eager, is tests/conformance/test_every_target.py's."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import normkit.jax as nkjax  # noqa: E402
from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.conformance import targets_jax as conformance  # noqa: E402
from normkit.jax import functional as F  # noqa: E402


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_dyt_modules_parameters(param_dtype) -> None:
    x = np.ones((2, 3, 8), np.float32)
    linen = nkjax.DyT(alpha_init=1.0, param_dtype=param_dtype, output_dtype="input")
    assert linen.spec == NormSpec("dyt", alpha_init=1.0)
    params = linen.init(jax.random.key(0), x)["params"]
    shapes = {name: (v.shape, v.dtype, float(v.ravel()[0])) for name, v in params.items()}
    expected = {"scale": ((8,), param_dtype, 1.0), "bias": ((8,), param_dtype, 0.0), "alpha": ((1,), param_dtype, 1.0)}
    assert shapes == {k: (s, jnp.dtype(d), v) for k, (s, d, v) in expected.items()}
    module = nkjax.nnx.DyT(8, alpha_init=1.0, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    state = nnx.state(module, nnx.Param)
    assert {name: (state[name][...].shape, state[name][...].dtype) for name in ("scale", "bias", "alpha")} == {
        k: (s, jnp.dtype(d)) for k, (s, d, _) in expected.items()
    }
    assert nkjax.nnx.DyT(8, use_bias=False, use_scale=False, output_dtype="input").spec == NormSpec(
        "dyt", bias=False, scale=False
    )
    bare = nkjax.DyT(use_bias=False, use_scale=False)
    assert set(bare.init(jax.random.key(0), x)["params"]) == {"alpha"}
    tolerances.assert_close(module(x), reference.normalize(x, module.spec), what="nnx DyT")


def test_from_spec_builds_every_kind() -> None:
    for spec in (NormSpec("dyt", alpha_init=2.0, residual="rounded"), NormSpec("layer", variance="fast", backward="autograd")):
        assert nkjax.from_spec(spec).spec == spec
        assert nkjax.nnx.from_spec(spec, 8).spec == spec
    with pytest.raises(ValueError, match="axis_name='tp' is invalid for kind='dyt': DyT has no statistic"):
        nkjax.nnx.from_spec(NormSpec("dyt"), 8, axis_name="tp")


def test_module_residual_errors() -> None:
    x = np.ones((2, 8), np.float32)
    added = nkjax.RMSNorm(residual="rounded")
    params = added.init(jax.random.key(0), x, x)
    with pytest.raises(TypeError, match=r"RMSNorm has residual='rounded': call it with the residual, layer\(x, residual\)"):
        added.apply(params, x)
    with pytest.raises(ValueError, match="LayerNorm was given a residual but its spec has residual=None"):
        nkjax.LayerNorm().init(jax.random.key(0), x, x)
    with pytest.raises(TypeError, match="DyT has residual='float32'"):
        nkjax.nnx.DyT(8, residual="float32")(x)
    with pytest.raises(ValueError, match="RMSNorm was given a residual"):
        nkjax.nnx.RMSNorm(8)(x, x)


def test_functional_residual_and_alpha_errors() -> None:
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match=r"normalize: the spec has residual='rounded'.*use add_norm\(x, residual, spec"):
        F.normalize(x, NormSpec(residual="rounded"))
    with pytest.raises(ValueError, match="add_norm needs a spec with a residual rounding"):
        F.add_norm(x, x, NormSpec())
    with pytest.raises(ValueError, match=r"residual has shape \(2, 3\), expected the shape of x, \(2, 4\)"):
        F.add_norm(x, jnp.ones((2, 3)), NormSpec(residual="rounded"))
    with pytest.raises(TypeError, match="residual has dtype float32; residual='rounded' with x of dtype bfloat16 needs bfloat16"):
        F.add_norm(x.astype(jnp.bfloat16), x, NormSpec(residual="rounded"))
    y, h = F.add_norm(x.astype(jnp.bfloat16), x, NormSpec(residual="float32"))  # a float32 stream
    assert (y.dtype, h.dtype) == (jnp.bfloat16, jnp.float32)
    with pytest.raises(ValueError, match="alpha was given but the spec has kind='rms'"):
        F.normalize(x, NormSpec(), alpha=jnp.ones(1))
    with pytest.raises(ValueError, match=r"alpha has shape \(2,\), expected a scalar"):
        F.normalize(x, NormSpec("dyt"), alpha=jnp.ones(2))
    with pytest.raises(TypeError, match="alpha has dtype int32; expected a float dtype"):
        F.normalize(x, NormSpec("dyt"), alpha=jnp.ones(1, jnp.int32))


def test_hook_residual_errors() -> None:
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match="the spec has residual='rounded', residual given: True, dh given: False"):
        conformance.evaluate(NormSpec(residual="rounded"), x, x, residual=x)
    with pytest.raises(ValueError, match="the spec has residual=None, residual given: True"):
        conformance.evaluate(NormSpec(), x, x, residual=x, dh=x)
    with pytest.raises(ValueError, match=r"alpha has shape \(\), expected \(1,\)"):
        conformance.evaluate(NormSpec("dyt"), x, x, alpha=np.float32(1.0))
