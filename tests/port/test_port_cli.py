"""`normkit port` through the CLI entry point; where swap_norms lives."""

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


def test_normkit_torch_names_where_swap_norms_is():
    pytest.importorskip("torch")
    import normkit.torch

    with pytest.raises(AttributeError, match="from normkit.port.huggingface import swap_norms"):
        normkit.torch.swap_norms  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'swap'"):
        normkit.torch.swap  # noqa: B018
