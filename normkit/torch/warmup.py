"""Compile normkit's CPU kernel ahead of its first call (or load it from numba's disk cache).

``kernel="auto"`` runs the CPU kernel from the first call of a process only where it is
compiled on the machine already (`normkit.torch.kernels.cpu.ready`); elsewhere that process
takes the composite path and the kernel is compiled in the background for the next ones.
`warmup` compiles it now: call it at the start of a program (before the first norm call), or
run ``normkit warmup`` (or ``python -m normkit.torch.warmup``) once per machine (a container
build, a CI step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable

import torch

__all__ = ["compile_now", "warmup"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def warmup(dtypes: Iterable[str] = tuple(DTYPES), gated: bool = True) -> None:
    """Compile (or load from the disk cache) the CPU kernel for rows of ``dtypes`` (names:
    ``"float32"``, ``"bfloat16"``, ``"float16"``), and with ``gated`` the kernels of gated and
    grouped specs too; `normkit.torch.kernels.cpu.ready` then says yes for them in this process
    (where it has not said no already) and in later ones. Without numba: nothing to do.

    Raises ValueError for an unknown dtype name, RuntimeError where numba fails to compile."""
    from normkit.torch.kernels import NUMBA, cpu

    names = _known(dtypes)
    if not NUMBA:
        return
    for name in names:
        for family in (False, True) if gated else (False,):
            if not _ready(name, family):
                raise RuntimeError(f"normkit's CPU kernel did not compile: "
                                   f"{cpu.unavailable_reason()}")


def compile_now(dtypes: Iterable[str] = tuple(DTYPES), gated: bool = True,
                say: Callable[[str], None] = print) -> int:
    """`warmup`, saying what it does (``normkit warmup``): per dtype and family whether the
    kernels were compiled now or loaded from the cache, and in how long. Returns 0 when every
    one is ready, 1 where numba is missing or fails to compile; ValueError for an unknown dtype
    name."""
    from normkit.torch.kernels import NUMBA, cpu

    names = _known(dtypes)
    if not NUMBA:
        say("numba is not installed: normkit's CPU kernel is unavailable, and kernel='auto' "
            f"runs the composite path; {cpu.INSTALL}")
        return 1
    say(f"normkit's CPU kernel (numba), cached in {cpu._cache_folder()}")
    for name in names:
        for family in (False, True) if gated else (False,):
            label = name + (", gated and grouped norms" if family else "")
            cached = os.path.exists(cpu._mark(DTYPES[name], family))
            if not cached:
                say(f"{label}: compiling (once per machine: 10-30 s)")
            began = time.perf_counter()
            if not _ready(name, family):
                say(f"{label}: not compiled: {cpu.unavailable_reason()}")
                return 1
            done = "loaded from the cache" if cached else "compiled"
            say(f"{label}: {done} in {time.perf_counter() - began:.1f} s")
    return 0


def _known(dtypes: Iterable[str]) -> list[str]:
    names = list(dtypes)
    unknown = sorted(set(names) - set(DTYPES))
    if unknown:
        raise ValueError(f"unknown dtype names {unknown}: expected some of {sorted(DTYPES)}")
    return names


def _ready(name: str, gated: bool) -> bool:
    """Compile or load the kernels of dtype ``name`` (``gated``: of gated and grouped specs),
    mark them compiled in the cache, and let this process's `cpu.ready` say yes unless it said
    no already; False where they did not compile."""
    from normkit.torch.kernels import cpu

    dtype = DTYPES[name]
    if cpu.load(dtype, gated) is None:
        return False
    cpu._mark_compiled(dtype, gated)
    cpu._state["ready"].setdefault((dtype, gated), True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normkit.torch.warmup",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES),
                        help="a dtype to compile for (repeatable; default: all three)")
    parser.add_argument("--no-gated", action="store_true",
                        help="leave out the kernels of gated and grouped norms")
    # normkit's own background compile (`cpu._compile_in_background`): one family, quietly, at
    # low priority, removing its lock file when done
    parser.add_argument("--family", choices=("plain", "gated"), help=argparse.SUPPRESS)
    parser.add_argument("--background", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lock", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.background:
        os.nice(10)
    try:
        names = args.dtype or list(DTYPES)
        if args.family is None:
            return compile_now(names, gated=not args.no_gated)
        for name in names:
            if not _ready(name, args.family == "gated"):
                from normkit.torch.kernels import cpu

                print(f"not compiled: {cpu.unavailable_reason()}", file=sys.stderr)
                return 1
        return 0
    finally:
        if args.lock:
            try:
                os.remove(args.lock)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
