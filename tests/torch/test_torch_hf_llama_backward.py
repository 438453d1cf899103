"""backward="autograd": normkit.torch's RMSNorm trains exactly as Hugging Face's LlamaRMSNorm.

Outputs and gradients (dx, dweight; with a residual added as model code adds it, dresidual and
h too) bit for bit, for bfloat16 and float16 inputs with half and float32 weights. The default
backward="exact" is not bit-identical: it rounds once where autograd rounds twice.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

for _module in ("torch", "transformers"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs {_module}", allow_module_level=True)

WORKER = Path(__file__).with_name("hf_llama_grads_worker.py")
CASES = [
    f"{half}/{weight}/{seed}/{kind}"
    for half, weight in (("bfloat16", "bfloat16"), ("bfloat16", "float32"),
                         ("float16", "float16"), ("float16", "float32"))
    for seed, kind in ((0, "plain"), (1, "plain"), (2, "residual"))
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The worker's arrays, run in its own process."""
    path = tmp_path_factory.mktemp("hf") / "grads.npz"
    done = subprocess.run(
        [sys.executable, str(WORKER), str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(path) as data:
        return dict(data)


def quantities(results, tag):
    return sorted(k.split("/")[-1] for k in results if k.startswith(f"{tag}/hf/"))


@pytest.mark.parametrize("tag", CASES)
def test_autograd_backward_is_bit_identical_to_llama(results, tag):
    names = quantities(results, tag)
    assert {"y", "dx", "dw"} <= set(names)
    for name in names:
        hf, ours = results[f"{tag}/hf/{name}"], results[f"{tag}/autograd/{name}"]
        np.testing.assert_array_equal(ours, hf, err_msg=f"{tag} {name}")


def test_exact_backward_is_not(results):
    tag = "bfloat16/bfloat16/0/plain"
    hf, exact = results[f"{tag}/hf/dx"], results[f"{tag}/exact/dx"]
    np.testing.assert_array_equal(results[f"{tag}/exact/y"], results[f"{tag}/hf/y"])
    assert np.count_nonzero(hf != exact) > 0
