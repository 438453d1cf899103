"""normkit.jax's rows at the edges keep to themselves, as the reference's do (tests/helpers/
edge_rows.py): the rows beside a rescaled one and the NaN in a partial RMS row's tail that
broke normkit.tf (issue 48), held here too."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from normkit.conformance.targets_jax import evaluate  # noqa: E402
from tests.helpers import edge_rows  # noqa: E402


@pytest.mark.parametrize("spec", edge_rows.NEIGHBOUR_SPECS, ids=edge_rows.spec_id)
def test_a_rescaled_row_leaves_its_neighbours_gradients_alone(spec):
    edge_rows.check_neighbours(evaluate, spec, "float32", api="functional", jit=True)


@pytest.mark.parametrize("spec", edge_rows.NAN_TAIL_SPECS, ids=edge_rows.spec_id)
def test_a_nan_in_a_partial_rows_tail_stays_out_of_the_rest_of_the_tail(spec):
    edge_rows.check_nan_tail(evaluate, spec, "float32", api="functional", jit=True)
