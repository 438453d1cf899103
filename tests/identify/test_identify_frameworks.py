"""identify() through the framework bridges: normkit's own layers and the built-in peers."""

import importlib
import os

import numpy as np
import pytest

from normkit import NormSpec
from normkit.conformance import identify
from normkit.conformance.peers import PEERS


def random_specs(count, seed):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        kind = str(rng.choice(["rms", "partial_rms", "layer"]))
        yield NormSpec(
            kind,  # type: ignore[arg-type]
            eps=float(10 ** rng.uniform(-7, -2)),
            eps_placement=str(rng.choice(["inside", "outside"])),  # type: ignore[arg-type]
            p=float(rng.uniform(0.05, 0.9)) if kind == "partial_rms" else None,
            scale_offset=float(rng.choice([0.0, 1.0])),
            bias=bool(rng.integers(2)),
            cast=str(rng.choice(["after_scale", "before_scale"])),  # type: ignore[arg-type]
        )


def own_params(spec, scale, bias):
    """identify offers a scale and a bias to every implementation; one without them ignores them."""
    return (scale if spec.scale else None), (bias if spec.bias else None)


def assert_recovered(found, spec, n):
    got = found.spec
    assert found.undetermined == ("backward",), found.describe()
    assert got.kind == spec.kind and got.eps_placement == spec.eps_placement, found.describe()
    assert got.stat_size(n) == spec.stat_size(n), found.describe()
    assert abs(got.eps - spec.eps) <= 0.1 * spec.eps, found.describe()
    assert (got.scale_offset, got.bias, got.cast) == (spec.scale_offset, spec.bias, spec.cast), found.describe()


N = 48


@pytest.mark.parametrize("spec", list(random_specs(6, seed=1)), ids=repr)
def test_identify_recovers_normkit_torch(spec):
    from normkit.torch.functional import normalize

    found = identify(lambda x, s, b: normalize(x, spec, *own_params(spec, s, b)), (N,), backend="torch", params=True)
    assert_recovered(found, spec, N)


@pytest.mark.parametrize("spec", list(random_specs(4, seed=2)), ids=repr)
def test_identify_recovers_normkit_jax(spec):
    from normkit.jax.functional import normalize

    found = identify(lambda x, s, b: normalize(x, spec, *own_params(spec, s, b)), (N,), backend="jax", params=True)
    assert_recovered(found, spec, N)


@pytest.mark.parametrize("spec", list(random_specs(3, seed=3)), ids=repr)
def test_identify_recovers_normkit_tf(spec):
    pytest.importorskip("tensorflow")
    import keras

    from normkit.conformance.targets_keras import POLICIES
    from normkit.tf import from_spec

    if keras.backend.backend() != "tensorflow":
        pytest.skip("the TensorFlow bridge needs the tensorflow Keras backend")
    layers = {}

    def fn(x, scale, bias):
        # The policy of x's dtype (mixed_bfloat16 for bfloat16, ...): Keras' autocast then leaves
        # x as it is and the layer computes the spec on it.
        dtype = x.dtype.name
        if dtype not in layers:
            layers[dtype] = from_spec(spec, dtype=POLICIES[dtype], param_dtype="float32")
            layers[dtype].build((None, N))
        layer = layers[dtype]
        for variable, value in zip(layer.trainable_variables, [v for v in own_params(spec, scale, bias) if v is not None]):
            variable.assign(value)
        return layer(x)

    assert_recovered(identify(fn, (N,), backend="tf", params=True), spec, N)


def test_identify_without_params_says_what_it_cannot_know():
    from normkit.torch.functional import normalize

    spec = NormSpec("partial_rms", p=0.25, eps=1e-4, eps_placement="outside", axis=(-2, -1))
    found = identify(lambda x: normalize(x, spec), (2, 16), backend="torch")
    assert found.spec.kind == "partial_rms" and found.spec.stat_size(32) == 8
    assert set(found.undetermined) == {
        "scale", "scale_offset", "bias", "cast", "offset_dtype", "output_dtype", "backward"
    }


@pytest.mark.parametrize("peer", [p for p in PEERS if "rms_scaling" not in p.name], ids=lambda p: p.name)
def test_identify_recovers_what_each_peer_appears_to_implement(peer):
    if peer.missing():
        pytest.skip(peer.missing())
    os.environ.update(peer.env)
    hook = importlib.import_module(peer.hook)
    found = hook.identify(**peer.variant, n=32)
    claims = peer.claims
    assert abs(found.spec.eps - claims.eps) <= 0.1 * claims.eps
    # the forward cannot show the backward's rounding model: the spec keeps the default
    assert "backward" in found.undetermined
    assert found.spec.replace(eps=claims.eps, backward=claims.backward) == claims, found.describe()


def test_keras_rms_scaling_is_not_a_norm_of_any_kind():
    peer = next(p for p in PEERS if "rms_scaling" in p.name)
    hook = importlib.import_module(peer.hook)
    with pytest.raises(ValueError, match="does not behave like RMSNorm, partial RMSNorm, LayerNorm or DyT"):
        hook.identify(**peer.variant, n=32)
