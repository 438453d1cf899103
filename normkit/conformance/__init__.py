"""Conformance: every implementation of a norm checked against `normkit.reference`.

`run` checks normkit's adapters (or, with ``peers=True``, the frameworks' built-in layers) on a
matrix of cases, forward and backward, each target in a worker process of its own, and
compares the targets with each other. Importing this module imports no framework.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from normkit.conformance.cases import CASE_DTYPES, Case, matrix
from normkit.conformance.identify import Identification, identify_forward
from normkit.conformance.runner import Report
from normkit.conformance.targets import TARGETS, Target, select
from normkit.spec import KINDS

__all__ = ["run", "identify", "Identification", "Case", "Report", "Target", "TARGETS", "matrix"]


def run(
    *,
    backends: Sequence[str] | None = None,
    kinds: Sequence[str] = KINDS,
    dtypes: Sequence[str] | None = None,
    devices: Sequence[str] | None = None,
    quick: bool = False,
    peers: bool = False,
    jobs: int = 2,
    pairwise: bool = True,
    progress: bool = True,
) -> Report:
    """Run the conformance matrix and return its report.

    Args:
      backends: target names or prefixes (``"torch"``, ``"tf"``, ``"tf[jax,jit]"``, ``"jax.nnx"``);
        all when None. A target whose framework is not installed is skipped with the reason.
      kinds: the norm kinds to cover.
      dtypes: the input dtypes (float32, float16, bfloat16); all when None.
      devices: device names (``"cpu"``, ``"cuda:0"``, ...); every device each backend sees when None.
      quick: a small matrix that still touches every option.
      peers: check the frameworks' built-in layers against the NormSpec each appears to implement.
      jobs: worker processes at once.
      pairwise: compare every two targets' outputs on the cases both ran.
      progress: draw a progress bar on stderr.
    """
    from normkit.conformance import runner

    case_dtypes = tuple(dtypes) if dtypes else CASE_DTYPES
    if peers:
        from normkit.conformance import peers as peer_targets

        chosen = select(list(backends) if backends else None, peer_targets.PEERS)
        return runner.run(
            chosen,
            lambda t: peer_targets.cases(t, quick=quick, case_dtypes=case_dtypes),
            devices=devices,
            jobs=jobs,
            pairwise=False,
            progress=progress,
        )
    cases = matrix(quick=quick, kinds=tuple(kinds), case_dtypes=case_dtypes)
    chosen = select(list(backends) if backends else None)
    return runner.run(chosen, lambda t: cases, devices=devices, jobs=jobs, pairwise=pairwise, progress=progress)


def identify(
    fn: Callable[..., Any],
    shape: Sequence[int],
    *,
    backend: str,
    params: bool = False,
    device: str = "cpu",
    dtypes: Sequence[str] = ("float32", "bfloat16", "float16"),
) -> Identification:
    """Infer the NormSpec a framework function follows, by probing it (see `identify_forward`).

    Args:
      fn: a function of ``backend``: ``fn(x) -> y``, or ``fn(x, scale, bias) -> y`` with
        ``params=True`` (then the scale, offset, bias and cast order can be determined too).
      shape: the normalized shape: ``fn`` is called on inputs of shape ``(rows, *shape)`` and
        normalizes over all of ``shape``.
      backend: ``"torch"``, ``"jax"`` or ``"tf"``.
      params: whether ``fn`` takes ``scale`` and ``bias`` (arrays of ``shape``).
      device: a device the framework sees.
      dtypes: the input dtypes to probe.

    Returns the spec with what could not be determined (``undetermined``) and the findings
    (``notes``). Raises ValueError if ``fn`` does not behave like any of the three kinds.
    """
    from normkit.conformance.bridges import get

    bridge = get(backend)
    shape = tuple(shape)
    n = math.prod(shape)
    call = fn if params else (lambda x, scale, bias: fn(x))

    def forward(x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None) -> np.ndarray:
        reshaped = [None if a is None else a.reshape(shape) for a in (scale, bias)]
        y = bridge.forward(call, x.reshape((x.shape[0], *shape)), *reshaped, device)
        return y.reshape(x.shape[0], n)

    return identify_forward(forward, n, accepts_params=params, dtypes=dtypes)
