"""normkit's CPU kernel: the numba row kernels as torch custom ops, with autograd and vmap rules.

``norm_rows`` is the kernel interface of `normkit.torch.kernels`. The ops are
``normkit::cpu_norm`` (forward) and ``normkit::cpu_norm_backward``; both have fake
implementations, so ``torch.compile(fullgraph=True)`` keeps them in its graph, and vmap rules;
`CpuNormFunction` joins them for autograd and torch.func. The forward saves
``x`` and each row's ``r(s)`` in float32 (and the parameters). Outputs of 32 MiB and more
are made in storages kept for reuse (`normkit.torch._memory`).

The numba module is imported (and compiled, or loaded from its on-disk cache) on the first call.
If that fails, the ops compute with the composite path (`normkit.torch._autograd.NormFunction`)
and warn once; with ``strict`` they raise instead. Launches hold a lock and run on
``torch.get_num_threads()`` threads: torch's own OpenMP threads where numba can share them
(`_threading_layer`), else numba's workqueue threads; inputs of fewer than `_serial` elements,
and every input in a forked child of a process that shares them, run on the calling thread,
with the same results bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from normkit.torch import _memory
from normkit.torch._autograd import (
    NormFunction,
    _shape_only,
    apply,
    apply_eager,
    needs_graph,
    signature_once,
)
from normkit.torch._memory import empty_cache
from normkit.torch._spec import RowSpec, decode, encode
from normkit.torch._stacklevel import user_stacklevel

__all__ = [
    "CpuGatedNormFunction", "CpuNormFunction", "KernelNotCompiledWarning", "empty_cache", "load",
    "norm_rows", "unavailable_reason",
]

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
BLOCK_ROWS = 64
"""Rows per parallel task and per partial sum of the weight and bias gradients: fixed, so that
the results are the same bit for bit whatever the thread count."""
INSTALL = "pip install 'normkit[torch]' (its torch extra includes numba)"
SERIAL = 2**20
"""Inputs of fewer elements run on the calling thread (`_serial`), on numba's workqueue layer:
starting its parallel region takes 60-130 us. On the 2-core CI machine one thread did better
up to about 2M elements (an RMSNorm forward of 1M: 257 us against 374 us; a row of 4096: 2.3 us
in the kernel against 65 us); with more cores the parallel region pays off sooner. On torch's
OpenMP threads a region starts in about 3 us, and a quarter of this is the threshold (rows of
4096: 256 rows 94 us on two threads against 150 us on one, 64 rows 62 us against 60 us)."""
CLAIM_BYTES = 2**22

_lock = threading.Lock()
_state: dict[str, Any] = {
    "module": None, "reason": None, "warned": False, "compiled": {}, "forked": False,
    "openmp": False, "ready": {}, "warned_cold": False,
}


class KernelNotCompiledWarning(RuntimeWarning):
    """Warned once per process that finds normkit's CPU kernel not compiled on the machine yet:
    ``kernel="auto"`` runs the composite path in it while the kernel compiles in the background
    (``normkit warmup`` compiles it beforehand). Filter it by this category."""


def _after_fork_in_child() -> None:
    _state["forked"] = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def load(dtype: torch.dtype = torch.float32, gated: bool = False) -> ModuleType | None:
    """The numba kernels, compiled for rows of ``dtype`` (or loaded from the disk cache), or
    None, with `unavailable_reason` set, if numba cannot be imported or fails to compile.
    ``gated``: the kernels of gated and grouped specs (``gated_forward``, ``gated_backward``),
    compiled on their first use only."""
    return None if _entry_points(dtype, gated) is None else _state["module"]


def _entry_points(dtype: torch.dtype, gated: bool) -> tuple[Callable[..., None], ...] | None:
    """`load`'s forward and backward kernels for ``dtype``, as their compiled entry points:
    called with arguments of the types compiled for (the views of `_view`, ints, floats, bools)
    they skip numba's dispatch, which types every argument on every call (0.5 us of a
    one-token call)."""
    key = (dtype, gated)
    found: tuple[Callable[..., None], ...] | None = _state["compiled"].get(key)
    if found is not None or _state["reason"] is not None:
        return found
    with _lock:
        if key not in _state["compiled"] and _state["reason"] is None:
            try:
                if not _state["compiled"]:  # the first kernels: numba's layer starts
                    _configure_numba()
                from normkit.torch.kernels import _cpu_numba

                kernels = ("gated_forward", "gated_backward") if gated else ("forward", "backward")
                signatures = _cpu_numba.gated_signatures if gated else _cpu_numba.signatures
                _state["compiled"][key] = tuple(
                    getattr(_cpu_numba, name).compile(signature)
                    for name, signature in zip(kernels, signatures(_NAMES[dtype]), strict=True)
                )
                _state["module"] = _cpu_numba
                _mark_compiled(dtype, gated)
            except Exception as exc:  # noqa: BLE001 (an ImportError, or any failure of numba)
                _state["reason"] = f"{type(exc).__name__}: {exc}"
    found = _state["compiled"].get(key)
    return found


def unavailable_reason() -> str | None:
    """Why the kernels could not load (after `load` failed), else None."""
    reason: str | None = _state["reason"]
    return reason


def _configure_numba() -> None:
    """Choose numba's threading layer (`_threading_layer`) unless the user chose one, and
    start it."""
    import numba

    if "NUMBA_THREADING_LAYER" not in os.environ:
        try:
            numba.threading_layer()
        except ValueError:  # no parallel region has run yet: the layer can still be chosen
            numba.config.THREADING_LAYER = _threading_layer()  # type: ignore[attr-defined]
    # numba's OpenMP layer (chosen here or by numba) sets the calling thread's OpenMP thread
    # count to its own, and the nesting depth, on its start: torch's settings, given back.
    openmp = ctypes.CDLL(None)
    nesting = hasattr(openmp, "omp_get_max_active_levels")
    threads = torch.get_num_threads()
    levels = openmp.omp_get_max_active_levels() if nesting else 0
    numba.get_num_threads()  # starts the layer
    _state["openmp"] = numba.threading_layer() == "omp"  # whoever chose it
    if _state["openmp"]:
        torch.set_num_threads(threads)
        if nesting:
            openmp.omp_set_max_active_levels(levels)


def _threading_layer() -> str:
    """``"omp"`` where numba's OpenMP layer runs on torch's own threads, else the workqueue.

    After a parallel op torch's OpenMP threads busy-wait for the next one (``GOMP_SPINCOUNT``);
    the kernel's regions on those same threads start at once, where threads of numba's own
    would share the cores with the spinning ones (on 2 cores a float32 forward into existing
    memory ran 1.5-2x slower right after a torch op). numba's OpenMP pool binds to the
    process's global OpenMP symbols, those of torch's runtime when torch loaded it globally,
    as its wheels do; otherwise it would start a runtime of its own, and the workqueue layer
    (threads of numba's own that survive ``fork``) is kept."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return "workqueue"
    if not hasattr(ctypes.CDLL(None), "GOMP_parallel"):
        return "workqueue"
    try:
        import numba.np.ufunc.omppool  # noqa: F401 (whether numba's OpenMP layer loads here)
    except ImportError:
        return "workqueue"
    return "omp"


COMPILE = "NORMKIT_CPU_COMPILE"
"""The environment variable that says what ``kernel="auto"`` does where the CPU kernel is not
compiled on this machine yet: ``"background"`` (the default: `ready`) or ``"wait"`` (compile
it in the call that first needs it)."""


def ready(dtype: torch.dtype, gated: bool = False) -> bool:
    """Whether ``kernel="auto"`` runs the CPU kernel for rows of ``dtype`` (``gated``: of gated
    and grouped specs) in this process: decided once per process, so that a layer's results do
    not change when a compilation finishes.

    Yes where this process has the kernels already (compiled, or loaded by `load`), where the
    disk cache holds them (normkit marks it when numba compiled them: loading takes a fraction
    of a second), or with ``NORMKIT_CPU_COMPILE=wait``. Otherwise no: this process takes the
    composite path for those rows, and a process of its own (``python -m
    normkit.torch.warmup``, at low priority) compiles the kernels into the cache for the
    processes that start later; one warning says so. ``kernel="cpu"`` compiles in the call.
    """
    key = (dtype, gated)
    decided: bool | None = _state["ready"].get(key)
    if decided is not None:
        return decided
    decided = (
        key in _state["compiled"] or os.environ.get(COMPILE, "background") == "wait"
        or os.path.exists(_mark(dtype, gated))
    )
    if decided:
        load(dtype, gated)  # from the cache; a failure warns on the first launch
    else:
        _compile_in_background(dtype, gated)
        if not _state["warned_cold"]:
            _state["warned_cold"] = True
            warnings.warn(
                "normkit.torch: the CPU kernel is not compiled on this machine yet, so this "
                "process runs the slower composite path while it compiles in the background; "
                "run `normkit warmup` once to avoid this",
                KernelNotCompiledWarning, stacklevel=user_stacklevel(),
            )
    _state["ready"][key] = decided
    return decided


def _cache_folder() -> str:
    """Where numba caches the kernels' machine code: ``NUMBA_CACHE_DIR``, else the package's
    ``__pycache__`` where it is writable, else the user cache folder numba chooses."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    here = os.path.dirname(os.path.abspath(__file__))
    if os.access(here, os.W_OK):
        return os.path.join(here, "__pycache__")
    if sys.platform == "darwin":
        return os.path.expanduser("~/Library/Caches/numba")
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                        "numba")


@functools.cache
def _build_key() -> str:
    """What numba's cache of the kernels depends on: their source, numba's and llvmlite's
    versions, Python's, the CPU (its model and features)."""
    import hashlib
    import importlib.metadata
    import platform

    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cpu_numba.py")
    with open(source, "rb") as kernels:
        parts = [kernels.read(), sys.version.encode(), platform.machine().encode()]
    for package in ("numba", "llvmlite"):
        try:
            parts.append(importlib.metadata.version(package).encode())
        except importlib.metadata.PackageNotFoundError:
            parts.append(b"")
    try:
        with open("/proc/cpuinfo", "rb") as info:
            parts += [line for line in info.read().splitlines()
                      if line.startswith((b"model name", b"flags"))][:2]
    except OSError:
        parts.append(platform.processor().encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _mark(dtype: torch.dtype, gated: bool) -> str:
    """The file that says numba has compiled the kernels of ``dtype`` (``gated``) into its
    cache for this build (`_build_key`)."""
    family = _NAMES[dtype] + ("-gated" if gated else "")
    return os.path.join(_cache_folder(), f"normkit-cpu-{family}-{_build_key()}.compiled")


def _mark_compiled(dtype: torch.dtype, gated: bool) -> None:
    """Write `_mark` (where the folder is writable)."""
    path = _mark(dtype, gated)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as mark:
            mark.write("compiled\n")
    except OSError:
        pass


def _compile_in_background(dtype: torch.dtype, gated: bool) -> None:
    """Start ``python -m normkit.torch.warmup`` for ``dtype`` (``gated``) in a process of its
    own, unless one runs already (its lock file, less than half an hour old)."""
    import subprocess
    import time

    lock = _mark(dtype, gated).removesuffix(".compiled") + ".compiling"
    try:
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) < 1800:
            return
        with open(lock, "w") as held:
            held.write(f"{os.getpid()}\n")
    except OSError:
        return
    command = [sys.executable, "-m", "normkit.torch.warmup", "--background", "--lock", lock,
               "--dtype", _NAMES[dtype], "--family", "gated" if gated else "plain"]
    # this normkit, wherever it was imported from
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True, env=env)


