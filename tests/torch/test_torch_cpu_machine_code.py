"""Structural guards for the speed of normkit's CPU kernel (nothing is timed), read from numba's
machine code (`tests/torch/cpu_machine_code.py`): every row loop compiles to packed (SIMD) float
arithmetic, the parameter scans to packed compares. Read on this machine's CPU, and for CPUs
of every x86-64 vector width numba may target (each compiled in a process of its own, since
numba reads its target when it starts; nothing compiled is run): baseline x86-64 (SSE2),
Intel and AMD AVX2, Intel and AMD AVX-512. Scalar code fails each guard: loops written to run
one element at a time, and the kernels' own loops compiled with LLVM's loop vectorizer off."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.torch import cpu_machine_code as mc

pytest.importorskip("numba")
pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="reads x86 machine code")

TARGETS = {
    "x86-64": "sse2",
    "haswell": "avx2",
    "znver3": "avx2",
    "skylake-avx512": "avx512",
    "emeraldrapids": "avx512",
    "znver4": "avx512",
}
"""CPU names LLVM knows, by the widest vectors they have: Intel's AVX-512 CPUs are tuned for
256-bit vectors (compares into mask registers on 128 or 256 bits), AMD's Zen 4 for 512."""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_row_loop_compiles_to_vector_code(dtype: str) -> None:
    """Each loop over a row, the reads of its statistic and the writes of its output,
    compiles to packed (SIMD) float arithmetic on this machine. A change that leaves one
    scalar (a sum that may not be reassociated, an index check, a conversion that does not
    vectorize) fails here."""
    m = mc.rows_module()
    for name, (function, *argtypes) in mc.row_loops(m, dtype).items():
        code = mc.machine_code(function, tuple(argtypes))
        assert mc.packed_float(code), f"{name} on {dtype} rows runs scalar"


@pytest.mark.parametrize("name", ["_biased", "_nan_free"])
def test_the_parameter_scans_compile_to_vector_code(name: str) -> None:
    """Each launch scans the weight and the bias (is there a bias, is there a NaN); a scan
    that stops at its first find runs one element at a time, 3 us on a row of 4096, most of a
    one-token call's kernel time."""
    function, *argtypes = mc.scans(mc.rows_module())[name]
    assert mc.packed_compare(mc.machine_code(function, tuple(argtypes))), f"{name} runs scalar"


def test_the_guards_reject_scalar_loops() -> None:
    """The controls, a scan that stops at its first find and a float32 sum in its written
    order, run one element at a time: each guard's reading of them is false."""
    for name, (function, argtypes, guard) in mc.scalar_controls(mc.rows_module()).items():
        assert not guard(mc.machine_code(function, argtypes, _nrt=False)), name


def _readings(tmp_path: Path, **env: str) -> dict[str, Any]:
    """`cpu_machine_code.readings` in a new process with ``env`` (numba's own cache in
    ``tmp_path``); skips where this numba's LLVM does not know the CPU named."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    environ.update(NUMBA_CACHE_DIR=str(tmp_path), **env)
    done = subprocess.run([sys.executable, mc.__file__], env=environ, capture_output=True,
                          text=True, timeout=900)
    if "is not a recognized processor" in done.stderr:
        pytest.skip(f"this numba's LLVM does not know {env.get('NUMBA_CPU_NAME')}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("cpu", list(TARGETS))
def test_the_guards_hold_on_every_vector_width(cpu: str, tmp_path: Path) -> None:
    """Compiled for ``cpu`` (its own features, not this machine's), every row loop reads as
    packed float arithmetic and every scan as packed compares, the scalar controls as neither;
    the code uses the vector registers of that CPU's widest vectors, which shows the target
    took effect: xmm only for SSE2, ymm and no AVX-512 register for AVX2, AVX-512's mask
    registers for AVX-512."""
    found = _readings(tmp_path, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES="")
    assert found["cpu"] == cpu and found["features"] == ""
    width, seen = TARGETS[cpu], set(found["registers"])
    assert {"sse2": seen == {"xmm"}, "avx2": "ymm" in seen and not seen & {"zmm", "k"},
            "avx512": "k" in seen}[width], (width, seen)
    assert [name for name, packed in found["loops"].items() if not packed] == []
    assert [name for name, packed in found["scans"].items() if not packed] == []
    assert [name for name, packed in found["controls"].items() if packed] == []


@pytest.mark.slow
def test_the_guards_reject_a_scalar_build(tmp_path: Path) -> None:
    """The kernels' own loops compiled with LLVM's loop vectorizer off (numba's
    ``NUMBA_LOOP_VECTORIZE=0``), for an AVX2 CPU: no loop reads as packed float arithmetic,
    no scan as packed compares. The guards fail on scalar code."""
    found = _readings(tmp_path, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="",
                      NUMBA_LOOP_VECTORIZE="0")
    assert len(found["loops"]) == 2 * len(mc.row_loops(mc.rows_module(), "float32"))
    assert [name for name, packed in found["loops"].items() if packed] == []
    assert [name for name, packed in found["scans"].items() if packed] == []
