"""Identify a gated norm ``forward(x, z, scale, bias) -> y``: the gate's position and
activation, the groups of its statistic, then the norm inside by `identify_forward`.

The gate is read from uniform gates. After the norm, ``y = u(x) a(z)`` scales with ``a``:
``y(z=2) / y(z=1)`` is ``a(2) / a(1)``, 2.41 for SiLU and 1.20 for sigmoid. Before it, a uniform
gate scales the input, which the norm divides out. With ``z = 32``, ``a(z)`` is exactly 32 (SiLU)
or 1 (sigmoid) in float32, so the norm inside is recovered bit for bit, half-precision roundings
included: ``u(x) = y(x, 32) / a(32)`` after the norm, ``u(x) = y(x / a(32), 32)`` before it. The
groups are read from which outputs move when one input moves: every one for a statistic over the
row, the first ``group_size`` for the first group's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from normkit.dtypes import as_float_dtype, round_to
from normkit.identify.forward import Identification, identify_forward
from normkit.identify.framework import bridged_forward
from normkit.spec import GATE_ACTIVATIONS, Gate, GateActivation

__all__ = ["GatedForward", "identify_gated", "identify_gated_forward"]

GatedForward = Callable[
    [np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None], np.ndarray
]
"""``forward(x, z, scale, bias) -> y`` on 2-D rows ``x`` and a gate ``z`` of x's shape and
dtype; ``scale``/``bias`` as in `normkit.identify.forward.Forward`."""

_SEED = 0
_UNIFORM = 32.0  # a(32) is 32 (SiLU) or 1 (sigmoid) exactly in float32
_MATCH = 1e-2  # relative distance within which a prediction of the gate counts as a match
_MOVED = 1e-3  # relative change of an output that counts as "moved"


def _activation(z: npt.ArrayLike, name: str) -> np.ndarray:
    """``silu(z)`` or ``sigmoid(z)`` in float64."""
    z = np.asarray(z, np.float64)
    sig = 1.0 / (1.0 + np.exp(-z))
    return z * sig if name == "silu" else sig


def identify_gated_forward(
    forward: GatedForward,
    n: int,
    *,
    accepts_params: bool,
    dtypes: Sequence[npt.DTypeLike | str] = ("float32", "bfloat16", "float16"),
) -> Identification:
    """Infer the gated `NormSpec` that ``forward`` follows on rows of ``n`` elements.

    Args and the returned `Identification` as in `identify_forward`, whose findings for the
    norm inside follow the gate's and the groups'. Raises ValueError when the output does not
    depend on the gate, or the gate or the statistic is none of the spec's.
    """
    resolved = [as_float_dtype(d, "a probed dtype") for d in dtypes]
    if not resolved:
        raise ValueError("identify needs at least one dtype to probe")
    probe = max(resolved, key=lambda d: ml_dtypes.finfo(d).nmant)
    rng = np.random.default_rng(_SEED)
    x = round_to(rng.standard_normal((8, n)) + 0.5, probe)
    gate, activation, finding = _gate(forward, x, rng)
    a = float(_activation(np.float64(_UNIFORM), activation))

    def inner(x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None) -> np.ndarray:
        z = np.full(x.shape, _UNIFORM, x.dtype)
        if gate == "after":
            y = np.asarray(forward(x, z, scale, bias))
            return y / np.asarray(a, y.dtype)
        return np.asarray(forward(x / np.asarray(a, x.dtype), z, scale, bias))

    # a row of sizable elements: each output moves in proportion when its statistic does
    row = round_to(rng.choice([-1.0, 1.0], (1, n)) * rng.uniform(0.5, 2.0, (1, n)), probe)
    group, group_finding = _group(inner, row)
    if group is None:
        found = identify_forward(inner, n, accepts_params=accepts_params, dtypes=resolved)
    else:
        copies = n // group

        def one_group(
            x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None
        ) -> np.ndarray:
            tiled = [None if p is None else np.tile(p, copies) for p in (scale, bias)]
            return inner(np.tile(x, (1, copies)), *tiled)[:, :group]

        found = identify_forward(one_group, group, accepts_params=accepts_params, dtypes=resolved)
    spec = found.spec.replace(gate=gate, gate_activation=activation, group_size=group)
    return Identification(
        spec, found.undetermined, (finding, group_finding, *found.notes)
    )


def _gate(
    forward: GatedForward, x: np.ndarray, rng: np.random.Generator
) -> tuple[Gate, GateActivation, str]:
    """The gate's position and activation, and the finding behind them."""

    def call(x: np.ndarray, z: np.ndarray) -> np.ndarray:
        y = np.asarray(forward(x, z, None, None))
        if y.shape != x.shape:
            raise ValueError(f"the gated norm returned shape {y.shape} for {x.shape}")
        return y.astype(np.float64)

    uniform = {c: call(x, np.full(x.shape, c, x.dtype)) for c in (1.0, 2.0)}
    sizable = np.abs(uniform[1.0]) > 1e-2 * np.max(np.abs(uniform[1.0]))
    ratio = float(np.median(uniform[2.0][sizable] / uniform[1.0][sizable]))
    if abs(ratio - 1.0) > _MATCH:
        expected = {
            name: float(_activation(np.float64(2), name) / _activation(np.float64(1), name))
            for name in GATE_ACTIVATIONS
        }
        name = min(expected, key=lambda k: abs(expected[k] - ratio))
        if abs(expected[name] - ratio) > _MATCH * expected[name]:
            raise ValueError(
                f"the output scales by {ratio:.4g} when a uniform gate goes from 1 to 2: a gate "
                f"after the norm, but neither SiLU ({expected['silu']:.4g}) nor sigmoid "
                f"({expected['sigmoid']:.4g})"
            )
        return "after", name, (
            f"gate: after the norm, {name} (a uniform gate from 1 to 2 scales y by {ratio:.4g})"
        )
    z = round_to(1.5 * rng.standard_normal(x.shape), x.dtype)
    gated = call(x, z)
    if np.max(np.abs(gated - uniform[1.0])) <= _MATCH * np.max(np.abs(uniform[1.0])):
        raise ValueError("the output does not depend on the gate: not a gated norm")
    uniform_gate = np.full(x.shape, _UNIFORM, x.dtype)
    scale = np.max(np.abs(gated))
    errors = {}
    for name in GATE_ACTIVATIONS:
        a = _activation(z.astype(np.float64), name) / _activation(np.float64(_UNIFORM), name)
        predicted = call(round_to(x.astype(np.float64) * a, x.dtype), uniform_gate)
        errors[name] = float(np.max(np.abs(predicted - gated)) / scale)
    name = min(errors, key=lambda k: errors[k])
    if errors[name] > _MATCH:
        raise ValueError(
            "a uniform gate leaves the output unchanged but y(x, z) is not the norm of "
            f"x * a(z) for a = SiLU or sigmoid (relative errors {errors})"
        )
    return "before", name, (
        f"gate: before the norm, {name} (y(x, z) is the norm of x * {name}(z) to "
        f"{errors[name]:.1e}; a uniform gate changes y by {abs(ratio - 1):.1e})"
    )


