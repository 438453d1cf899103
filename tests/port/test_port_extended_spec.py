"""normkit.port with the extended spec: the new fields travel in the file, DyT's alpha travels
with the weights, and a change of offset dtype is explicit."""

import numpy as np
import pytest

from normkit import NormSpec, cli, dtypes, port, reference, tolerances

pytest.importorskip("safetensors")

EXTENDED = [
    NormSpec("layer", eps=1e-6, variance="fast", output_dtype="promote"),
    NormSpec("rms", scale_offset=1.0, offset_dtype="param", residual="float32"),
    NormSpec("rms", cast="before_scale", backward="autograd", residual="float32_normalized"),
    NormSpec("dyt", alpha_init=1.0, bias=False),
]


def params_of(spec, n=8, dtype=np.float32, convention="torch"):
    rng = np.random.default_rng(0)
    w, b = port.NAMES[convention]
    values = {}
    if spec.scale:
        values[w] = dtypes.round_to(spec.scale_init + 0.1 * rng.normal(size=n), dtype)
    if spec.bias:
        values[b] = dtypes.round_to(0.1 * rng.normal(size=n), dtype)
    if spec.kind == "dyt":
        values["alpha"] = np.full((1,), 0.75, dtype)
    return values


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
@pytest.mark.parametrize("spec", EXTENDED, ids=repr)
def test_the_new_fields_and_alpha_round_trip_through_a_file(tmp_path, spec, suffix):
    params = params_of(spec, dtype=dtypes.bfloat16)
    path = port.save(tmp_path / f"norm{suffix}", params, spec, convention="torch")
    loaded, got = port.load(path, to="flax")
    assert got == spec  # every field, the extended ones included
    names = {"weight": "scale", "bias": "bias", "alpha": "alpha"}
    assert set(loaded) == {names[k] for k in params}
    for key, value in params.items():
        assert loaded[names[key]].dtype == value.dtype
        np.testing.assert_array_equal(loaded[names[key]], value)


def test_dyt_alpha_is_required_and_of_shape_1():
    spec = NormSpec("dyt")
    params = params_of(spec)
    del params["alpha"]
    with pytest.raises(ValueError, match=r"missing \['alpha'\]"):
        port.convert(params, spec, src="torch", dst="flax")
    params["alpha"] = np.float32(0.5) * np.ones((), np.float32)
    with pytest.raises(ValueError, match=r"DyT's alpha is a scalar of shape \(1,\) in every"):
        port.convert(params, spec, src="torch", dst="flax")
    with pytest.raises(ValueError, match=r"unexpected \['alpha'\]"):
        port.convert({"weight": np.ones(4, np.float32), "alpha": np.ones(1, np.float32)},
                     NormSpec("rms"), src="torch", dst="flax")


def test_dyt_keras_weight_list_carries_alpha():
    spec = NormSpec("dyt")
    scale, bias, alpha = (np.ones(4, np.float32), np.zeros(4, np.float32), np.ones(1, np.float32))
    got = port.convert([scale, bias, alpha], spec, src="keras", dst="torch")
    assert list(got) == ["weight", "bias", "alpha"]
    np.testing.assert_array_equal(got["alpha"], alpha)


def test_other_extended_fields_are_not_converted():
    spec = NormSpec("layer", eps=1e-6, variance="fast")
    params = params_of(spec)
    with pytest.raises(ValueError, match=r"the specs differ in \['variance'\].*any other field"):
        port.convert(params, spec, src="torch", dst="torch",
                     dst_spec=spec.replace(variance="two_pass"))


def gemma_bf16():
    """A Gemma scale in bfloat16 whose 1 + w rounds in bfloat16 on most elements."""
    rng = np.random.default_rng(1)
    return dtypes.round_to(rng.uniform(-0.05, 0.05, 64), dtypes.bfloat16)


def test_param_to_float32_offset_is_refused_implicitly_and_exact_when_asked():
    param = NormSpec("rms", scale_offset=1.0, offset_dtype="param")
    target = param.replace(offset_dtype="float32")
    w = gemma_bf16()
    with pytest.raises(ValueError, match=r"differ in \['offset_dtype'\].*change_offset_dtype=True"):
        port.convert({"weight": w}, param, src="torch", dst="torch", dst_spec=target)
    moved = port.convert({"weight": w}, param, src="torch", dst="torch", dst_spec=target,
                         change_offset_dtype=True)["weight"]
    assert moved.dtype == w.dtype and not np.array_equal(moved, w)
    x = dtypes.round_to(np.random.default_rng(2).normal(size=(4, 64)), dtypes.bfloat16)
    # the same function: the effective scale round(1 + w) is kept exactly
    np.testing.assert_array_equal(
        reference.normalize(x, target, moved), reference.normalize(x, param, w)
    )


