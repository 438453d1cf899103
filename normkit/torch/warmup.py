"""Compile normkit's CPU kernel ahead of its first call (or load it from numba's disk cache).

``kernel="auto"`` runs the CPU kernel from the first call of a process only where it is
compiled on the machine already (`normkit.torch.kernels.cpu.ready`); elsewhere that process
takes the composite path and the kernel is compiled in the background for the next ones.
`warmup` compiles it now: call it at the start of a program (before the first norm call), or
run ``python -m normkit.torch.warmup`` once per machine (a container build, say).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable

import torch

__all__ = ["warmup"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def warmup(dtypes: Iterable[str] = tuple(DTYPES), gated: bool = True) -> None:
    """Compile (or load from the disk cache) the CPU kernel for rows of ``dtypes`` (names:
    ``"float32"``, ``"bfloat16"``, ``"float16"``), and with ``gated`` the kernels of gated and
    grouped specs too; `normkit.torch.kernels.cpu.ready` then says yes for them in this process
    (where it has not said no already) and in later ones. Without numba: nothing to do.

    Raises ValueError for an unknown dtype name, RuntimeError where numba fails to compile."""
    from normkit.torch.kernels import NUMBA, cpu

    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise ValueError(f"unknown dtype names {unknown}: expected some of {sorted(DTYPES)}")
    if not NUMBA:
        return
    for name in dtypes:
        for family in (False, True) if gated else (False,):
            if cpu.load(DTYPES[name], family) is None:
                raise RuntimeError(f"normkit's CPU kernel did not compile: "
                                   f"{cpu.unavailable_reason()}")
            cpu._mark_compiled(DTYPES[name], family)
            cpu._state["ready"].setdefault((DTYPES[name], family), True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normkit.torch.warmup",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES),
                        help="a dtype to compile for (default: all three)")
    parser.add_argument("--gated", action="store_true",
                        help="the kernels of gated and grouped specs only")
    parser.add_argument("--background", action="store_true",
                        help="at low priority (as normkit starts it)")
    parser.add_argument("--lock", help="a file to remove when done (normkit's)")
    args = parser.parse_args(argv)
    if args.background:
        os.nice(10)
    try:
        from normkit.torch.kernels import cpu

        for name in args.dtype or DTYPES:
            if cpu.load(DTYPES[name], args.gated) is None:
                print(f"not compiled: {cpu.unavailable_reason()}", file=sys.stderr)
                return 1
            cpu._mark_compiled(DTYPES[name], args.gated)
    finally:
        if args.lock:
            try:
                os.remove(args.lock)
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
