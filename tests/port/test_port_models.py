"""Norm parameters through real torch, Keras and Flax layers, and whole models' norms by path."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
keras = pytest.importorskip("keras")
jnp = pytest.importorskip("jax.numpy")
nnx = pytest.importorskip("flax.nnx")

import flax.linen as nn  # noqa: E402

import normkit.jax as nk_linen  # noqa: E402
import normkit.tf as nk_keras  # noqa: E402
import normkit.torch as nk_torch  # noqa: E402
from normkit import NormSpec, port, reference, tolerances  # noqa: E402
from normkit.jax import nnx as nk_nnx  # noqa: E402
from normkit.port import flax as port_flax  # noqa: E402
from normkit.port import keras as port_keras  # noqa: E402
from normkit.port.torch import to_torch  # noqa: E402

N = 16
SPECS = [
    NormSpec("layer", eps=1e-5),
    NormSpec("rms", cast="before_scale"),
    NormSpec("partial_rms", p=0.25, eps=1e-8, eps_placement="outside"),
    NormSpec("rms", scale_offset=1.0, bias=True),
]


def torch_params(module):
    return {n: p for n in ("weight", "bias") if (p := getattr(module, n)) is not None}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind + ("+offset" if s.scale_offset else ""))
def test_round_trip_torch_keras_flax_numpy_torch_is_bit_exact(tmp_path, spec):
    rng = np.random.default_rng(0)
    original = nk_torch.from_spec(spec, N)
    with torch.no_grad():
        for p in original.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(N).astype(np.float32)))
    x = rng.standard_normal((3, N)).astype(np.float32)

    params = port.convert(torch_params(original), spec, src="torch", dst="keras")
    k = nk_keras.from_spec(spec)
    k.build((None, N))
    k.set_weights(list(params.values()))
    params = port.convert(k.get_weights(), spec, src="keras", dst="flax")
    f = nk_nnx.from_spec(spec, N)
    for name, value in params.items():
        getattr(f, name).set_value(jnp.asarray(value))
    params = port.convert({n: getattr(f, n) for n in params}, spec, src="flax", dst="numpy")
    port.save(tmp_path / "norm.safetensors", params, spec)
    params, loaded_spec = port.load(tmp_path / "norm.safetensors")
    params = port.convert(params, loaded_spec, src="numpy", dst="torch")
    back = nk_torch.from_spec(loaded_spec, N)
    back.load_state_dict({n: to_torch(v) for n, v in params.items()})

    for name, p in torch_params(original).items():
        assert getattr(back, name).detach().numpy().tobytes() == p.detach().numpy().tobytes()
    expected = reference.normalize(x.astype(np.float64), spec, *port.convert(
        torch_params(original), spec, src="torch", dst="numpy").values())
    for what, y in [("torch", back(torch.from_numpy(x)).detach().numpy()),
                    ("keras", keras.ops.convert_to_numpy(k(x))), ("nnx", np.asarray(f(x)))]:
        tolerances.assert_close(y, expected, what=what)


# --- whole models: the same architecture in each framework, the same attribute paths ---------

BLOCK_SPECS = {
    "input_layernorm": NormSpec("rms", eps=1e-5, cast="before_scale"),
    "post_attention_layernorm": NormSpec("rms", scale_offset=1.0),
}
FINAL = NormSpec("layer", eps=1e-5)


class TorchBlock(torch.nn.Module):
    def __init__(self, specs=BLOCK_SPECS):
        super().__init__()
        for name, spec in specs.items():
            setattr(self, name, nk_torch.from_spec(spec, N))


class TorchNet(torch.nn.Module):
    def __init__(self, blocks=2, final=FINAL, specs=BLOCK_SPECS):
        super().__init__()
        self.blocks = torch.nn.ModuleList([TorchBlock(specs) for _ in range(blocks)])
        self.norm = nk_torch.from_spec(final, N)


class KerasBlock(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        for name, spec in BLOCK_SPECS.items():
            setattr(self, name, nk_keras.from_spec(spec))

    def call(self, x):
        return self.post_attention_layernorm(self.input_layernorm(x))


class KerasNet(keras.Model):
    def __init__(self, blocks=2):
        super().__init__()
        self.blocks = [KerasBlock() for _ in range(blocks)]
        self.norm = nk_keras.from_spec(FINAL)

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class NnxBlock(nnx.Module):
    def __init__(self):
        for name, spec in BLOCK_SPECS.items():
            setattr(self, name, nk_nnx.from_spec(spec, N))


class NnxNet(nnx.Module):
    def __init__(self, blocks=2, size=N):
        self.blocks = nnx.List([NnxBlock() for _ in range(blocks)])
        self.norm = nk_nnx.from_spec(FINAL, size)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        for name, spec in BLOCK_SPECS.items():
            x = nk_linen.from_spec(spec, name=name)(x)
        return x


class LinenNet(nn.Module):
    def setup(self):
        self.blocks = [LinenBlock() for _ in range(2)]
        self.norm = nk_linen.from_spec(FINAL)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def random_torch_net():
    net = TorchNet()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return net


def test_model_norms_move_torch_keras_nnx_linen_torch_bit_exactly(tmp_path):
    source = random_torch_net()
    file = port.export_norms(source, tmp_path / "torch.safetensors")
    assert set(port.load_norms(file)) == {
        "blocks.0.input_layernorm", "blocks.0.post_attention_layernorm",
        "blocks.1.input_layernorm", "blocks.1.post_attention_layernorm", "norm",
    }
    k = KerasNet()
    k(np.zeros((1, N), np.float32))
    assert sorted(port.import_norms(k, file)) == sorted(port.load_norms(file))
    file = port.export_norms(k, tmp_path / "keras.npz")

    f = NnxNet()
    port.import_norms(f, file)
    file = port.export_norms(f, tmp_path / "nnx.safetensors")

    x = np.zeros((1, N), np.float32)
    module = LinenNet()
    variables = module.init(jax_key(), x)
    variables = port_flax.import_linen_norms(module, variables, file, x)
    file = port_flax.export_linen_norms(module, variables, tmp_path / "linen.safetensors", x)

    target = TorchNet()
    port.import_norms(target, file)
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items(), strict=True):
        assert a.numpy().tobytes() == b.numpy().tobytes(), name
    assert float(target.blocks[1].post_attention_layernorm.weight.detach()[0]) != 0.0


def jax_key():
    import jax

    return jax.random.key(0)


def test_import_converts_a_scale_offset(tmp_path):
    source = random_torch_net()
    file = port.export_norms(source, tmp_path / "gemma.safetensors")
    zero = {**BLOCK_SPECS, "post_attention_layernorm": NormSpec("rms")}
    target = TorchNet(specs=zero)
    port.import_norms(target, file)
    w = source.blocks[0].post_attention_layernorm.weight.detach().numpy()
    got = target.blocks[0].post_attention_layernorm.weight.detach().numpy()
    assert np.array_equal(got, (w.astype(np.float64) + 1).astype(np.float32))


def test_import_names_missing_and_extra_layers(tmp_path):
    file = port.export_norms(random_torch_net(), tmp_path / "n.safetensors")
    with pytest.raises(ValueError, match=r"n.safetensors: the file's norm layers do not match the "
                       r"model's: the model's \['blocks.2.input_layernorm', "
                       r"'blocks.2.post_attention_layernorm'\] are not in the file, the file's \[\] "
                       r"are not in the model \(paths are attribute paths from the module exported and "
                       r"imported, see docs/porting.md\)"):
        port.import_norms(NnxNet(blocks=3), file)
    with pytest.raises(ValueError, match=r"the model's \[\] are not in the file, the file's "
                       r"\['blocks.1.input_layernorm', 'blocks.1.post_attention_layernorm'\] are "
                       "not in the model"):
        port.import_norms(TorchNet(blocks=1), file)


def test_import_names_a_layer_whose_spec_or_shape_differs(tmp_path):
    file = port.export_norms(random_torch_net(), tmp_path / "n.safetensors")
    with pytest.raises(ValueError, match=r"layer 'norm': the specs differ in \['eps'\] \(eps: 1e-05 "
                       r"-> 1e-06\); convert changes scale_offset only"):
        port.import_norms(TorchNet(final=NormSpec("layer")), file)
    with pytest.raises(ValueError, match=r"layer 'norm': 'scale' has shape \(16,\) in the file, the "
                       r"model's has \(8,\)"):
        port.import_norms(NnxNet(size=8), file)


def test_keras_layers_must_be_built_before_export(tmp_path):
    with pytest.raises(ValueError, match=r"blocks.0.input_layernorm: the layer is not built, so it has "
                       "no weights yet; call the model on an input first"):
        port.export_norms(KerasNet(), tmp_path / "k.safetensors")


def test_keras_sequential_layers_are_keyed_by_name(tmp_path):
    model = keras.Sequential([keras.Input((N,)), nk_keras.RMSNorm(name="first"),
                              nk_keras.LayerNorm(name="last")])
    assert list(port_keras.norm_layers(model)) == ["first", "last"]


def test_export_norms_names_an_unsupported_model(tmp_path):
    with pytest.raises(TypeError, match="export_norms/import_norms take a torch nn.Module, a Keras "
                       "layer or a Flax NNX module, got builtins.dict"):
        port.export_norms({"norm": 1}, tmp_path / "x.safetensors")


def test_gemma_offset_to_zero_and_back_gives_the_same_outputs_in_every_framework():
    gemma, zero = NormSpec("rms", scale_offset=1.0), NormSpec("rms")
    rng = np.random.default_rng(5)
    w = (0.1 * rng.standard_normal(N)).astype(np.float32)
    w0 = port.convert({"weight": w}, gemma, src="torch", dst="torch", dst_spec=zero)["weight"]
    w1 = port.convert({"weight": w0}, zero, src="torch", dst="torch", dst_spec=gemma)["weight"]
    x = rng.standard_normal((4, N)).astype(np.float32)

    def outputs(spec, weight):
        t = nk_torch.from_spec(spec, N)
        t.load_state_dict({"weight": to_torch(weight)})
        k = nk_keras.from_spec(spec)
        k.build((None, N))
        k.set_weights([weight])
        f = nk_nnx.from_spec(spec, N)
        f.scale.set_value(jnp.asarray(weight))
        return [t(torch.from_numpy(x)).detach().numpy(), keras.ops.convert_to_numpy(k(x)),
                np.asarray(f(x))]

    for original, zeroed, again in zip(outputs(gemma, w), outputs(zero, w0), outputs(gemma, w1),
                                       strict=True):
        # (1 + w) rounds to float32 inside the layer exactly as the conversion rounds it
        assert zeroed.tobytes() == original.tobytes()
        assert again.tobytes() == original.tobytes()
