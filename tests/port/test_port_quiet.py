"""Probing prints nothing: swap_norms and identify call a module with inputs of their choosing
(half inputs against float32 weights), and the warnings those calls raise are theirs, not the
user's."""

import subprocess
import sys

import pytest

pytest.importorskip("torch")

SWAP = """
import torch
from normkit.port.huggingface import swap_norms
model = torch.nn.Sequential(torch.nn.RMSNorm(16, eps=1e-5), torch.nn.LayerNorm(16))
model, report = swap_norms(model)
assert report.swapped_classes == {"RMSNorm", "LayerNorm"}, report.describe()
"""

IDENTIFY = """
import torch
from normkit.identify import identify
identify(torch.nn.RMSNorm(16), (16,), backend="torch")
"""


@pytest.mark.parametrize("code", [SWAP, IDENTIFY], ids=["swap_norms", "identify"])
def test_a_probe_prints_no_warning(code):
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
