"""Port's errors say what to do: the convention the names belong to, a single norm's file in a
model, paths that differ by a prefix."""

import numpy as np
import pytest

from normkit import NormSpec, port
from normkit.port.plan import plan_import

W = np.ones(8, np.float32)
SPEC = NormSpec("rms")


def test_torch_names_under_the_numpy_convention_suggest_the_torch_convention(tmp_path):
    with pytest.raises(ValueError) as info:
        port.save(tmp_path / "n.npz", {"weight": W}, SPEC)
    message = str(info.value)
    assert message.startswith("params (numpy convention) missing ['scale'] and unexpected "
                              "['weight']")  # no "layer '':" for a single norm
    assert message.endswith("these are the torch convention's names: pass convention='torch' "
                            "(save, save_norms) or src='torch' (convert)")
    with pytest.raises(ValueError, match="pass convention='torch'"):
        port.convert({"weight": W}, SPEC, src="flax", dst="numpy")
    port.save(tmp_path / "n.npz", {"weight": W}, SPEC, convention="torch")  # as suggested


def test_a_single_norm_file_in_a_model_says_what_it_is(tmp_path):
    path = port.save(tmp_path / "n.npz", {"scale": W}, SPEC)
    with pytest.raises(ValueError) as info:
        plan_import(path, {"0": (SPEC, (8,))}, "numpy")
    assert str(info.value) == (
        f"{path}: the file holds a single norm (written by port.save), not a model's norms by "
        "path: to load it into the model's norm '0', read it with port.load(path, to=...) and set "
        "that layer's parameters; port.export_norms writes a model's norms by path"
    )


def test_paths_that_differ_by_a_prefix_name_it(tmp_path):
    layers = {f"model.layers.{i}.norm": ({"scale": W}, SPEC) for i in range(2)}
    path = port.save_norms(tmp_path / "m.npz", layers)
    with pytest.raises(ValueError, match="every file's path has the prefix 'model.' that the "
                       "other's lack: export and import the same module"):
        plan_import(path, {f"layers.{i}.norm": (SPEC, (8,)) for i in range(2)}, "numpy")