def _group(
    inner: Callable[[np.ndarray, Any, Any], np.ndarray], row: np.ndarray
) -> tuple[int | None, str]:
    """The statistic's group size (None: the whole row) from which outputs move with one
    input, and the finding."""
    n = row.shape[1]

    y0 = np.asarray(inner(row, None, None), np.float64)[0]

    def moved(j: int) -> np.ndarray:
        changed = row.astype(np.float64)
        changed[0, j] = 16.0  # many times the row's RMS: its group's statistic changes a lot
        y1 = np.asarray(inner(round_to(changed, row.dtype), None, None), np.float64)[0]
        move = np.abs(y1 - y0) > _MOVED * np.abs(y0)
        move[j] = True
        return move

    first = moved(0)
    if first.all():
        return None, "groups: none (every output moves with the first input)"
    size = int(np.argmin(first))
    expected = np.zeros(n, bool)
    expected[:size] = True
    if size < 2 or n % size or not (first == expected).all():
        raise ValueError(
            f"the first input moves outputs {np.flatnonzero(first).tolist()}: neither the whole "
            "row nor a first group of consecutive elements"
        )
    second = np.roll(expected, size)
    if n > size and not (moved(size) == second).all():
        raise ValueError(f"the outputs move in groups of {size} for the first group only")
    return size, f"groups: {n // size} of {size} elements (an input moves its group's outputs)"


def identify_gated(
    fn: Callable[..., Any],
    shape: Sequence[int],
    *,
    backend: str,
    params: bool = False,
    device: str = "cpu",
    dtypes: Sequence[str] = ("float32", "bfloat16", "float16"),
) -> Identification:
    """`identify` for a gated norm of a framework: ``fn(x, gate) -> y``, or
    ``fn(x, gate, scale, bias) -> y`` with ``params=True``; ``gate`` has x's shape and dtype.
    Arguments and results as in `normkit.identify.identify`."""
    def call(xz: Any, scale: Any, bias: Any) -> Any:  # x and the gate stacked on a first axis
        return fn(xz[0], xz[1], scale, bias) if params else fn(xz[0], xz[1])

    stacked = bridged_forward(call, shape, backend, device)

    def forward(
        x: np.ndarray, z: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None
    ) -> np.ndarray:
        return stacked(np.stack([x, z.astype(x.dtype)]), scale, bias)

    n = math.prod(shape)
    return identify_gated_forward(forward, n, accepts_params=params, dtypes=dtypes)
