"""normkit.torch's gate below z = -88.7 (tests/helpers/edge_rows.py): torch's own
``F.silu(-89)`` is 0 (1 / (1 + e^89) is), the reference's about 1e-37. The composite path
computes it from e^-|z| as the CPU kernel does; torch keeps subnormals, so every gradient is
checked."""

from __future__ import annotations

import pytest

from normkit.conformance.targets_torch import evaluate
from tests.helpers import edge_rows


@pytest.mark.parametrize("dtype", list(edge_rows.DTYPES))
@pytest.mark.parametrize("gate", ["after", "before"])
@pytest.mark.parametrize("kernel", ["composite", "cpu"])
def test_the_gates_silu_below_minus_88_is_not_zero(kernel, gate, dtype):
    edge_rows.check_far_gate(
        evaluate, gate, dtype, keeps_subnormals=True, api="functional", kernel=kernel
    )
