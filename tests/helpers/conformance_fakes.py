"""A fake conformance hook for the runner's tests: right, wrong, raising or crashing on demand.

``mode="exact"`` implements the hook contract with the reference itself (every spec: a
residual's ``h`` and ``dresidual``, DyT's ``dalpha``), so the harness can be tested without a
framework; the other modes break it in one named way.
"""

import os
import signal
from pathlib import Path

import numpy as np

from normkit import dtypes
from normkit.conformance.compare import Inputs, expected, expected_dtypes, quantities
from normkit.spec import NormSpec

VARIANTS = {
    "mode": (
        "exact", "raise", "skip", "crash", "eps_outside", "print", "plain_call", "drop_h",
        "wrong_h", "wrong_dresidual", "wrong_dalpha", "input_dtype", "segfault_once",
        "segfault_outside", "batch_dependent",
    )
}


def devices() -> list[str]:
    if os.environ.get("NORMKIT_FAKE_PRINT"):
        print("a stray line from devices()")  # noqa: T201 - what the worker must survive
    return ["cpu"]


def reference_outputs(spec: NormSpec, inputs: Inputs) -> tuple:
    """The reference's outputs as an implementation returns them: named by `quantities`, each
    rounded to its expected dtype."""
    values = expected(spec, inputs)
    kinds = expected_dtypes(spec, inputs)
    return tuple(
        None if values[q] is None else dtypes.round_to(values[q], kinds[q])
        for q in quantities(spec)
    )


def bump(a: np.ndarray) -> np.ndarray:
    """``a`` moved by 5% of its largest element (beyond every bound), in its dtype."""
    wide = a.astype(np.float64)
    return dtypes.round_to(wide + 0.05 * np.max(np.abs(wide)), a.dtype)


def evaluate(
    spec: NormSpec, x, dy, scale=None, bias=None, *, residual=None, dh=None, alpha=None,
    device="cpu", mode="exact",
):
    if mode == "print":
        print("a stray line from evaluate()", end="")  # noqa: T201 - no newline, mid-stream
    if mode == "raise":
        raise RuntimeError("kernel exploded")
    if mode == "skip":
        raise NotImplementedError("this fake cannot do that")
    if mode == "crash":
        os._exit(3)
    marker = Path(os.environ.get("NORMKIT_FAKE_MARKER", os.devnull))
    if (mode == "segfault_once" and not marker.exists()) or (
        mode == "segfault_outside" and spec.eps_placement == "outside"
    ):
        if mode == "segfault_once":
            marker.touch()
        os.kill(os.getpid(), signal.SIGSEGV)  # what a framework's segfault looks like
    if mode == "plain_call" and (residual is not None or dh is not None or alpha is not None):
        raise TypeError("a plain spec's call got the extended keywords")
    if mode == "eps_outside":
        spec = spec.replace(eps_placement="outside", eps=1e-2)
    if spec.residual is not None and (residual is None or dh is None):
        raise TypeError("a spec with a residual needs residual= and dh=")
    if spec.kind == "dyt" and alpha is None:
        raise TypeError("the harness passes DyT's alpha")
    outputs = list(reference_outputs(spec, Inputs(x, dy, scale, bias, residual, dh, alpha)))
    names = quantities(spec)
    if mode == "input_dtype":
        outputs[0] = outputs[0].astype(x.dtype)
    for broken, name in (("wrong_h", "h"), ("wrong_dresidual", "dresidual"),
                         ("wrong_dalpha", "dalpha")):
        if mode == broken and name in names:
            i = names.index(name)
            outputs[i] = bump(outputs[i])
    if mode == "drop_h" and "h" in names:
        del outputs[names.index("h")]
    if mode == "batch_dependent":  # y off by one part in 2**6 in batches of an odd row count
        y = outputs[0]
        outputs[0] = dtypes.round_to(y.astype(np.float64) * (1 + 2.0**-6 * (len(x) % 2)), y.dtype)
    return tuple(outputs)
