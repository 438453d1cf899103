"""`normkit port` through the CLI entry point, and the normkit.torch.swap_norms re-export."""

import pickle

import numpy as np
import pytest

from normkit import NormSpec, cli, port

pytest.importorskip("safetensors")


def test_port_command_renames_and_reoffsets(tmp_path):
    spec = NormSpec("rms", scale_offset=1.0)
    w = np.array([0.25, -0.5, 0.0], np.float32)
    src = port.save(tmp_path / "gemma.safetensors", {"weight": w}, spec, convention="torch")
    dst = tmp_path / "flax.safetensors"
    assert cli.main(["port", str(src), str(dst), "--to", "flax", "--scale-offset", "0"]) == 0
    params, got = port.load(dst, to="flax")
    assert got == spec.replace(scale_offset=0.0)
    np.testing.assert_array_equal(params["scale"], w + 1)


def test_port_command_refuses_a_pickle(tmp_path, capsys):
    bad = tmp_path / "norms.safetensors"
    bad.write_bytes(pickle.dumps({"weight": [1.0]}))
    assert cli.main(["port", str(bad), str(tmp_path / "out.safetensors"), "--to", "torch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("normkit port: error:") and "norms.safetensors" in err


def test_swap_norms_is_reexported_from_normkit_torch():
    torch = pytest.importorskip("torch")
    import normkit.torch
    from normkit.port.torch import swap_norms

    assert normkit.torch.swap_norms is swap_norms
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    x = torch.randn(3, 4)
    before = model(x)
    _, swapped = normkit.torch.swap_norms(model)
    assert len(swapped) == 1 and isinstance(model[1], normkit.torch.LayerNorm)
    torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)
    with pytest.raises(AttributeError, match="has no attribute 'swap'"):
        normkit.torch.swap  # noqa: B018
