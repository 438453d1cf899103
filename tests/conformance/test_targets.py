"""The target registry: packages, install hints and environments derive from the backends; every
target's variant is one its hook declares."""

import importlib

import pytest

from normkit.conformance.peers import PEERS
from normkit.conformance.targets import TARGETS, check_variant, select


def by_name(name):
    return next(t for t in (*TARGETS, *PEERS) if t.name == name)


def test_install_hints_and_environments_come_from_the_backend_registry():
    keras_on_tf = by_name("tf[tensorflow,jit]")
    assert keras_on_tf.install == "pip install 'normkit[tf]'"
    assert keras_on_tf.requires == ("tensorflow", "keras")
    assert keras_on_tf.environment == {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    # Keras on JAX or torch needs Keras and that framework, not TensorFlow (GPU machines lack it)
    keras_on_jax = by_name("tf[jax,jit]")
    assert keras_on_jax.install == "pip install 'normkit[keras]'"  # the extra of keras and jax
    assert keras_on_jax.requires == ("keras", "jax")  # not Flax
    assert keras_on_jax.environment == {"KERAS_BACKEND": "jax"}
    assert by_name("tf[torch]").requires == ("torch", "keras")
    llama = by_name("transformers.LlamaRMSNorm")
    assert llama.install == "pip install 'normkit[torch]' transformers"
    assert llama.params_in_input_dtype and not by_name("flax.nnx.RMSNorm").params_in_input_dtype
    assert by_name("keras.layers.RMSNormalization").environment["KERAS_BACKEND"] == "tensorflow"


def test_prefixes_select_whole_names_only():
    assert [t.name for t in select(["jax"])] == ["jax.linen", "jax.nnx", "jax.functional"]
    assert [t.name for t in select(["torch"])] == [
        "torch", "torch[composite]", "torch[cpu-kernel]", "torch[triton]"
    ]
    assert [t.name for t in select(["torch[triton]"])] == ["torch[triton]"]
    for unknown in ("to", "tf[jax", "jax.", "tf[jax,jit"):
        with pytest.raises(ValueError, match="unknown backends"):
            select([unknown])


@pytest.mark.parametrize("target", [*TARGETS, *PEERS], ids=lambda t: t.name)
def test_every_variant_is_one_its_hook_declares(target):
    if target.missing():
        pytest.skip(target.missing())
    if target.environment.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
        pytest.skip("Keras fixes its backend at import: checked with tf[tensorflow]")
    hook = importlib.import_module(target.hook)
    check_variant(target.variant, hook.VARIANTS)


def test_check_variant_names_the_problem():
    allowed = {"api": ("linen", "nnx"), "policy": None}
    check_variant({"api": "nnx", "policy": "anything"}, allowed)
    with pytest.raises(ValueError, match=r"unknown variant options \['jit'\]; allowed: \['api', 'policy'\]"):
        check_variant({"jit": True}, allowed)
    with pytest.raises(ValueError, match=r"api='keras' is invalid: expected one of \['linen', 'nnx'\]"):
        check_variant({"api": "keras"}, allowed)
