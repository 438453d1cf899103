"""A fake conformance hook for the runner's tests: right, wrong, raising or crashing on demand."""

import os

import numpy as np

from normkit import dtypes, reference
from normkit.spec import NormSpec

VARIANTS = {"mode": ("exact", "raise", "skip", "crash", "eps_outside", "print")}


def devices() -> list[str]:
    if os.environ.get("NORMKIT_FAKE_PRINT"):
        print("a stray line from devices()")  # noqa: T201 - what the worker must survive
    return ["cpu"]


def evaluate(spec: NormSpec, x, dy, scale=None, bias=None, *, device="cpu", mode="exact"):
    if mode == "print":
        print("a stray line from evaluate()", end="")  # noqa: T201 - no newline, mid-stream
    if mode == "raise":
        raise RuntimeError("kernel exploded")
    if mode == "skip":
        raise NotImplementedError("this fake cannot do that")
    if mode == "crash":
        os._exit(3)
    if mode == "eps_outside":
        spec = spec.replace(eps_placement="outside", eps=1e-2)
    y = reference.normalize(x, spec, scale, bias)
    dx, ds, db = reference.normalize_vjp(x, dy, spec, scale, bias)

    def as_param(g):
        return None if g is None else g.astype(np.float32)

    return y, dtypes.round_to(dx, x.dtype), as_param(ds), as_param(db)
