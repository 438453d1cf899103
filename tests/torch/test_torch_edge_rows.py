"""normkit.torch's gate below z = -88.7 (tests/helpers/edge_rows.py): torch's own
``F.silu(-89)`` is 0 (1 / (1 + e^89) is), the reference's about 1e-37. The composite path
computes it from e^-|z| as the CPU kernel and the Triton kernels do; torch keeps subnormals on
the CPU, so every gradient is checked there. On a GPU (gpu-marked) the composite path and the
compiled Triton kernels, whose exponentials may flush subnormals, are held to y and dgate."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from normkit.conformance.targets_torch import evaluate
from tests.helpers import edge_rows

INTERPRETED = (
    importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
)
KERNELS = ["composite", "cpu"] + ["triton"] * INTERPRETED


@pytest.mark.parametrize("dtype", list(edge_rows.DTYPES))
@pytest.mark.parametrize("gate", ["after", "before"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_gates_silu_below_minus_88_is_not_zero(kernel, gate, dtype):
    edge_rows.check_far_gate(
        evaluate, gate, dtype, keeps_subnormals=True, api="functional", kernel=kernel
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gate", ["after", "before"])
@pytest.mark.parametrize("kernel", ["composite", "triton"])
def test_the_gates_silu_below_minus_88_is_not_zero_on_a_gpu(kernel, gate, dtype):
    edge_rows.check_far_gate(
        evaluate, gate, dtype, api="functional", kernel=kernel, device="cuda:0"
    )