def _kernels(
    dtype: torch.dtype, strict: bool, gated: bool = False
) -> tuple[Callable[..., None], ...] | None:
    """`_entry_points`, or None after one warning (an error with ``strict``) where the kernels
    cannot load."""
    found = _entry_points(dtype, gated)
    if found is None:
        message = (
            f"normkit's CPU kernel is unavailable ({unavailable_reason()}); "
            f"using the composite path. Install it with {INSTALL}."
        )
        if strict:
            raise RuntimeError(message)
        if not _state["warned"]:
            _state["warned"] = True
            warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())
    return found


def _threads() -> int:
    import numba

    limit: int = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    return max(1, min(torch.get_num_threads(), limit))


def _serial() -> int:
    """Inputs of fewer elements than this run on the calling thread (`SERIAL`)."""
    return SERIAL // 4 if _state["openmp"] else SERIAL


def _workers(x: torch.Tensor) -> int:
    """The kernels' tasks for rows ``x``: 1 below `_serial` elements (the kernels then open no
    parallel region) and in a forked child on numba's OpenMP layer (GNU OpenMP's threads do
    not survive ``fork``; numba ends a child that starts them), else `_threads`, set as
    numba's thread count. Under the launch lock."""
    if x.numel() < _serial() or (_state["forked"] and _state["openmp"]):
        return 1
    import numba

    threads = _threads()
    numba.set_num_threads(threads)
    return threads


