"""A conformance worker: one hook's targets, run in a process of its own (`normkit.workers`).

``python -m normkit.conformance.worker`` reads a job ``{"hook", "targets", "devices", "outdir"}``
and emits per target ``{"target", "devices"}``, one result per case and device, the
identification for peers, ``{"target", "device", "batch_invariance"}`` per device (each probe
of `normkit.conformance.batch_invariance` that the job lists), and ``{"target", "seconds"}``.
Each hook gets its own process because Keras fixes its backend at import, and because one
framework crashing or leaking memory must not take the others with it.

A worker keeps JAX's and TensorFlow's XLA compilations in their persistent caches
(`jax_compilation_cache`, `tf_compilation_cache`), so that the targets and the runs that compile
the same program share them: a second run compiles nothing anew.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from normkit import dtypes, workers
from normkit.conformance import batch_invariance
from normkit.conformance.cases import Case
from normkit.conformance.compare import compare, quantities
from normkit.conformance.result import Result
from normkit.conformance.targets import Hook

CACHE_DIR_ENV = "NORMKIT_JAX_CACHE_DIR"
TF_CACHE_DIR_ENV = "NORMKIT_TF_XLA_CACHE_DIR"


def _user_cache(name: str) -> Path:
    """``normkit/<name>`` in the user's cache folder (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "normkit" / name


def tf_compilation_cache() -> str:
    """Where TensorFlow keeps this worker's XLA compilations (``jit_compile=True``, on every
    device type, the CPU's included), set in ``TF_XLA_FLAGS`` before TensorFlow is imported:
    ``$NORMKIT_TF_XLA_CACHE_DIR``, by default ``normkit/tf-xla`` in the user's cache folder.
    An empty ``NORMKIT_TF_XLA_CACHE_DIR`` turns it off; a persistent cache already named in
    ``TF_XLA_FLAGS`` is kept. Returns the folder in use ("" for none)."""
    flags = os.environ.get("TF_XLA_FLAGS", "")
    named = re.search(r"--tf_xla_persistent_cache_directory=(\S*)", flags)
    if named:
        return named.group(1)
    folder = os.environ.get(TF_CACHE_DIR_ENV, str(_user_cache("tf-xla")))
    if folder:
        os.environ["TF_XLA_FLAGS"] = (
            f"{flags} --tf_xla_persistent_cache_directory={folder} "
            "--tf_xla_persistent_cache_device_types=CPU,GPU,TPU"
        ).strip()
    return folder


def jax_compilation_cache() -> str:
    """Where JAX keeps this worker's compilations, set in the environment JAX reads when it is
    imported: ``$NORMKIT_JAX_CACHE_DIR``, by default ``normkit/jax`` in the user's cache folder
    (``$XDG_CACHE_HOME``, else ``~/.cache``); every compilation is kept, however quick. An
    empty ``NORMKIT_JAX_CACHE_DIR`` turns the cache off, and a ``JAX_COMPILATION_CACHE_DIR``
    already set is left as it is. Returns the folder in use ("" for none)."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    folder = os.environ.get(CACHE_DIR_ENV, str(_user_cache("jax")))
    if folder:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return folder


def run_job(job: Mapping[str, Any], emit: workers.Emit) -> None:
    """Run ``job``: one hook module, the targets that use it, each with its variant and cases."""
    jax_compilation_cache()
    tf_compilation_cache()
    hook: Hook = importlib.import_module(job["hook"])
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
                    result = _run_case(
                        hook, name, target["variant"], case, device, job.get("outdir")
                    )
                else:
                    result = Result(
                        name, device, case, "SKIP", f"device {device} not present ({seen})"
                    )
                emit(result.to_dict())
        if target.get("identify"):
            emit({"target": name, "identified": _identify(hook, target["variant"])})
        probes = [batch_invariance.Probe.from_dict(p) for p in target.get("batch_invariance", [])]
        for device in wanted if probes else []:
            if device in seen:
                found = _batch_invariance(hook, target["variant"], probes, device)
                emit({"target": name, "device": device, "batch_invariance": found})
        emit({"target": name, "seconds": time.perf_counter() - began})


def _run_case(
    hook: Hook, name: str, variant: dict[str, Any], case: Case, device: str, outdir: str | None
) -> Result:
    inputs = case.arrays()
    x, dy, scale, bias, residual, dh, alpha, gate = inputs
    # the contract's keywords, only where the spec has them: a plain spec's call is unchanged
    extra: dict[str, Any] = {}
    if case.spec.gate is not None:
        extra["gate"] = gate
    if case.spec.residual is not None:
        extra.update(residual=residual, dh=dh)
    if case.spec.kind == "dyt":
        extra["alpha"] = alpha
    try:
        outputs = tuple(
            hook.evaluate(case.spec, x, dy, scale, bias, **extra, device=device, **variant)
        )
    except NotImplementedError as exc:
        return Result(name, device, case, "SKIP", str(exc))
    except Exception as exc:  # an implementation's failure is a finding, not a crash
        return Result(
            name, device, case, "FAIL", f"raised {type(exc).__name__}: {exc}".splitlines()[0]
        )
    problems, measured = compare(case.spec, inputs, outputs, rows=case.rows)
    figures = {q: m.to_dict() for q, m in measured.items()}
    names = quantities(case.spec)
    if outdir and len(outputs) == len(names):
        path = os.path.join(outdir, f"{name}@{device}@{case.id}.npz")
        arrays: dict[str, Any] = {
            q: _savable(o) for q, o in zip(names, outputs, strict=True) if o is not None
        }
        np.savez(path, **arrays)
    return Result(name, device, case, "FAIL" if problems else "PASS", "; ".join(problems), figures)


def _batch_invariance(
    hook: Hook, variant: dict[str, Any], probes: list[batch_invariance.Probe], device: str
) -> dict[str, Any]:
    """Per probe label, what the target's bits were found to depend on (`BatchInvariance` as a
    dict), or ``{"skip": reason}`` / ``{"error": message}``. A hook that can set its framework's
    thread count (``set_threads``) has it checked too; one that says why a variant cannot be
    probed (``probes_skipped(device, **variant)``) is skipped with its reason."""
    skipped = getattr(hook, "probes_skipped", lambda device, **variant: None)(device, **variant)
    if skipped:
        return {probe.label: {"skip": skipped} for probe in probes}
    found: dict[str, Any] = {}
    for probe in probes:
        try:
            checked = batch_invariance.probe(
                hook.evaluate, probe, device=device,
                set_threads=getattr(hook, "set_threads", None), **variant,
            )
            found[probe.label] = checked.to_dict()
        except NotImplementedError as exc:
            found[probe.label] = {"skip": str(exc)}
        except Exception as exc:  # an implementation's failure is a finding, not a crash
            found[probe.label] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    return found


def _identify(hook: Any, variant: dict[str, Any]) -> dict[str, Any]:
    try:
        found = hook.identify(**variant)
    except ValueError as exc:
        return {"error": str(exc)}
    return {
        "spec": found.spec.to_dict(),
        "undetermined": list(found.undetermined),
        "notes": list(found.notes),
    }


def _savable(a: np.ndarray) -> np.ndarray:
    # npz cannot store ml_dtypes' bfloat16; float32 holds it exactly
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype == dtypes.bfloat16 else a


if __name__ == "__main__":
    workers.serve(run_job)
