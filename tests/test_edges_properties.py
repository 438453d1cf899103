"""Property tests over extreme magnitudes for every backend against the reference: rows scaled
by 1e-30 .. 1e30, NaN and infinity placed anywhere, short and long rows. No silent wrong
answer: NaN/inf exactly where the reference has them, finite answers within the tolerance."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from normkit import NormSpec, reference, tolerances

Backend = Callable[[NormSpec, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _torch(spec: NormSpec, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import torch

    from normkit.torch import functional

    xt = torch.tensor(x, requires_grad=True)
    functional.normalize(xt, spec).backward(torch.tensor(dy))
    with torch.no_grad():
        y = functional.normalize(xt.detach(), spec)
    assert xt.grad is not None
    return y.numpy(), xt.grad.numpy()


def _jax(spec: NormSpec, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import jax

    from normkit.jax import functional

    y, vjp = jax.vjp(jax.jit(lambda t: functional.normalize(t, spec)), x)
    return np.asarray(y), np.asarray(vjp(dy)[0])


def _keras(spec: NormSpec, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from normkit.conformance.targets_keras import evaluate

    y, dx, _, _ = evaluate(spec, x, dy)
    return y, dx


BACKENDS = {"torch": _torch, "jax": _jax, "keras": _keras}


@st.composite
def cases(draw: st.DrawFn) -> tuple[NormSpec, np.ndarray, np.ndarray]:
    kind = draw(st.sampled_from(["rms", "partial_rms", "layer"]))
    spec = NormSpec(
        kind,
        p=0.3 if kind == "partial_rms" else None,
        eps_placement=draw(st.sampled_from(["inside", "outside"])),
        eps=draw(st.sampled_from([1e-6, 1e-12, 2.0**-126])),
    )
    n = draw(st.sampled_from([1, 2, 7, 64, 4096]))
    rows = 3
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    exponents = draw(st.lists(st.integers(-30, 30), min_size=rows, max_size=rows))
    x = rng.standard_normal((rows, n)) * 10.0 ** np.array(exponents, dtype=float)[:, None]
    for _ in range(draw(st.integers(0, 2))):
        value = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        x[draw(st.integers(0, rows - 1)), draw(st.integers(0, n - 1))] = value
    dy = rng.standard_normal(x.shape)
    return spec, x.astype(np.float32), dy.astype(np.float32)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_extreme_magnitudes_match_the_reference(backend: str) -> None:
    pytest.importorskip({"torch": "torch", "jax": "jax", "keras": "keras"}[backend])
    run = BACKENDS[backend]

    @settings(max_examples=12, deadline=None)
    @given(cases())
    def prop(case: tuple[NormSpec, np.ndarray, np.ndarray]) -> None:
        spec, x, dy = case
        y, dx = run(spec, x, dy)
        what = f"{backend} {spec} row scales {np.nanmax(np.abs(x), axis=1)}"
        with np.errstate(all="ignore"):
            expected = reference.normalize(x, spec)
            expected_dx = reference.normalize_vjp(x, dy, spec)[0]
        tolerances.assert_close(y, expected, what=f"{what}: y")
        finite_rows = np.isfinite(x).all(axis=1)
        tolerances.assert_close(
            dx[finite_rows], expected_dx[finite_rows], quantity="grad", what=f"{what}: dx"
        )

    prop()
