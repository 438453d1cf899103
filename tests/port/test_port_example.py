"""examples/transformer_block: the block ported torch -> Flax -> Keras -> torch gives the same outputs."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest

for framework in ("torch", "keras", "flax", "safetensors"):
    pytest.importorskip(framework)

from normkit import port, tolerances  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "transformer_block" / "port_block.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("port_block", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_block_agrees_across_torch_flax_and_keras(script, tmp_path, capsys):
    report = script.main(tmp_path)
    assert list(report.outputs) == ["torch", "flax (nnx)", "keras", "torch, ported back"]
    for name, measurement in report.measurements.items():
        assert measurement.passed, f"{name}: {measurement.describe()}"
        assert measurement.bound == tolerances.bound("float32")
    for (a, ya), (b, yb) in itertools.combinations(report.outputs.items(), 2):
        tolerances.assert_close(ya, yb, what=f"{a} vs {b}")
    # the norms travelled as files keyed by their paths in the block
    layers = port.load_norms(tmp_path / "from_keras.safetensors")
    assert set(layers) == {"input_layernorm", "post_attention_layernorm", "norm"}
    assert "torch, ported back: PASS [float32]" in capsys.readouterr().out


def test_moving_linears_names_a_missing_layer(script):
    block = script.block_torch.Block(script.Config())
    kernels = script.torch_kernels(block)
    del kernels["mlp.up_proj"]
    with pytest.raises(ValueError, match=r"the linear layers differ: model \[.*'mlp.up_proj'.*\], "
                       r"weights \['attn.k_proj', 'attn.o_proj', 'attn.q_proj', 'attn.v_proj', "
                       r"'mlp.down_proj', 'mlp.gate_proj'\]"):
        script.set_torch_kernels(block, kernels)
