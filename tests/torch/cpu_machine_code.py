"""The structural speed guards of normkit's CPU kernel, read from numba's machine code: every
row loop compiles to packed (SIMD) float arithmetic, the parameter scans to packed compares.

The readings hold on any x86-64 CPU numba targets, whatever the vector width LLVM picks there:
SSE's 128-bit registers, AVX2's 256-bit ones, AVX-512's 512-bit ones and its mask registers
(an Intel AVX-512 CPU, which LLVM tunes for 256-bit vectors, compares four int32 lanes at a
time into a mask register: ``vpcmpneqd (%rax,%r10,4), %xmm1, %k0``). Scalar code (``addss``,
``ucomiss``, ``cmpl``) has none of those instructions. Each guarded function is compiled
afresh, without numba's cache (whose loaded functions keep no machine code).

Run as a script (``python tests/torch/cpu_machine_code.py``), it compiles every guarded
function, and the deliberately scalar controls of `scalar_controls`, for the CPU numba targets
(``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``, read when numba starts; nothing compiled is run,
so the host need not have that CPU) and prints the readings as JSON. The kernels' module is
loaded from its file, without importing torch; run it with ``NUMBA_CACHE_DIR`` set to a folder
of its own.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROWS_MODULE = Path(__file__).parents[2] / "normkit" / "torch" / "kernels" / "_cpu_numba.py"

# Packed float arithmetic, on registers of any width: addps, vaddpd, vmulps, vfmadd231ps,
# vfnmadd213pd, ... (the scalar forms end in ss / sd).
PACKED_FLOAT = re.compile(r"\bv?(add|sub|mul|f?n?m(add|sub)\d+)p[sd]\b")
# Packed compares of any width, into a vector or a mask register: pcmpeqd, vpcmpneqd,
# vpcmpgtq, cmpunordps, vcmpneqps, vptestnmd ... except the all-ones idiom ``pcmpeqd x, x``,
# which makes a constant (the scalar forms: cmp, ucomiss, vcmpss, ...).
PACKED_COMPARE = re.compile(r"\b(v?pcmp\w+|v?cmp\w*p[sd]|vptestn?m[bwdq])\b[ \t]+(?P<operands>.*)")
_REGISTER = re.compile(r"%[xyz]mm\d+|%k[0-7]")


def packed_float(machine_code: str) -> bool:
    """Whether ``machine_code`` does float arithmetic on packed (SIMD) operands."""
    return PACKED_FLOAT.search(machine_code) is not None


def packed_compare(machine_code: str) -> bool:
    """Whether ``machine_code`` compares packed (SIMD) operands."""
    for match in PACKED_COMPARE.finditer(machine_code):
        operands = [op.strip() for op in match["operands"].split("#")[0].split(",")]
        if len(set(operands)) > 1:  # pcmpeqd %xmm0, %xmm0 (all ones) compares nothing
            return True
    return False


def registers(machine_code: str) -> set[str]:
    """The vector register classes ``machine_code`` uses: ``xmm``, ``ymm``, ``zmm``, ``k``."""
    return {name.strip("%0123456789") for name in _REGISTER.findall(machine_code)}


def rows_module() -> ModuleType:
    """``normkit.torch.kernels._cpu_numba``, the row kernels."""
    return importlib.import_module("normkit.torch.kernels._cpu_numba")


def _rows_module_from_file() -> ModuleType:
    """`rows_module` loaded from its file, without importing torch (for the script: numba's
    cache, keyed by the file, then belongs to this process alone, ``NUMBA_CACHE_DIR``)."""
    spec = importlib.util.spec_from_file_location("_cpu_numba_machine_code", ROWS_MODULE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row_loops(m: ModuleType, dtype: str) -> dict[str, tuple[Any, ...]]:
    """Each row loop of the kernels, by name: the function and its argument types (the
    flags that select a loop as literals, as the kernels call them)."""
    from numba import typeof, types

    row = typeof(np.empty(1, m.ROW_DTYPES[dtype]))
    vec = typeof(np.empty(1, np.float32))
    f32, yes, no = types.float32, types.literal(True), types.literal(False)
    scale = (row, row, vec, vec, f32, f32, f32)
    gradient = (row, row, row, vec, vec, vec, f32, f32, f32, f32, f32)
    return {
        "sum of squares": (m._row_sum, row, yes),
        "sum": (m._row_sum, row, no),
        "centered sums": (m._centered_sums, row, types.float64),
        "dot product": (m._dot, row, row, vec, types.int64, types.int64),
        "layer backward sums": (m._layer_backward_sums, row, row, vec, no),
        **{
            f"scale (centered {c}, biased {b})": (m._scale_span, *scale, c, b)
            for c in (yes, no) for b in (yes, no)
        },
        "gradient": (m._gradient_span, *gradient, no),
        "rms gradient": (m._gradient_span, *gradient, yes),
        "gate product": (m._times, row, vec, vec),
        "gated scale": (m._gated_scale_span, row, row, vec, vec, vec, f32, f32, f32),
        "gate-after gradient": (m._gate_after_gradient_span, row, row, row, vec, vec, vec, f32,
                                f32, f32),
        "gate-before gradient": (m._gate_before_gradient, row, vec, vec, vec, row, row),
    }


def scans(m: ModuleType) -> dict[str, tuple[Any, ...]]:
    """The parameter scans (is there a bias, is there a NaN) and their argument types."""
    from numba import typeof

    vec = typeof(np.empty(1, np.float32))
    return {"_biased": (m._biased, vec), "_nan_free": (m._nan_free, vec)}


def scalar_controls(m: ModuleType) -> dict[str, tuple[Callable[..., Any], Any, Callable[[str], bool]]]:
    """Loops that run one element at a time on every CPU, with the guard each must fail: a scan
    that stops at its first find (the search the count of `scans` replaced), and a float32 sum
    in its written order (not reassociable, so not vectorizable)."""
    from numba import typeof

    vec = typeof(np.empty(1, np.float32))

    def first_nan(values: np.ndarray) -> bool:
        for j in range(values.size):
            if np.isnan(values[j]):
                return True
        return False

    def first_other_bits(values: np.ndarray) -> bool:
        for j in range(values.size):
            if m._bits_of_float(values[j]) != np.uint32(0x80000000):
                return True
        return False

    def ordered_sum(values: np.ndarray) -> float:
        acc = np.float32(0.0)
        for j in range(values.size):
            acc += values[j] * values[j]
        return acc

    return {
        "first NaN": (first_nan, (vec,), packed_compare),
        "first other bits": (first_other_bits, (vec,), packed_compare),
        "ordered sum of squares": (ordered_sum, (vec,), packed_float),
    }


def machine_code(function: Callable[..., Any], argtypes: tuple[Any, ...], **options: Any) -> str:
    """The machine code of ``function`` (a Python function, or a kernel's jitted function,
    with its own options: no reference counting) compiled afresh for ``argtypes`` (numba's
    cache keeps none), with its callees."""
    from numba import njit

    own = getattr(function, "targetoptions", {})
    options = {**{k: v for k, v in own.items() if k != "nopython"}, **options}
    fresh = njit(**options)(getattr(function, "py_func", function))
    fresh.compile(argtypes)
    return "".join(fresh.inspect_asm().values())


def readings(m: ModuleType) -> dict[str, Any]:
    """Every guard's reading of the row kernels ``m`` on this process's numba target: ``loops``
    (row loop and dtype ->
    packed float arithmetic), ``scans`` (-> packed compares), ``controls`` (the scalar
    controls -> their guard's reading), ``registers`` (the vector register classes seen), and
    the target numba compiled for (``cpu``, ``features``)."""
    from numba.core.registry import cpu_target

    codegen = cpu_target.target_context.codegen()
    seen: set[str] = set()
    found: dict[str, Any] = {"loops": {}, "scans": {}, "controls": {}}
    for dtype in ("float32", "bfloat16"):
        for name, (function, *argtypes) in row_loops(m, dtype).items():
            code = machine_code(function, tuple(argtypes))
            seen |= registers(code)
            found["loops"][f"{name} ({dtype})"] = packed_float(code)
    for name, (function, *argtypes) in scans(m).items():
        code = machine_code(function, tuple(argtypes))
        seen |= registers(code)
        found["scans"][name] = packed_compare(code)
    for name, (function, argtypes, guard) in scalar_controls(m).items():
        found["controls"][name] = guard(machine_code(function, argtypes, _nrt=False))
    found["registers"] = sorted(seen)
    found["cpu"] = codegen._get_host_cpu_name()
    found["features"] = codegen._get_host_cpu_features()
    return found


if __name__ == "__main__":
    json.dump(readings(_rows_module_from_file()), sys.stdout)
