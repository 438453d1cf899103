"""A conformance worker: runs one target's cases in a process of its own.

`main` (``python -c "from normkit.conformance.worker import main; main()"``) reads a job (JSON) on stdin and writes one JSON line per
event on stdout: first ``{"devices": [...]}``, then one result per case and device. Each
target gets its own process because Keras fixes its backend at import, and because one
framework crashing or leaking memory must not take the others with it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from normkit import dtypes, reference, tolerances
from normkit.conformance.cases import Case
from normkit.spec import NormSpec

QUANTITIES = ("y", "dx", "dscale", "dbias")


@dataclass
class Result:
    """The outcome of one case on one device: PASS, FAIL or SKIP, with figures or the reason."""

    target: str
    device: str
    case: Case
    status: str
    reason: str = ""
    measurements: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def worst(self) -> float:
        """The largest error as a fraction of its bound (above 1 fails); 0 without figures."""
        return max((m["error"] / m["bound"]["value"] for m in self.measurements.values()), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "device": self.device,
            "case_id": self.case.id,
            "case": self.case.label,
            **self.case.to_dict(),
            "status": self.status,
            "reason": self.reason,
            "worst_fraction_of_bound": self.worst,
            "measurements": self.measurements,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        return cls(
            data["target"], data["device"], Case.from_dict(data), data["status"], data["reason"], data["measurements"]
        )


Arrays = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


def compare(
    spec: NormSpec, inputs: Arrays, outputs: Arrays, quantities: tuple[str, ...] = QUANTITIES
) -> tuple[list[str], dict[str, tolerances.Measurement]]:
    """Compare an implementation's ``(y, dx, dscale, dbias)`` with the reference's.

    ``inputs`` is ``(x, dy, scale, bias)``; only ``quantities`` are checked. Returns the problems
    found (empty when it conforms: every quantity within `normkit.tolerances`, in the expected
    dtype: ``y`` and ``dx`` in x's, each parameter gradient in its parameter's) and the
    measurements.
    """
    x, dy, scale, bias = inputs
    expected = (reference.normalize(x, spec, scale, bias), *reference.normalize_vjp(x, dy, spec, scale, bias))
    expected_dtypes = (x.dtype, x.dtype, *(np.asarray(p).dtype if p is not None else np.dtype(np.float32) for p in (scale, bias)))
    problems = []
    measurements = {}
    for name, got, want, want_dtype in zip(QUANTITIES, outputs, expected, expected_dtypes):
        if name not in quantities:
            continue
        if want is None or got is None:
            if (want is None) != (got is None):
                problems.append(f"{name} is {'missing' if got is None else 'unexpected'}")
            continue
        got = np.asarray(got)
        if got.dtype != want_dtype:
            problems.append(f"{name} has dtype {got.dtype.name}, expected {want_dtype.name}")
        if got.shape != want.shape:
            problems.append(f"{name} has shape {got.shape}, expected {want.shape}")
            continue
        quantity = "forward" if name == "y" else "grad"
        magnitude = None
        if name == "y" and spec.cast == "before_scale" and dtypes.is_half(x.dtype):
            magnitude = reference.scaled_magnitude(x, spec, scale)
        m = tolerances.measure(got.astype(np.float64), want, want_dtype, quantity, spec.cast, magnitude)
        measurements[name] = m
        if not m.passed:
            problems.append(f"{name}: {m.describe()}")
    return problems, measurements


def run_job(job: dict[str, Any], emit: Any) -> None:
    """Run ``job``: one hook module, the targets that use it, each with its variant and cases.

    Emits per target ``{"target", "devices"}``, one result per case and device, the
    identification for peers, and ``{"target", "seconds"}`` when the target is done.
    """
    hook = importlib.import_module(job["hook"])
    seen = hook.devices()
    wanted = job.get("devices") or seen
    for target in job["targets"]:
        began = time.perf_counter()
        name = target["name"]
        emit({"target": name, "devices": seen})
        for case_data in target["cases"]:
            case = Case.from_dict(case_data)
            for device in wanted:
                if device in seen:
                    result = _run_case(hook, name, target["variant"], case, device, job.get("outdir"))
                else:
                    result = Result(name, device, case, "SKIP", f"device {device} not present ({seen})")
                emit(result.to_dict())
        if target.get("identify"):
            emit({"target": name, "identified": _identify(hook, target["variant"])})
        emit({"target": name, "seconds": time.perf_counter() - began})


def _run_case(hook: Any, name: str, variant: dict[str, Any], case: Case, device: str, outdir: str | None) -> Result:
    x, dy, scale, bias = case.inputs()
    try:
        outputs = hook.evaluate(case.spec, x, dy, scale, bias, device=device, **variant)
    except NotImplementedError as exc:
        return Result(name, device, case, "SKIP", str(exc))
    except Exception as exc:  # an implementation's failure is a finding, not a crash
        return Result(name, device, case, "FAIL", f"raised {type(exc).__name__}: {exc}".splitlines()[0])
    problems, measured = compare(case.spec, (x, dy, scale, bias), outputs)
    figures = {q: m.to_dict() for q, m in measured.items()}
    if outdir:
        path = os.path.join(outdir, f"{name}@{device}@{case.id}.npz")
        np.savez(path, **{q: _savable(o) for q, o in zip(QUANTITIES, outputs) if o is not None})
    return Result(name, device, case, "FAIL" if problems else "PASS", "; ".join(problems), figures)


def _identify(hook: Any, variant: dict[str, Any]) -> dict[str, Any]:
    try:
        found = hook.identify(**variant)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"spec": found.spec.to_dict(), "undetermined": list(found.undetermined), "notes": list(found.notes)}


def _savable(a: np.ndarray) -> np.ndarray:
    # npz cannot store ml_dtypes' bfloat16; float32 holds it exactly
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype == dtypes.bfloat16 else a


def main() -> None:
    job = json.load(sys.stdin)

    def emit(event: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    try:
        run_job(job, emit)
    except Exception:
        emit({"fatal": traceback.format_exc()})
        raise SystemExit(1) from None

