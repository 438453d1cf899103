"""Conformance: every implementation of a norm checked against `normkit.reference`.

`run` checks normkit's adapters (or, with ``peers=True``, the frameworks' built-in layers) on a
matrix of cases, forward and backward, each target in a worker process of its own, and
compares the targets with each other. Importing this module imports no framework.
"""

from __future__ import annotations

from collections.abc import Sequence

from normkit.arguments import refuse_empty
from normkit.backends import device_name
from normkit.conformance.cases import (
    CASE_DTYPES,
    MATRIX_DTYPES,
    Case,
    check_filters,
    lean,
    matrix,
)
from normkit.conformance.runner import Report
from normkit.conformance.targets import LEAN_COST, TARGETS, Hook, Target, select
from normkit.identify import Identification, identify
from normkit.spec import ALL_KINDS

__all__ = [
    "run", "identify", "Identification", "Case", "Hook", "Report", "Target", "TARGETS", "matrix",
]


def run(
    *,
    backends: Sequence[str] | None = None,
    kinds: Sequence[str] = ALL_KINDS,
    dtypes: Sequence[str] | None = None,
    devices: Sequence[str] | None = None,
    quick: bool = False,
    peers: bool = False,
    jobs: int = 2,
    pairwise: bool = True,
    invariance: bool = True,
    progress: bool = True,
) -> Report:
    """Run the conformance matrix and return its report.

    An empty ``backends``, ``kinds``, ``dtypes`` or ``devices`` would select nothing: it raises
    ValueError (leave the argument out for all).

    Args:
      backends: target names or prefixes (``"torch"``, ``"tf"``, ``"tf[jax,jit]"``, ``"jax.nnx"``);
        all when None. A target whose framework is not installed is skipped with the reason.
      kinds: the norm kinds to cover.
      dtypes: the input dtypes (float32, float16, bfloat16, float64); all when None (the peers:
        all but float64).
      devices: device names (``"cpu"``, ``"cuda:0"`` or its alias ``"gpu:0"``, ...); every
        device each backend sees when None.
      quick: the default matrix, which still touches every kind, option and dtype; the targets
        that compile each program (`normkit.conformance.targets.LEAN_COST`) run its `lean`
        subset, which does too.
      peers: check the frameworks' built-in layers against the NormSpec each appears to implement.
      jobs: worker processes at once, at least 1.
      pairwise: compare every two targets' outputs on the cases both ran.
      invariance: state each target's batch invariance (`normkit.conformance.batch_invariance`):
        whether a row's bits depend on its batch's row count, order, its position there and,
        for torch, the thread count.
      progress: show progress with an estimate of the time left on stderr.
    """
    from normkit.conformance import runner

    refuse_empty(kinds=kinds, dtypes=dtypes, devices=devices)
    wanted = [device_name(d) for d in devices] if devices else None
    which = "default" if quick else "full"
    if peers:
        from normkit.conformance import peers as peer_targets

        chosen = select(None if backends is None else list(backends), peer_targets.PEERS)
        check_filters(tuple(kinds), tuple(dtypes or ()))

        def peer_cases(t: Target) -> list[Case]:
            if t.claims is None or t.claims.kind not in kinds:
                return []
            return peer_targets.cases(t, quick=quick, case_dtypes=dtypes or CASE_DTYPES)

        if not any(peer_cases(t) for t in chosen):
            raise ValueError(
                _selects_nothing(kinds, dtypes, f"the {which} matrix of the built-in layers "
                                 f"(dtypes {', '.join(CASE_DTYPES)})")
            )
        return runner.run(
            chosen, peer_cases, devices=wanted, jobs=jobs, pairwise=False,
            invariance=invariance, progress=progress,
        )
    cases = matrix(quick=quick, kinds=tuple(kinds), case_dtypes=tuple(dtypes or MATRIX_DTYPES))
    if not cases:
        raise ValueError(_selects_nothing(kinds, dtypes, f"the {which} matrix"))
    chosen = select(None if backends is None else list(backends))
    trimmed = lean(cases)
    compiling = [t.name for t in chosen if quick and t.cost >= LEAN_COST]
    report = runner.run(
        chosen, lambda t: trimmed if t.name in compiling else cases, devices=wanted, jobs=jobs,
        pairwise=pairwise, invariance=invariance, progress=progress,
    )
    report.lean = [name for name in compiling if name not in report.skipped_targets]
    return report


def _selects_nothing(kinds: Sequence[str], dtypes: Sequence[str] | None, where: str) -> str:
    """The error of filters that select no case of ``where``, naming them."""
    named = [f"kinds {list(kinds)}"] if tuple(kinds) != ALL_KINDS else []
    named += [f"dtypes {list(dtypes)}"] if dtypes else []
    return f"{' and '.join(named) or 'the filters'} select no case of {where}"