def test_float32_to_param_offset_keeps_w_and_moves_the_outputs_by_the_rounding():
    exact = NormSpec("rms", scale_offset=1.0)
    param = exact.replace(offset_dtype="param")
    w = gemma_bf16()
    kept = port.convert({"weight": w}, exact, src="torch", dst="torch", dst_spec=param,
                        change_offset_dtype=True)["weight"]
    np.testing.assert_array_equal(kept, w)
    x = np.random.default_rng(3).normal(size=(4, 64)).astype(np.float32)
    before, after = reference.normalize(x, exact, w), reference.normalize(x, param, kept)
    assert not np.array_equal(before, after)
    # at most half a bfloat16 ulp of 1 + w (2^-7 in [1, 2)), relative, and float32's rounding
    assert np.max(np.abs(after - before) / np.abs(before)) <= 2.0**-8 * (1 + 2.0**-6)


def test_param_offset_moved_to_zero_through_float32(tmp_path):
    param = NormSpec("rms", scale_offset=1.0, offset_dtype="param")
    w = gemma_bf16()
    zero = port.convert({"weight": w}, param, src="torch", dst="torch",
                        dst_spec=NormSpec("rms"), change_offset_dtype=True)["weight"]
    x = np.random.default_rng(4).normal(size=(4, 64)).astype(np.float32)
    tolerances.assert_close(
        reference.normalize(x, NormSpec("rms"), zero), reference.normalize(x, param, w), np.float32
    )


def test_port_command_needs_the_offset_dtype_to_move_a_param_offset(tmp_path, capsys):
    param = NormSpec("rms", scale_offset=1.0, offset_dtype="param")
    w = gemma_bf16()
    src = port.save(tmp_path / "gemma.safetensors", {"weight": w}, param, convention="torch")
    dst = tmp_path / "zero.safetensors"
    assert cli.main(["port", str(src), str(dst), "--to", "torch", "--scale-offset", "0"]) == 2
    err = capsys.readouterr().err
    assert "offset_dtype is 'param'" in err and "pass --offset-dtype float32" in err
    args = ["port", str(src), str(dst), "--to", "torch", "--scale-offset", "0", "--offset-dtype",
            "float32"]
    assert cli.main(args) == 0
    params, got = port.load(dst, to="torch")
    assert got == NormSpec("rms")
    expected = dtypes.round_to(w.astype(np.float64) + 1.0, dtypes.bfloat16)  # round(1 + w)
    np.testing.assert_array_equal(params["weight"], expected)


def test_import_refuses_a_file_with_another_offset_dtype(tmp_path):
    torch = pytest.importorskip("torch")
    from normkit.torch import from_spec

    exact = NormSpec("rms", scale_offset=1.0)
    path = port.save_norms(
        tmp_path / "norms.safetensors",
        {"norm": ({"weight": gemma_bf16()}, exact.replace(offset_dtype="param"))},
        convention="torch",
    )
    model = torch.nn.Module()
    model.norm = from_spec(exact, (64,), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"layer 'norm': the specs differ in \['offset_dtype'\]"):
        port.import_norms(model, path)


def test_whole_model_export_carries_alpha(tmp_path):
    """A torch module with a NormSpec and an ``alpha`` (the shape of normkit's DyT layers) is
    exported and imported with its alpha."""
    torch = pytest.importorskip("torch")

    class DyTLike(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.spec = NormSpec("dyt")
            self.weight = torch.nn.Parameter(torch.ones(6))
            self.bias = torch.nn.Parameter(torch.zeros(6))
            self.alpha = torch.nn.Parameter(torch.full((1,), 0.5))

    source, target = torch.nn.Module(), torch.nn.Module()
    source.block, target.block = DyTLike(), DyTLike()
    with torch.no_grad():
        source.block.alpha.fill_(0.875)
        source.block.weight.mul_(2.0)
    path = port.export_norms(source, tmp_path / "dyt.safetensors")
    params, spec = port.load_norms(path, to="torch")["block"]
    assert float(params["alpha"][0]) == 0.875 and spec == NormSpec("dyt")
    assert port.import_norms(target, path) == ["block"]
    assert target.block.alpha.detach().tolist() == [0.875]
    assert torch.equal(target.block.weight, source.block.weight)
