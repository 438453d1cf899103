"""Table 1 of the RMSNorm paper (Zhang & Sennrich, 2019), every cell, both directions.

The layer is y = f(norm(W x)) (f = tanh, with a learned gain and bias inside the norm); a cell
is invariant when the transformation leaves y unchanged. Where the table says yes, a hypothesis
property checks it for random data and positive factors; where it says no, a concrete
counter-example shows a change. eps is tiny, since the invariances hold exactly only at eps = 0.

                      W re-scale  W re-center  w_i re-scale  X re-scale  X re-center  x_j re-scale
    LayerNorm             yes        yes           no            yes         no           yes
    RMSNorm               yes        no            no            yes         no           yes
    partial RMSNorm       yes        no            no            yes         no           yes
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from normkit import NormSpec, reference

NEURONS, INPUTS, CASES = 8, 5, 4
NORMS = {
    "layer": NormSpec("layer", eps=1e-14),
    "rms": NormSpec("rms", eps=1e-14),
    "partial_rms": NormSpec("partial_rms", p=0.25, eps=1e-14),  # k = 2 of 8 neurons
}


def weight_matrix_rescale(W, X, delta, gamma):
    return delta * W, X


def weight_matrix_recenter(W, X, delta, gamma):
    return W + gamma[None, :], X  # every neuron's summed input shifts by gamma . x


def weight_vector_rescale(W, X, delta, gamma):
    W = W.copy()
    W[NEURONS - 1] *= delta  # one neuron's incoming weights
    return W, X


def dataset_rescale(W, X, delta, gamma):
    return W, delta * X


def dataset_recenter(W, X, delta, gamma):
    return W, X + gamma[None, :]


def single_case_rescale(W, X, delta, gamma):
    X = X.copy()
    X[0] *= delta
    return W, X


TRANSFORMS = {
    "weight_matrix_rescale": weight_matrix_rescale,
    "weight_matrix_recenter": weight_matrix_recenter,
    "weight_vector_rescale": weight_vector_rescale,
    "dataset_rescale": dataset_rescale,
    "dataset_recenter": dataset_recenter,
    "single_case_rescale": single_case_rescale,
}

TABLE = {
    "layer": (True, True, False, True, False, True),
    "rms": (True, False, False, True, False, True),
    "partial_rms": (True, False, False, True, False, True),
}
CELLS = [(norm, name, TABLE[norm][i]) for norm in TABLE for i, name in enumerate(TRANSFORMS)]


def layer_output(W, X, spec, gain, bias):
    summed = X @ W.T  # one row of summed inputs per training case
    return np.tanh(reference.normalize(summed, spec, gain, bias if spec.bias else None))


def draw(seed):
    rng = np.random.default_rng(seed)
    W = rng.normal(size=(NEURONS, INPUTS))
    X = rng.normal(size=(CASES, INPUTS))
    gamma = rng.normal(size=INPUTS)
    gain = rng.uniform(0.5, 1.5, size=NEURONS)
    bias = rng.normal(scale=0.1, size=NEURONS)
    return W, X, gamma, gain, bias


def change(norm, transform, seed, delta):
    spec = NORMS[norm]
    W, X, gamma, gain, bias = draw(seed)
    before = layer_output(W, X, spec, gain, bias)
    W2, X2 = TRANSFORMS[transform](W, X, delta, gamma)
    return np.max(np.abs(layer_output(W2, X2, spec, gain, bias) - before))


def test_table_has_every_cell():
    assert len(CELLS) == 18
    assert sum(invariant for _, _, invariant in CELLS) == 10


@pytest.mark.parametrize("norm, transform", [(n, t) for n, t, inv in CELLS if inv])
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), delta=st.floats(0.1, 10.0))
def test_invariant_cells(norm, transform, seed, delta):
    assert change(norm, transform, seed, delta) < 1e-9


@pytest.mark.parametrize("norm, transform", [(n, t) for n, t, inv in CELLS if not inv])
def test_non_invariant_cells_have_a_counter_example(norm, transform):
    assert change(norm, transform, seed=7, delta=3.0) > 1e-2


def test_rescaling_by_a_negative_factor_is_not_invariant():
    # The paper's invariances are for positive factors: RMS(-a) = RMS(a) flips the output's sign.
    for norm in NORMS:
        assert change(norm, "dataset_rescale", seed=7, delta=-1.0) > 1e-2