_NUMPY_DTYPES = {
    torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.uint16,
}


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous plain tensor whose memory holds its values.

    A tensor subclass (e.g. the AsyncCollectiveTensor a DTensor's gradient arrives as) may not
    have its data in place until a torch op runs on it: it is copied through one.
    """
    if type(t) not in _PLAIN:
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


def _rows(t: torch.Tensor) -> np.ndarray:
    """A numpy view of contiguous ``t``: float32, or the bits of bfloat16 as int16, of float16
    as uint16.

    Made from the raw pointer through numpy's array interface (`_Memory`), not by
    ``Tensor.numpy``, which marks the storage non-resizable for good (FSDP2 frees gathered
    parameters by resizing their storage to 0). The view is valid while ``t`` lives: only for
    the duration of a kernel call.
    """
    assert t.is_contiguous()
    return _view(t.data_ptr(), t.shape, t.dtype)


@functools.lru_cache(maxsize=256)
def _view(address: int, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
    """The view `_rows` makes of the memory at ``address``: an address, a shape and a dtype,
    nothing it owns, so one view serves every tensor there of that shape and dtype (the
    weight on every call, and a freed output's memory handed out again). Making one costs
    about 1 us, several times the lookup; a call makes 5 (forward) to 9 (backward)."""
    if math.prod(shape) == 0:
        return np.empty(shape, _NUMPY_DTYPES[dtype])
    return np.asarray(_Memory(address, tuple(shape), _TYPESTRS[dtype]))


_TYPESTRS = {dtype: np.dtype(numpy).str for dtype, numpy in _NUMPY_DTYPES.items()}


class _Memory:
    """Writable C-contiguous memory at ``address`` as numpy's array interface describes it
    (``np.asarray`` of it is a view; half the host time of a ctypes buffer)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__array_interface__ = {
            "data": (address, False), "shape": shape, "typestr": typestr, "version": 3,
        }


def _eager(x: torch.Tensor) -> bool:
    """Whether to call the kernels directly on ``x`` rather than through their custom ops.

    In plain eager mode the ops add nothing, and a custom op's first call imports torch._dynamo,
    hence triton, which aborts a process that has loaded TensorFlow or JAX (their LLVM options
    clash with triton's). Traced code, and meta and fake tensors (which have no data for numba to
    read), go through the ops, whose fake implementations give the outputs' shapes.
    """
    return not _shape_only(x)


def _claimed_rows(x: torch.Tensor, workers: int) -> int:
    """Rows a task claims at a time: an output of `CLAIM_BYTES`, at least `BLOCK_ROWS` rows, and
    at most an eighth of each worker's share.

    Fresh output memory is mapped on its first write, a huge page at a time: two threads writing
    the same 2 MiB page wait for each other's page fault. Claims of two pages keep them apart
    (8192 x 4096 float32 into fresh huge pages, 2 threads: 9.66 ms in claims of 64 rows, 1 MiB,
    against 9.03 ms in claims of 256; 32768 x 1024: 9.86 against 9.35 ms). A row's output does
    not depend on the claim."""
    fill = -(-CLAIM_BYTES // (x.shape[1] * x.element_size()))
    return max(BLOCK_ROWS, min(fill, x.shape[0] // (8 * workers)))


def _claimed_blocks(x: torch.Tensor, workers: int) -> int:
    """Blocks of `BLOCK_ROWS` rows a backward task claims at a time: `_claimed_rows` in whole
    blocks, by which the backward sums the parameters' gradients (so that those sums do not
    depend on the claim)."""
    return _claimed_rows(x, workers) // BLOCK_ROWS


KINDS = {"rms": 0, "partial_rms": 1, "layer": 2}
GATES = {"": 0, "before": 1, "after": 2}


def _norm(
    x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, rows: RowSpec, strict: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, r)`` for rows ``x`` (rows, n) with effective scale ``g`` and bias ``b`` (float32,
    n); ``r`` is each row's ``r(s)`` in float32."""
    kernels = _state["compiled"].get((x.dtype, False)) or _kernels(x.dtype, strict)
    if kernels is None:
        y, r = apply(NormFunction, x, g, b, rows, x.dtype, x.dtype)
        return y, r
    if not (type(x) in _PLAIN and type(g) in _PLAIN and type(b) in _PLAIN
            and x.is_contiguous() and g.is_contiguous() and b.is_contiguous()):
        x, g, b = _plain(x), _plain(g), _plain(b)  # alive through the call
    count = x.shape[0]
    y = _memory.empty_like(x)
    r = torch.empty(count, dtype=torch.float32, device="cpu")
    with _lock:
        small = x.numel() < (SERIAL // 4 if _state["openmp"] else SERIAL)
        workers = 1 if small else _workers(x)
        claim = max(BLOCK_ROWS, min(-(-CLAIM_BYTES // (x.shape[1] * x.element_size())),
                                    count // (8 * workers)))
        kernels[0](
            _view(x.data_ptr(), x.shape, x.dtype), _view(g.data_ptr(), g.shape, g.dtype),
            _view(b.data_ptr(), b.shape, b.dtype), _view(y.data_ptr(), y.shape, y.dtype),
            _view(r.data_ptr(), r.shape, r.dtype), KINDS[rows.kind], rows.k, rows.eps,
            rows.outside, rows.before_scale, claim, workers,
        )
    return y, r


forward = _norm
"""The forward kernel called directly on plain contiguous CPU tensors: ``(y, r)``."""


def _norm_op(
    x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, spec: str, strict: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, g, b, decode(spec), strict)


cpu_norm = torch.library.custom_op(
    "normkit::cpu_norm", _norm_op, mutates_args=(), device_types="cpu"
)


@cpu_norm.register_fake
def _cpu_norm_fake(
    x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, *options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


def _param_grad_buffers(
    rows: int, n: int, need_g: bool, need_b: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A backward kernel's float32 buffers for the parameters' gradients: the per-block partial
    sums of dg and db ((blocks, n), or (blocks, 0) where not needed) and their totals (n,),
    which the kernel writes whole where needed and which are zeros where not."""
    blocks = math.ceil(rows / BLOCK_ROWS)
    f32 = torch.float32  # on the CPU, whatever the default device
    dg_blocks = torch.empty(blocks, n if need_g else 0, dtype=f32, device="cpu")
    db_blocks = torch.empty(blocks, n if need_b else 0, dtype=f32, device="cpu")
    dg = (torch.empty if need_g else torch.zeros)(n, dtype=f32, device="cpu")
    db = (torch.empty if need_b else torch.zeros)(n, dtype=f32, device="cpu")
    return dg_blocks, db_blocks, dg, db


def _norm_backward(
    dy: torch.Tensor, x: torch.Tensor, r: torch.Tensor, g: torch.Tensor, rows: RowSpec,
    need_g: bool, need_b: bool, strict: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dg, db)`` of `cpu_norm` for the cotangent ``dy``: dx in x's dtype, dg and db float32
    (the sums over rows of ``dy * y_hat`` and ``dy``; zeros unless ``need_g`` / ``need_b``)."""
    kernels = _state["compiled"].get((x.dtype, False)) or _kernels(x.dtype, strict)
    if kernels is None:
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(), g.detach().requires_grad_()]
            bias = torch.zeros_like(g, requires_grad=True)
            y, _ = NormFunction.apply(*leaves, bias, rows, x.dtype, x.dtype)
            dx, dg, db = torch.autograd.grad(y, [*leaves, bias], dy)
        return dx, dg, db
    if not (type(x) in _PLAIN and type(dy) in _PLAIN and type(g) in _PLAIN
            and x.is_contiguous() and dy.is_contiguous() and g.is_contiguous()):
        x, dy, r, g = _plain(x), _plain(dy), _plain(r), _plain(g)  # alive through the call
    count, n = x.shape
    dx = _memory.empty_like(x)
    dg_blocks, db_blocks, dg, db = _param_grad_buffers(count, n, need_g, need_b)
    with _lock:
        small = x.numel() < (SERIAL // 4 if _state["openmp"] else SERIAL)
        workers = 1 if small else _workers(x)
        kernels[1](
            _view(x.data_ptr(), x.shape, x.dtype), _view(r.data_ptr(), r.shape, r.dtype),
            _view(dy.data_ptr(), dy.shape, dy.dtype), _view(g.data_ptr(), g.shape, g.dtype),
            _view(dx.data_ptr(), dx.shape, dx.dtype),
            _view(dg_blocks.data_ptr(), dg_blocks.shape, dg_blocks.dtype),
            _view(db_blocks.data_ptr(), db_blocks.shape, db_blocks.dtype),
            _view(dg.data_ptr(), dg.shape, dg.dtype), _view(db.data_ptr(), db.shape, db.dtype),
            KINDS[rows.kind], rows.k, rows.eps, rows.outside, need_g, need_b, BLOCK_ROWS,
            _claimed_blocks(x, workers), workers,
        )
    return dx, dg, db


def _norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, r: torch.Tensor, g: torch.Tensor, spec: str,
    need_g: bool, need_b: bool, strict: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm_backward(dy, x, r, g, decode(spec), need_g, need_b, strict)


cpu_norm_backward = torch.library.custom_op(
    "normkit::cpu_norm_backward", _norm_backward_op, mutates_args=(), device_types="cpu"
)


@cpu_norm_backward.register_fake
def _cpu_norm_backward_fake(
    dy: torch.Tensor, x: torch.Tensor, r: torch.Tensor, g: torch.Tensor, *options: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(g), torch.empty_like(g)


@signature_once
class CpuNormFunction(torch.autograd.Function):
    """`cpu_norm` with its backward, as an autograd.Function so that torch.func transforms apply
    (torch.library's own autograd registration does not support them).

    ``apply(x, g, b, rows, strict, direct)``, ``rows`` the `RowSpec`, ``direct`` whether the
    kernels are called directly (`_eager`) rather than through their custom ops; under
    ``create_graph`` (double backward) the gradient is the composite path's, which is
    differentiable.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, rows: RowSpec, strict: bool,
        direct: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if direct:
            return _norm(x, g, b, rows, strict)
        y, r = cpu_norm(x, g, b, encode(rows), strict)
        return y, r

    @staticmethod
    def setup_context(
        ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        x, g, b, rows, strict, direct = inputs
        ctx.save_for_backward(x, output[1], g, b)
        ctx.mark_non_differentiable(output[1])
        ctx.rows, ctx.strict, ctx.direct = rows, strict, direct

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor, _dr: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        x, r, g, b = ctx.saved_tensors
        need_x, need_g, need_b = ctx.needs_input_grad[:3]
        rows: RowSpec = ctx.rows
        if torch.is_grad_enabled():
            dx, dg, db = _composite_vjp(x, g, b, dy, rows)
        elif ctx.direct:
            dx, dg, db = _norm_backward(dy, x, r, g, rows, need_g, need_b, ctx.strict)
        else:
            dx, dg, db = cpu_norm_backward(dy, x, r, g, encode(rows), need_g, need_b, ctx.strict)
        return (
            dx if need_x else None, dg if need_g else None, db if need_b else None, None, None,
            None,
        )


def _composite_vjp(
    x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, dy: torch.Tensor, rows: RowSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The vector-Jacobian product through `NormFunction`, as a differentiable graph."""

    def composite(xc: torch.Tensor, gc: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = NormFunction.apply(xc, gc, bc, rows, x.dtype, x.dtype)[0]
        return y

    vjp = torch.func.vjp(composite, x, g, b)[1]
    dx, dg, db = vjp(dy)
    return dx, dg, db


def _batched(info: Any, in_dims: tuple[Any, ...], fn: Any, args: tuple[Any, ...]) -> Any:
    """Apply ``fn`` to each slice of the batch and stack the results (vmap's fallback)."""
    size = info.batch_size
    outputs = []
    for i in range(size):
        sliced = [
            a.select(d, i) if d is not None else a for a, d in zip(args, in_dims, strict=True)
        ]
        outputs.append(fn(*sliced))
    stacked = tuple(torch.stack(parts) for parts in zip(*outputs, strict=True))
    return stacked, tuple(0 for _ in stacked)


@torch.library.register_vmap("normkit::cpu_norm")
def _cpu_norm_vmap(
    info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
    spec: str, strict: bool,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]]:
    x_dim, g_dim, b_dim = in_dims[:3]
    if x_dim is not None and g_dim is None and b_dim is None:
        moved = x.movedim(x_dim, 0)
        y, r = cpu_norm(moved.reshape(-1, moved.shape[-1]), g, b, spec, strict)
        return (y.reshape(moved.shape), r.reshape(moved.shape[:-1])), (0, 0)

    def one(xi: torch.Tensor, gi: torch.Tensor, bi: torch.Tensor) -> Any:
        return cpu_norm(xi, gi, bi, spec, strict)

    result: tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]] = _batched(
        info, in_dims[:3], one, (x, g, b)
    )
    return result


@torch.library.register_vmap("normkit::cpu_norm_backward")
def _cpu_norm_backward_vmap(
    info: Any, in_dims: tuple[Any, ...], dy: torch.Tensor, x: torch.Tensor, r: torch.Tensor,
    g: torch.Tensor, spec: str, need_g: bool, need_b: bool, strict: bool,
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    def one(dyi: torch.Tensor, xi: torch.Tensor, ri: torch.Tensor, gi: torch.Tensor) -> Any:
        return cpu_norm_backward(dyi, xi, ri, gi, spec, need_g, need_b, strict)

    result: tuple[tuple[torch.Tensor, ...], tuple[int, ...]] = _batched(
        info, in_dims[:4], one, (dy, x, r, g)
    )
    return result


# ---- gated and grouped specs -----------------------------------------------------------------


def _composite_gated(
    x: torch.Tensor, z: torch.Tensor | None, g: torch.Tensor, b: torch.Tensor, rows: RowSpec,
    round_affine: bool,
) -> torch.Tensor:
    """``y`` of `cpu_gated_norm` by the composite path (`normkit.torch._gated.norm_rows`): the
    fallback without numba, and a differentiable graph for double backward."""
    from normkit.torch import _gated

    affine = x.dtype if round_affine else torch.float32
    return _gated.norm_rows(x, z, rows, g, b, x.dtype, affine, x.dtype, eager=False)


def _gated_norm(
    x: torch.Tensor, z: torch.Tensor | None, g: torch.Tensor, b: torch.Tensor, rows: RowSpec,
    round_affine: bool, strict: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, r)`` of a gated or grouped spec on rows ``x`` (rows, n): the statistic of each
    group of ``rows.group`` elements (``r`` is (rows, groups), float32), the gate rows ``z``
    (x's shape and dtype; None without a gate) applied at ``rows.gate`` with its activation;
    ``round_affine`` rounds ``u = y_hat g + b`` to x's dtype before a gate after the norm."""
    count, n = x.shape
    r = torch.zeros(count, n // rows.group, dtype=torch.float32, device="cpu")
    kernels = _kernels(x.dtype, strict, gated=True)
    if kernels is None:
        return _composite_gated(x, z, g, b, rows, round_affine), r  # its backward reads no r
    x, g, b = _plain(x), _plain(g), _plain(b)  # alive through the call
    gate = x.new_empty(count, 0) if z is None else _plain(z)
    y = _memory.empty_like(x)
    with _lock:
        kernels[0](
            _rows(x), _rows(gate), _rows(g), _rows(b), _rows(y), _rows(r), KINDS[rows.kind],
            rows.k, rows.group, rows.eps, rows.outside, rows.before_scale, GATES[rows.gate],
            rows.activation == "sigmoid", round_affine, BLOCK_ROWS, _workers(x),
        )
    return y, r


def _gated_norm_op(
    x: torch.Tensor, z: torch.Tensor | None, g: torch.Tensor, b: torch.Tensor, spec: str,
    round_affine: bool, strict: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _gated_norm(x, z, g, b, decode(spec), round_affine, strict)


cpu_gated_norm = torch.library.custom_op(
    "normkit::cpu_gated_norm", _gated_norm_op, mutates_args=(), device_types="cpu"
)


@cpu_gated_norm.register_fake
def _cpu_gated_norm_fake(
    x: torch.Tensor, z: torch.Tensor | None, g: torch.Tensor, b: torch.Tensor, spec: str,
    *options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    count, n = x.shape
    return torch.empty_like(x), x.new_empty(count, n // decode(spec).group, dtype=torch.float32)


def _gated_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor | None, r: torch.Tensor, g: torch.Tensor,
    b: torch.Tensor, rows: RowSpec, round_affine: bool, need_g: bool, need_b: bool, strict: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dz, dg, db)`` of `cpu_gated_norm` for the cotangent ``dy``: dx and dz in x's
    dtype (dz (rows, 0) without a gate), dg and db float32 (zeros unless ``need_g`` /
    ``need_b``)."""
    kernels = _kernels(x.dtype, strict, gated=True)
    if kernels is None:
        return _composite_gated_vjp(dy, x, z, g, b, rows, round_affine)
    x, dy, r, g, b = _plain(x), _plain(dy), _plain(r), _plain(g), _plain(b)  # alive in the call
    count, n = x.shape
    gate = x.new_empty(count, 0) if z is None else _plain(z)
    dx = _memory.empty_like(x)
    dz = _memory.empty_like(gate)
    dg_blocks, db_blocks, dg, db = _param_grad_buffers(count, n, need_g, need_b)
    with _lock:
        kernels[1](
            _rows(x), _rows(gate), _rows(r), _rows(dy), _rows(g), _rows(b), _rows(dx), _rows(dz),
            _rows(dg_blocks), _rows(db_blocks), _rows(dg), _rows(db), KINDS[rows.kind], rows.k,
            rows.group, rows.eps, rows.outside, GATES[rows.gate], rows.activation == "sigmoid",
            need_g, need_b, BLOCK_ROWS, _workers(x),
        )
    return dx, dz, dg, db


def _gated_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor | None, r: torch.Tensor, g: torch.Tensor,
    b: torch.Tensor, spec: str, round_affine: bool, need_g: bool, need_b: bool, strict: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gated_norm_backward(dy, x, z, r, g, b, decode(spec), round_affine, need_g, need_b,
                                strict)


cpu_gated_norm_backward = torch.library.custom_op(
    "normkit::cpu_gated_norm_backward", _gated_norm_backward_op, mutates_args=(),
    device_types="cpu",
)


@cpu_gated_norm_backward.register_fake
def _cpu_gated_norm_backward_fake(
    dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor | None, r: torch.Tensor, g: torch.Tensor,
    *options: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dz = x.new_empty(x.shape[0], 0) if z is None else torch.empty_like(z)
    return torch.empty_like(x), dz, torch.empty_like(g), torch.empty_like(g)


def _composite_gated_vjp(
    dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor | None, g: torch.Tensor, b: torch.Tensor,
    rows: RowSpec, round_affine: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dz, dg, db)`` through `_composite_gated`, as a differentiable graph; dz (rows, 0)
    without a gate."""
    if z is None:
        vjp = torch.func.vjp(
            lambda xc, gc, bc: _composite_gated(xc, None, gc, bc, rows, round_affine), x, g, b
        )[1]
        dx, dg, db = vjp(dy)
        return dx, x.new_empty(x.shape[0], 0), dg, db
    vjp = torch.func.vjp(
        lambda xc, zc, gc, bc: _composite_gated(xc, zc, gc, bc, rows, round_affine), x, z, g, b
    )[1]
    dx, dz, dg, db = vjp(dy)
    return dx, dz, dg, db


@signature_once
class CpuGatedNormFunction(torch.autograd.Function):
    """`cpu_gated_norm` with its backward, as `CpuNormFunction` for the ungated ops:
    ``apply(x, z, g, b, rows, round_affine, strict, direct)``; under ``create_graph`` the
    gradient is the composite path's."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor, z: torch.Tensor | None, g: torch.Tensor, b: torch.Tensor, rows: RowSpec,
        round_affine: bool, strict: bool, direct: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if direct:
            return _gated_norm(x, z, g, b, rows, round_affine, strict)
        y, r = cpu_gated_norm(x, z, g, b, encode(rows), round_affine, strict)
        return y, r

    @staticmethod
    def setup_context(
        ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        x, z, g, b, rows, round_affine, strict, direct = inputs
        ctx.save_for_backward(x, z, output[1], g, b)
        ctx.mark_non_differentiable(output[1])
        ctx.rows, ctx.round_affine, ctx.strict, ctx.direct = rows, round_affine, strict, direct

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor, _dr: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        x, z, r, g, b = ctx.saved_tensors
        need_x, need_z, need_g, need_b = ctx.needs_input_grad[:4]
        rows, round_affine, strict = ctx.rows, ctx.round_affine, ctx.strict
        if torch.is_grad_enabled():
            dx, dz, dg, db = _composite_gated_vjp(dy, x, z, g, b, rows, round_affine)
        elif ctx.direct:
            dx, dz, dg, db = _gated_norm_backward(dy, x, z, r, g, b, rows, round_affine, need_g,
                                                  need_b, strict)
        else:
            dx, dz, dg, db = cpu_gated_norm_backward(dy, x, z, r, g, b, encode(rows),
                                                     round_affine, need_g, need_b, strict)
        return (
            dx if need_x else None, dz if need_z else None, dg if need_g else None,
            db if need_b else None, None, None, None, None,
        )


@torch.library.register_vmap("normkit::cpu_gated_norm")
def _cpu_gated_norm_vmap(
    info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, z: torch.Tensor | None,
    g: torch.Tensor, b: torch.Tensor, *options: Any,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]]:
    x_dim, z_dim, g_dim, b_dim = in_dims[:4]
    if x_dim is not None and (z is None or z_dim is not None) and g_dim is None and b_dim is None:
        moved = x.movedim(x_dim, 0)
        flat = moved.reshape(-1, moved.shape[-1])
        gate = None if z is None else z.movedim(z_dim, 0).reshape(flat.shape)
        y, r = cpu_gated_norm(flat, gate, g, b, *options)
        return (y.reshape(moved.shape), r.reshape(*moved.shape[:-1], r.shape[-1])), (0, 0)

    def one(xi: torch.Tensor, zi: torch.Tensor | None, gi: torch.Tensor, bi: torch.Tensor
            ) -> Any:
        return cpu_gated_norm(xi, zi, gi, bi, *options)

    result: tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]] = _batched(
        info, in_dims[:4], one, (x, z, g, b)
    )
    return result


@torch.library.register_vmap("normkit::cpu_gated_norm_backward")
def _cpu_gated_norm_backward_vmap(
    info: Any, in_dims: tuple[Any, ...], dy: torch.Tensor, x: torch.Tensor,
    z: torch.Tensor | None, r: torch.Tensor, g: torch.Tensor, b: torch.Tensor, *options: Any,
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    def one(*args: Any) -> Any:
        return cpu_gated_norm_backward(*args, *options)

    result: tuple[tuple[torch.Tensor, ...], tuple[int, ...]] = _batched(
        info, in_dims[:6], one, (dy, x, z, r, g, b)
    )
    return result


def _float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32: ``t`` itself when it is (``Tensor.to`` would return it too, after
    parsing its arguments, about 0.7 us a call)."""
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def _filled(n: int, value: float, x: torch.Tensor) -> torch.Tensor:
    """A float32 vector of ``n`` times ``value`` (the effective scale or bias a norm without
    that parameter reads); in eager calls one shared tensor per (n, value), which the kernels
    only read, saving its allocation on every call."""
    if torch.compiler.is_compiling() or not _eager(x):
        return torch.full((n,), value, dtype=torch.float32, device=x.device)
    return _shared_filled(n, value, math.copysign(1.0, value))  # -0.0 == 0.0 as a cache key


@functools.lru_cache(maxsize=64)
def _shared_filled(n: int, value: float, sign: float) -> torch.Tensor:
    # a normal CPU tensor whatever the context of the first call: an inference tensor could not
    # be saved for the backward of a later training call, nor one on another default device
    with torch.inference_mode(False):
        return torch.full((n,), math.copysign(value, sign), dtype=torch.float32, device="cpu")


def effective_scale(weight: torch.Tensor | None, rows: RowSpec, x: torch.Tensor) -> torch.Tensor:
    """The float32 ``scale_offset + w`` the kernels read (ones without a weight)."""
    if weight is None:
        return _filled(rows.n, 1.0, x)
    g = _float32(weight)
    return g + rows.scale_offset if rows.scale_offset != 0 else g


def float32_bias(bias: torch.Tensor | None, rows: RowSpec, x: torch.Tensor) -> torch.Tensor:
    """The float32 bias the kernels read, (n,): without one -0.0, whose addition changes no
    float (+0.0 would turn -0.0 into +0.0); the kernel's common loop then skips it."""
    return _filled(rows.n, -0.0, x) if bias is None else _float32(bias)


def degenerate(rows: RowSpec) -> bool:
    """Whether rows (or groups) of ``rows`` have no direction left for the output to vary in
    (one element for the RMS kinds, two for LayerNorm): the composite path takes them, in
    closed form."""
    return rows.group <= (2 if rows.kind == "layer" else 1)


def norm_rows(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rows: RowSpec,
    *,
    gate: torch.Tensor | None = None,
    round_affine: bool = False,
    strict: bool = False,
) -> torch.Tensor:
    """``y`` for rows ``x`` (rows, n): the `normkit.torch.kernels` interface, on the CPU kernel.

    ``weight`` and ``bias`` (n,) of any float dtype or None; their gradients come back in their
    own dtype. ``gate``: (rows, n) in x's dtype, exactly when ``rows.gate`` is set;
    ``round_affine`` rounds ``y_hat g + b`` to x's dtype before a gate after the norm.
    ``strict``: a kernel that fails to compile is an error rather than a warning and the
    composite path.
    """
    if (gate is None) != (rows.gate == ""):
        raise ValueError(f"gate={rows.gate or None!r} needs gate rows, and only it")
    g = effective_scale(weight, rows, x)
    b = float32_bias(bias, rows, x)
    if degenerate(rows):
        return _composite_gated(x, gate, g, b, rows, round_affine)
    return launch(x, gate, g, b, rows, round_affine, strict, _eager(x),
                  needs_graph(x, gate, g, b))


def launch(
    x: torch.Tensor, gate: torch.Tensor | None, g: torch.Tensor, b: torch.Tensor, rows: RowSpec,
    round_affine: bool, strict: bool, direct: bool, graph: bool,
) -> torch.Tensor:
    """`norm_rows` on the kernels' own operands: ``g`` and ``b`` float32 (`effective_scale`,
    `float32_bias`), the kernels called ``direct``ly or through their ops, the autograd
    ``graph`` recorded or not."""
    if rows.gate == "" and rows.group == rows.n:
        if graph:
            function = apply_eager if direct else apply
            y: torch.Tensor = function(CpuNormFunction, x, g, b, rows, strict, direct)[0]
            return y
        if direct:
            return _norm(x, g, b, rows, strict)[0]
        return CpuNormFunction.forward(x, g, b, rows, strict, direct)[0]
    if graph:
        function = apply_eager if direct else apply
        y = function(CpuGatedNormFunction, x, gate, g, b, rows, round_affine, strict, direct)[0]
        return y
    return CpuGatedNormFunction.forward(x, gate, g, b, rows, round_affine, strict, direct)[0]
