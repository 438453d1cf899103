"""normkit's CPU kernel (numba) against the reference: every option and dtype, forward and
backward; the edges of float32; threads, fork, torch.compile, torch.func; the kernel switch and
its fallback."""

from __future__ import annotations

import importlib
import inspect
import itertools
import os
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from normkit import dtypes, reference, tolerances
from normkit.bridges import TorchBridge
from normkit.spec import Kind, NormSpec
from normkit.torch import _memory, _plan, kernels
from normkit.torch._spec import row_spec
from normkit.torch.functional import layer_norm, normalize, partial_rms_norm, rms_norm
from normkit.torch.kernels import cpu
from normkit.torch.modules import LayerNorm, PartialRMSNorm, RMSNorm, from_spec

to_numpy, to_torch = TorchBridge().to_numpy, TorchBridge().to_tensor

pytest.importorskip("numba")
CHUNK = importlib.import_module("normkit.torch.kernels._cpu_numba").CHUNK

DTYPES = ("float32", "bfloat16", "float16")
SPECS = {
    "rms": NormSpec(kind="rms"),
    "partial": NormSpec(kind="partial_rms", p=0.25),
    "partial_k1": NormSpec(kind="partial_rms", p=0.01),
    "layer": NormSpec(kind="layer"),
}
SIZES = (1, 2, 7, 256)


class Spy:
    """Counts the numba kernels' launches (the entry points `cpu._state` holds), forwarding
    them."""

    def __init__(self) -> None:
        self.calls = {"forward": 0, "backward": 0}
        self.workers: list[int] = []

    def counting(self, kernels: tuple[Any, ...]) -> tuple[Any, ...]:
        def counted(name: str, kernel: Any) -> Any:
            def launch(*args: Any) -> Any:
                self.calls[name] += 1
                self.workers.append(args[-1])
                return kernel(*args)

            return launch

        return tuple(counted(name, k) for name, k in zip(self.calls, kernels, strict=True))


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """The kernels, compiled, with their launches counted."""
    counting = Spy()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert cpu.load(dtype) is not None, cpu.unavailable_reason()
        compiled = cpu._state["compiled"]
        monkeypatch.setitem(compiled, (dtype, False), counting.counting(compiled[(dtype, False)]))
    return counting


def _arrays(shape: tuple[int, ...], dtype: str, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    d = dtypes.DTYPE_NAMES[dtype]
    return tuple(rng.standard_normal(shape).astype(d) for _ in range(2))


def _check(spec: NormSpec, x: np.ndarray, dy: np.ndarray, scale: np.ndarray | None,
           bias: np.ndarray | None, what: str) -> None:
    """normkit.torch with kernel='cpu' against the reference, forward and backward."""
    xt = to_torch(x).requires_grad_()
    params = [None if p is None else to_torch(p).requires_grad_() for p in (scale, bias)]
    y = normalize(xt, spec, params[0], params[1], kernel="cpu")
    y.backward(to_torch(dy))
    mag = reference.scaled_magnitude(x, spec, scale)
    tolerances.assert_close(to_numpy(y), reference.normalize(x, spec, scale, bias), cast=spec.cast,
                            what=f"{what} y", magnitude=mag)
    expected = reference.normalize_vjp(x, dy, spec, scale, bias)
    actual = [xt.grad] + [None if p is None else p.grad for p in params]
    given = (x, scale, bias)
    for name, got, want, arg in zip(("dx", "dscale", "dbias"), actual, expected, given):
        if arg is not None:
            assert got is not None and want is not None, f"{what}: no {name}"
            tolerances.assert_close(to_numpy(got), want, quantity="grad", what=f"{what} {name}")


@pytest.mark.parametrize("outside", [False, True], ids=["inside", "outside"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SPECS))
def test_every_option_matches_the_reference(name: str, dtype: str, outside: bool,
                                            spy: Spy) -> None:
    """Offset, bias, cast order and parameter dtype, at n = 1, 2, 7, 256."""
    failures = []
    options = itertools.product((0.0, 1.0), (False, True), ("after_scale", "before_scale"),
                                ("float32", dtype), SIZES)
    for seed, (offset, bias, cast, param_dtype, n) in enumerate(options):
        spec = SPECS[name].replace(eps_placement="outside" if outside else "inside",
                                   scale_offset=offset, bias=bias, cast=cast)
        x, dy = _arrays((3, 5, n), dtype, seed)
        rng = np.random.default_rng(seed)
        pd = dtypes.DTYPE_NAMES[param_dtype]
        scale = (rng.standard_normal(n) + spec.scale_init).astype(pd)
        b = rng.standard_normal(n).astype(pd) if bias else None
        try:
            _check(spec, x, dy, scale, b, f"{spec} params {param_dtype} n={n}")
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n".join(failures)
    assert spy.calls["forward"] > 0 and spy.calls["backward"] > 0


def test_parameterless_and_trailing_multi_axis_rows(spy: Spy) -> None:
    x, dy = _arrays((4, 3, 8), "bfloat16", 7)
    _check(NormSpec(scale=False), x, dy, None, None, "no scale")
    rng = np.random.default_rng(8)
    for axis in ((-2, -1), 0):
        spec = NormSpec(kind="layer", axis=axis)
        shape = spec.param_shape(x.shape)
        scale, bias = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        _check(spec, x, dy, scale, bias, f"axis {axis}")


@pytest.mark.parametrize(
    "name, x",
    [
        ("1e20 rows", np.random.default_rng(0).standard_normal((2, 8)) * 1e20),
        ("+-3e38", np.array([[3e38, -3e38, 1e38, 2.0], [-3e38, 1.0, 0.0, 3e38]])),
        ("mean 1e6", np.random.default_rng(1).standard_normal((4, 64)) + 1e6),
        ("zeros", np.zeros((2, 8))),
        ("tiny", np.random.default_rng(2).standard_normal((2, 8)) * 1e-30),
    ],
)
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("outside", [False, True], ids=["inside", "outside"])
def test_float32_edges(name: str, x: np.ndarray, kind: Kind, outside: bool, spy: Spy) -> None:
    """Overflowing statistics, a large mean, zero and tiny rows: the reference's values."""
    spec = NormSpec(kind=kind, eps_placement="outside" if outside else "inside")
    dy = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)
    _check(spec, x.astype(np.float32), dy, None, None, name)


@pytest.mark.parametrize("kind", ["rms", "partial_rms", "layer"])
def test_edge_rows_after_ordinary_rows_in_one_block(kind: Kind, spy: Spy) -> None:
    """The forward reads each row's statistic while writing the row before it: rows at float32's
    edges in the middle of a block (one thread: one block) still get the reference's values."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((7, 16))
    x[1] *= 1e20
    x[3, :4] = [3e38, -3e38, 1e38, 2.0]
    x[4] *= 1e-30
    x[5] += 1e6
    dy = rng.standard_normal(x.shape).astype(np.float32)
    spec = NormSpec(kind=kind, p=0.25) if kind == "partial_rms" else NormSpec(kind=kind)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check(spec, x.astype(np.float32), dy, None, None, f"{kind} edge rows in a block")
    finally:
        torch.set_num_threads(threads)


def test_gradient_of_the_bias_alone_with_a_frozen_weight(spy: Spy) -> None:
    """The backward skips the weight's gradient when autograd does not ask for it; dx and the
    bias's gradient are unchanged."""
    x, dy = _arrays((6, 40), "bfloat16", 5)
    rng = np.random.default_rng(6)
    scale, bias = (rng.standard_normal(40).astype(np.float32) for _ in range(2))
    spec = NormSpec(kind="layer")
    xt = to_torch(x).requires_grad_()
    weight, shift = to_torch(scale), to_torch(bias).requires_grad_()
    normalize(xt, spec, weight, shift, kernel="cpu").backward(to_torch(dy))
    dx, _, dbias = reference.normalize_vjp(x, dy, spec, scale, bias)
    assert weight.grad is None and spy.calls["backward"] == 1
    tolerances.assert_close(to_numpy(xt.grad), dx, quantity="grad", what="dx")
    tolerances.assert_close(to_numpy(shift.grad), dbias, quantity="grad", what="dbias")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="no transparent huge pages (Linux's) here")
def test_large_outputs_are_advised_onto_huge_pages() -> None:
    """An output of 32 MiB or more gets MADV_HUGEPAGE (VmFlags "hg" in /proc/self/smaps) before
    it is written; a small one does not."""

    def advised(t: torch.Tensor) -> bool:
        address = t.data_ptr() + t.numel() * t.element_size() // 2
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(part, 16) for part in head.split("-"))
                    inside = start <= address < end
                elif inside and head == "VmFlags:":
                    return "hg" in line.split()[1:]
        raise AssertionError("no mapping holds the tensor")

    big = torch.empty(_memory.HUGE_PAGE_MIN_BYTES // 4, dtype=torch.float32)  # untouched: no RSS
    assert advised(_memory.empty_like(big))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_outputs_start_on_a_huge_page(dtype: torch.dtype) -> None:
    """A large output starts on a 2 MiB boundary, so that all of it can be huge pages, and is
    an ordinary contiguous tensor of ``t``'s shape and dtype (not a view) whose storage is at
    most 2 MiB larger. A 3-d input of 2 MiB and 32 bytes more keeps its shape."""
    count = (_memory.HUGE_PAGE_MIN_BYTES + 32) // torch.empty((), dtype=dtype).element_size()
    like = torch.empty(2, count // 2, 1, dtype=dtype)
    out = _memory.empty_like(like)
    assert out.data_ptr() % _memory.HUGE_PAGE == 0
    assert (out.shape, out.dtype, out.is_contiguous(), out._base) == (
        like.shape, dtype, True, None)
    size = like.numel() * like.element_size()
    storage = out.untyped_storage()
    assert storage.data_ptr() <= out.data_ptr()
    assert out.data_ptr() + size <= storage.data_ptr() + storage.nbytes() <= (
        out.data_ptr() + size + _memory.HUGE_PAGE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_outputs_hold_each_rows_own_values(dtype: str, spy: Spy) -> None:
    """On outputs placed at a 2 MiB boundary (32 MiB and more, `_output_like`), ``y`` and
    ``dx`` hold, row for row, the bits the same rows give in small batches, whose outputs are
    plain allocations: nothing is shifted or left unwritten."""
    n = 4096
    rows = _memory.HUGE_PAGE_MIN_BYTES // (n * dtypes.DTYPE_NAMES[dtype].itemsize) + 3
    x, dy = (to_torch(a) for a in _arrays((rows, n), dtype, 5))
    module = from_spec(NormSpec(kind="rms"), n, dtype=x.dtype, kernel="cpu")

    def run(xs: torch.Tensor, dys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xs = xs.clone().requires_grad_()
        y = module(xs)
        y.backward(dys)
        assert xs.grad is not None
        return y.detach(), xs.grad

    y, dx = run(x, dy)
    assert y.data_ptr() % _memory.HUGE_PAGE == 0 and dx.data_ptr() % _memory.HUGE_PAGE == 0
    for part in (slice(0, 5), slice(rows // 2 - 1, rows // 2 + 2), slice(rows - 4, rows)):
        y_part, dx_part = run(x[part], dy[part])
        for whole, alone in ((y[part], y_part), (dx[part], dx_part)):
            assert to_numpy(whole).tobytes() == to_numpy(alone).tobytes()
    tolerances.assert_close(to_numpy(y[-4:]), reference.normalize(to_numpy(x[-4:]),
                                                                  NormSpec(kind="rms")), dtype)


def test_small_outputs_are_not_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below 32 MiB no madvise call is made (checked on the call: a small tensor may sit in a
    mapping an earlier large one had advised); a large output's new storage is advised once."""
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(_memory, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    monkeypatch.setattr(_memory, "_kept", {})
    _memory.empty_like(torch.empty(1024))
    assert calls == []
    _memory.empty_like(torch.empty(_memory.HUGE_PAGE_MIN_BYTES // 4))
    assert len(calls) == 1


def test_a_dropped_large_output_is_reused_and_a_used_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outputs of 32 MiB and more are made in storages kept for reuse: once nothing uses an
    output (no tensor, view or saved tensor), the next output of its size gets its memory,
    already mapped (no page fault, no huge-page advice, whatever the machine gives); while a
    view of it lives, it is not handed out. `empty_cache` gives back the idle ones; at most
    `KEPT_BYTES` are kept."""
    monkeypatch.setattr(_memory, "_kept", {})
    like = torch.empty(_memory.HUGE_PAGE_MIN_BYTES // 4)
    first = _memory.empty_like(like)
    address = first.data_ptr()
    view = first[1:]
    del first
    second = _memory.empty_like(like)  # the view still uses the first storage
    assert second.data_ptr() != address
    del view, second
    third = _memory.empty_like(like)
    assert third.data_ptr() == address  # the first of the two idle storages
    kept = sum(len(held) for held in _memory._kept.values())
    assert kept == 2
    del third
    nbytes = _memory.HUGE_PAGE_MIN_BYTES + _memory.HUGE_PAGE
    assert _memory.empty_cache() == 2 * nbytes
    monkeypatch.setattr(_memory, "KEPT_BYTES", nbytes)
    held = [_memory.empty_like(like) for _ in range(2)]  # the second is not kept
    assert sum(len(h) for h in _memory._kept.values()) == 1 and len(held) == 2


def test_a_loop_dropping_its_outputs_writes_into_the_same_memory() -> None:
    """The issue's loop (a forward of 2048 x 4096 float32 whose output is dropped, again and
    again) gets one storage back each time: its pages are mapped once, whatever the machine
    does with huge pages, so each call runs at the same speed. The bits are the same."""
    module = RMSNorm(4096, 1e-6)
    x = torch.randn(2048, 4096)
    with torch.no_grad():
        first = module(x)
        address, bits = first.data_ptr(), first.numpy().tobytes()
        del first
        for _ in range(3):
            y = module(x)
            assert y.data_ptr() == address and y.numpy().tobytes() == bits
            del y


def test_nonfinite_rows_give_the_references_nan_and_inf(spy: Spy) -> None:
    x = np.array([[np.nan, 1, 2, 3], [np.inf, 1, 2, 3], [1, 2, 3, 4]], np.float32)
    dy = np.ones_like(x)
    with np.errstate(invalid="ignore"):
        _check(NormSpec(), x, dy, None, None, "nan/inf")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_weights_give_nan_whatever_their_payload(dtype: str, spy: Spy) -> None:
    """The common loop rounds to bfloat16 without a test for NaN (`_store_number`), where an
    addition would carry a NaN's payload out of its exponent (0x7FFFFFFF to -0.0, 0xFFFFFFFF
    to +0.0): a weight or bias holding a NaN sends the call to the careful loop, and those
    columns come out NaN, the others as the reference's."""
    x = _arrays((6, 16), dtype, 3)[0]
    weight = np.linspace(0.5, 2, 16).astype(np.float32)
    bias = np.linspace(-1, 1, 16).astype(np.float32)
    payloads = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000], np.uint32).view(np.float32)
    spec = NormSpec(bias=True)
    for params in ((weight, bias), (bias, weight)):  # NaN in the weight, then in the bias
        nan_params = params[0].copy()
        nan_params[[2, 7, 11]] = payloads
        scale, shift = (nan_params, params[1]) if params[0] is weight else (params[1], nan_params)
        y = to_numpy(normalize(to_torch(x), spec, to_torch(scale), to_torch(shift),
                               kernel="cpu"))
        assert np.isnan(y[:, [2, 7, 11]].astype(np.float64)).all()
        keep = np.setdiff1d(np.arange(16), [2, 7, 11])
        expected = reference.normalize(x, spec, scale, shift)
        tolerances.assert_close(y[:, keep], expected[:, keep], what="y beside the NaN columns")


def test_eps_below_float32_is_refused_before_the_kernel() -> None:
    """1/eps = 1e39 would overflow float32: such an eps is refused (`NormSpec.check_eps`)."""
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="eps=1e-39 is out of range for a float32 input"):
        normalize(x, NormSpec(eps=1e-39, eps_placement="outside"), kernel="cpu")


@pytest.mark.parametrize("outside", [False, True], ids=["inside", "outside"])
def test_partial_k1_gradient_is_free_of_cancellation(outside: bool, spy: Spy) -> None:
    """x_0 large against sqrt(eps): dx_0 is eps * d_0 - x_0 S_1 times a power of r."""
    x = np.array([[1e3, 0.5, -0.25, 2.0], [-3e2, 1.0, 1.0, -1.0]], np.float32)
    dy = np.array([[0.5, 1e3, -2e3, 1.0], [1.0, 3e2, 0.0, 2.0]], np.float32)
    spec = NormSpec(kind="partial_rms", p=0.25, eps_placement="outside" if outside else "inside")
    _check(spec, x, dy, None, None, "k=1")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["rms", "partial_rms", "layer"])
def test_rows_of_several_chunks_with_edges_in_one_chunk(kind: Kind, dtype: str, spy: Spy
                                                        ) -> None:
    """Rows of 3 chunks and a remainder (sums in float32 per chunk, float64 across): ordinary
    rows, and rows where one chunk's float32 squares overflow or all underflow, a large mean,
    a first element far from the mean (LayerNorm's backward shifts by it), and p ending
    inside a chunk."""
    n = 3 * CHUNK + 5
    rng = np.random.default_rng(12)
    x = rng.standard_normal((6, n))
    x[1, 300] = 1e20
    x[2] *= 1e-25
    x[3] += 1e4
    x[4, 0] = 1e3
    dy = rng.standard_normal(x.shape)
    dy[1, 300] = 1e20  # dy * x overflows float32 too
    spec = NormSpec(kind=kind, p=0.4) if kind == "partial_rms" else NormSpec(kind=kind)
    scale = rng.standard_normal(n).astype(np.float32) + 1
    d = dtypes.DTYPE_NAMES[dtype]
    _check(spec, x.astype(d), dy.astype(d), scale, None, f"{kind} {dtype} n={n}")
    assert spy.calls["forward"] == 1 and spy.calls["backward"] == 1


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_row_of_2_20_elements(kind: Kind, spy: Spy) -> None:
    """Float32 chunks added in float64: within the float32 bound where one running float32 sum
    is not."""
    x, dy = _arrays((1, 2**20), "float32", 11)
    _check(NormSpec(kind=kind), x + np.float32(3.0), dy, None, None, "n=2**20")


def _recompiled(function: Any, argtypes: Any, **options: Any) -> Any:
    """``function`` (a kernel's jitted function) compiled again for ``argtypes`` without numba's
    cache, whose loaded functions keep no machine code, IR or diagnostics to read."""
    from numba import njit

    fresh = njit(**options)(function.py_func)
    fresh.compile(argtypes)
    return fresh


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_tasks_count_no_references(dtype: str) -> None:
    """Structural guard for speed (nothing is timed): a task and the row functions it calls
    compile without numba's reference counting, whose atomic increments on counters every
    thread shares cost 40-50 per row in the backward (about 300 ns a row on one thread)."""
    from numba import typeof, types

    m = importlib.import_module("normkit.torch.kernels._cpu_numba")
    rows = typeof(np.empty((1, 1), m.ROW_DTYPES[dtype]))
    vec, table = typeof(np.empty(1, np.float32)), typeof(np.empty((1, 1), np.float32))
    counter, i64, f64, flag = typeof(np.empty(1, np.int64)), types.int64, types.float64, types.boolean
    tasks = {
        m._forward_task: (rows, vec, vec, rows, vec, i64, i64, f64, *[flag] * 4, i64, counter),
        m._backward_task: (rows, vec, rows, rows, vec, table, table, i64, i64, f64,
                           *[flag] * 3, i64, i64, counter, table),
    }
    for task, argtypes in tasks.items():
        ir = "".join(_recompiled(task, argtypes, **task.targetoptions).inspect_llvm().values())
        assert "NRT_incref" not in ir and "NRT_decref" not in ir, f"{task.__name__} counts"


@pytest.mark.parametrize("name", ["forward", "backward", "gated_forward", "gated_backward"])
def test_each_launch_opens_one_parallel_region(name: str, spy: Spy) -> None:
    """Structural guard for speed (nothing is timed): each kernel compiles to one parallel loop,
    its tasks. A fill such as ``np.zeros`` in a parallel function becomes a parallel loop of its
    own, whose start (60-130 us on the workqueue layer) every launch then pays twice. (``spy``
    loads the kernels first, which chooses numba's threading layer as normkit does.)"""
    m = importlib.import_module("normkit.torch.kernels._cpu_numba")
    signatures = m.gated_signatures if name.startswith("gated") else m.signatures
    fresh = _recompiled(getattr(m, name), signatures("float32")[0 if name.endswith("forward") else 1],
                        parallel=True)
    diagnostics = fresh.get_metadata(fresh.signatures[0])["parfor_diagnostics"]
    assert diagnostics.count_parfors() == 1


def test_half_conversions_match_torch() -> None:
    """Every float16 / bfloat16 bit pattern widens exactly; float32 values round like torch."""
    from numba import njit

    from normkit.torch.kernels import _cpu_numba as jit

    @njit
    def widen(bits: np.ndarray, out: np.ndarray) -> None:
        for j in range(bits.size):
            out[j] = jit._load(bits, j)

    @njit
    def narrow(values: np.ndarray, out: np.ndarray) -> None:
        for j in range(values.size):
            jit._store(out, j, values[j])

    all_bits = np.arange(2**16, dtype=np.uint16)
    rng = np.random.default_rng(0)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 6e-8,
                         2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, 3e38, 1e-45], np.float32)
    values = np.concatenate([
        specials,
        rng.standard_normal(20000).astype(np.float32) * np.float32(1e3),
        (rng.integers(0, 2**32, 20000, dtype=np.uint64)).astype(np.uint32).view(np.float32),
    ])
    for torch_dtype, view in ((torch.bfloat16, np.int16), (torch.float16, np.uint16)):
        widened = np.empty(2**16, np.float32)
        widen(all_bits.view(view), widened)
        expected = torch.from_numpy(all_bits.view(np.int16)).view(torch_dtype).float().numpy()
        np.testing.assert_array_equal(widened, expected)
        rounded = np.empty(values.size, view)
        narrow(values, rounded)
        want = torch.from_numpy(values).to(torch_dtype).view(torch.int16).numpy().view(view)
        got_f = torch.from_numpy(rounded.view(np.int16)).view(torch_dtype).float().numpy()
        want_f = torch.from_numpy(want.view(np.int16)).view(torch_dtype).float().numpy()
        np.testing.assert_array_equal(got_f, want_f)


# ---- threads, fork, compile, torch.func ------------------------------------------------------


def test_four_python_threads_at_once(spy: Spy) -> None:
    module = RMSNorm(64, kernel="cpu")
    inputs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    expected = [module(x) for x in inputs]
    results: dict[int, list[torch.Tensor]] = {}
    barrier = threading.Barrier(4)

    def work(i: int) -> None:
        barrier.wait()
        results[i] = [module(inputs[i]) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        for y in results[i]:
            torch.testing.assert_close(y, expected[i], rtol=0, atol=0)
    tolerances.assert_close(to_numpy(expected[0]),
                            reference.normalize(inputs[0].numpy(), NormSpec()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["rms", "partial_rms", "layer"])
def test_results_do_not_depend_on_the_thread_count(
    kind: Kind, dtype: str, spy: Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads claim blocks of rows as they come, and the weight's and bias's gradients are
    summed per block: outputs and gradients must come out bit for bit the same whatever the
    number of threads (here 1, on the calling thread, then 2 and 3 over 3 blocks and a part, in
    a parallel region, which this input's size would not open: `cpu.SERIAL` set to 0)."""
    import numba

    monkeypatch.setattr(cpu, "SERIAL", 0)
    spec = NormSpec(kind=kind, p=0.25, bias=True) if kind == "partial_rms" else NormSpec(
        kind=kind, bias=True)
    x, dy = _arrays((3 * cpu.BLOCK_ROWS + 5, 3 * CHUNK + 5), dtype, 13)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            xt = to_torch(x).requires_grad_()
            module = from_spec(spec, x.shape[-1], dtype=xt.dtype, kernel="cpu")
            y = module(xt)
            y.backward(to_torch(dy))
            grads = [xt.grad, module.weight.grad, module.bias.grad]
            results.append([to_numpy(t).tobytes() for t in (y, *grads)])
    finally:
        torch.set_num_threads(threads)
    assert results[0] == results[1] == results[2]
    assert spy.calls["forward"] == 3 and spy.calls["backward"] == 3
    limit = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    assert spy.workers == [min(count, limit) for count in (1, 2, 3) for _ in "yx"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_results_do_not_depend_on_the_claim(
    dtype: str, spy: Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backward tasks claim several blocks at a time (`cpu._claimed_blocks`) and sum the
    parameters' gradients per block: ``dx``, the weight's and the bias's gradients come out bit
    for bit the same in claims of 1, 2 and 3 blocks over 3 blocks and a part (the last claim
    short) on two threads, and match the reference."""
    monkeypatch.setattr(cpu, "SERIAL", 0)
    spec = NormSpec(kind="layer", bias=True)
    x, dy = _arrays((3 * cpu.BLOCK_ROWS + 5, CHUNK + 5), dtype, 21)
    threads = torch.get_num_threads()
    results = []
    try:
        torch.set_num_threads(2)
        for claim in (1, 2, 3):
            monkeypatch.setattr(cpu, "_claimed_blocks", lambda x, workers, claim=claim: claim)
            xt = to_torch(x).requires_grad_()
            module = from_spec(spec, x.shape[-1], dtype=xt.dtype, kernel="cpu")
            module(xt).backward(to_torch(dy))
            grads = [to_numpy(t) for t in (xt.grad, module.weight.grad, module.bias.grad)]
            results.append([g.tobytes() for g in grads])
    finally:
        torch.set_num_threads(threads)
    assert results[0] == results[1] == results[2]
    assert spy.calls["backward"] == 3
    scale, bias = np.ones(x.shape[-1], x.dtype), np.zeros(x.shape[-1], x.dtype)
    expected = reference.normalize_vjp(x, dy, spec, scale, bias)
    for got, want in zip(grads, expected, strict=True):
        tolerances.assert_close(got, want, quantity="grad")


def _offset_rows(a: np.ndarray, offset: int) -> torch.Tensor:
    """``a`` as a torch tensor that starts ``offset`` elements into its storage."""
    t = to_torch(a)
    storage = torch.empty(t.numel() + offset, dtype=t.dtype)
    rows = storage[offset:].view(t.shape)
    rows.copy_(t)
    return rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["rms", "partial_rms", "layer"])
def test_a_rows_bits_do_not_depend_on_its_batch(kind: Kind, dtype: str, spy: Spy) -> None:
    """Batch invariance: a row's output and input gradient are the same bits alone, in a batch
    of another size, at another position, in reversed order, and at any alignment in memory
    (rows shorter and longer than a chunk)."""
    spec = NormSpec(kind=kind, p=0.25, bias=True) if kind == "partial_rms" else NormSpec(
        kind=kind, bias=True)

    def run(x: np.ndarray, dy: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray]:
        xt = _offset_rows(x, offset).requires_grad_()
        module = from_spec(spec, x.shape[-1], dtype=xt.dtype, kernel="cpu")
        y = module(xt)
        y.backward(_offset_rows(dy, offset))
        return to_numpy(y), to_numpy(xt.grad)

    for n in (CHUNK // 2 + 3, 2 * CHUNK + 5):
        x, dy = _arrays((2 * cpu.BLOCK_ROWS + 7, n), dtype, 17)
        y, dx = run(x, dy, 0)
        tolerances.assert_close(y, reference.normalize(x, spec), dtype)
        flipped = run(x[::-1].copy(), dy[::-1].copy(), 1)
        assert flipped[0][::-1].tobytes() == y.tobytes()
        assert flipped[1][::-1].tobytes() == dx.tobytes()
        for start, stop, offset in ((70, 71, 3), (5, 90, 2), (cpu.BLOCK_ROWS - 1, None, 5)):
            part = run(x[start:stop], dy[start:stop], offset)
            assert part[0].tobytes() == y[start:stop].tobytes()
            assert part[1].tobytes() == dx[start:stop].tobytes()


def test_uses_torchs_thread_count(spy: Spy, monkeypatch: pytest.MonkeyPatch) -> None:
    import numba

    monkeypatch.setattr(cpu, "SERIAL", 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        RMSNorm(8, kernel="cpu")(torch.randn(4, 8))
        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    RMSNorm(8, kernel="cpu")(torch.randn(4, 8))
    limit = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    assert numba.get_num_threads() == min(before, limit)
    if "NUMBA_THREADING_LAYER" not in os.environ:
        assert numba.threading_layer() == cpu._threading_layer()


def test_small_inputs_run_on_the_calling_thread(spy: Spy) -> None:
    """Below `cpu._serial` elements the kernels open no parallel region (whose start cost 140 us
    on numba's workqueue layer against 2.3 us in the kernel for a row of 4096); from there on
    they use torch's thread count."""
    threads = cpu._threads()
    x = torch.randn(4, 8, requires_grad=True)
    RMSNorm(8, kernel="cpu")(x).sum().backward()
    rows = cpu._serial() // 1024
    RMSNorm(1024, kernel="cpu")(torch.randn(rows - 1, 1024))
    RMSNorm(1024, kernel="cpu")(torch.randn(rows, 1024))
    assert spy.workers == [1, 1, 1, threads]


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_inference_skips_the_autograd_function(
    spy: Spy, monkeypatch: pytest.MonkeyPatch, gated: bool
) -> None:
    """Under no_grad, or with no input requiring grad, the Function's forward runs alone
    (``apply`` records a graph nobody needs, 20 us of host time against the kernel's 2.3 us
    on a row of 4096), with the bits of a call through ``apply``."""
    spec = NormSpec(gate="after", group_size=4) if gated else NormSpec(bias=True)
    x, z = torch.randn(3, 8), torch.randn(3, 8)
    module = from_spec(spec, 8, kernel="cpu")
    call = (lambda: module(x, gate=z)) if gated else (lambda: module(x))
    recorded = call()
    assert recorded.requires_grad
    function = cpu.CpuGatedNormFunction if gated else cpu.CpuNormFunction

    def refuse(*args: object) -> None:
        raise AssertionError("an inference call recorded an autograd graph")

    monkeypatch.setattr(function, "apply", refuse)
    with torch.no_grad():
        alone = call()
    for p in module.parameters():
        p.requires_grad_(False)
    frozen = call()
    assert not alone.requires_grad and not frozen.requires_grad
    assert recorded.detach().numpy().tobytes() == alone.numpy().tobytes() == (
        frozen.numpy().tobytes())


_OPENMP_PROCESS = """
import ctypes, os, sys
import numba
import torch
from normkit.torch import RMSNorm
from normkit.torch.kernels import cpu

cpu.SERIAL = 0  # every call with more than one thread in a parallel region
openmp = ctypes.CDLL(None)
levels = openmp.omp_get_max_active_levels()
x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
module = RMSNorm(64, kernel="cpu")
torch.set_num_threads(2)
torch.ones(2**22) * 2  # torch's OpenMP threads are up
torch.set_num_threads(1)
threads = len(os.listdir("/proc/self/task"))
with torch.no_grad():
    module(x)  # the kernels' first call starts numba's threading layer
    if numba.threading_layer() != "omp":
        print("skip: numba chose", numba.threading_layer())
        sys.exit(0)
    # numba's OpenMP layer sets the OpenMP thread count to its own (2 and more), and nesting
    assert torch.get_num_threads() == 1, torch.get_num_threads()
    assert openmp.omp_get_max_active_levels() == levels
    torch.set_num_threads(2)
    y = module(x)
    # a pool of numba's own would start a thread per core (loading the kernels starts one)
    started = len(os.listdir("/proc/self/task")) - threads
    assert started < numba.config.NUMBA_NUM_THREADS, started
    pid = os.fork()
    if pid == 0:  # numba ends a forked child that starts GNU OpenMP's threads
        os._exit(0 if torch.equal(module(x), y) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
print("ok")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/task and fork: Linux")
@pytest.mark.parametrize("chosen", [None, "default"], ids=["normkit's choice", "numba's"])
def test_the_kernel_runs_on_torchs_openmp_threads(chosen: str | None) -> None:
    """Where torch's OpenMP runtime is global (its wheels), the kernel's parallel regions run
    on torch's own threads, which busy-wait after each torch op, instead of threads of
    numba's own beside them: the kernel starts no thread. Starting numba's OpenMP layer leaves
    torch's thread count and OpenMP nesting as they were, and a forked child (numba would end
    one that starts GNU OpenMP's threads) computes on its calling thread, with the same bits,
    also where numba chose its OpenMP layer itself (``NUMBA_THREADING_LAYER=default``). In a
    process of its own: the layer is chosen once per process."""
    if cpu._threading_layer() != "omp":
        pytest.skip("torch's OpenMP runtime is not global here: the workqueue layer runs")
    if cpu._threads() < 2:
        pytest.skip("one thread: no parallel region")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    if chosen is not None:
        env["NUMBA_THREADING_LAYER"] = chosen
    done = subprocess.run([sys.executable, "-c", _OPENMP_PROCESS], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.startswith("skip"):
        pytest.skip(done.stdout.strip())
    assert done.stdout.strip() == "ok", done.stdout


class _Normalized(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.module = LayerNorm(16, kernel="cpu")
        self.x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        with torch.no_grad():
            return self.module(self.x[i])


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method: Linux")
def test_forked_dataloader_worker(spy: Spy) -> None:
    """The parent has run the kernel's thread pool before forking; the worker runs it again."""
    data = _Normalized()
    expected = torch.stack([data[i] for i in range(4)])
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=1,
                                         multiprocessing_context="fork")
    (batch,) = list(loader)
    torch.testing.assert_close(batch, expected, rtol=0, atol=0)
    tolerances.assert_close(to_numpy(batch), reference.normalize(data.x.numpy(),
                                                                   data.module.spec))


def test_torch_compile_fullgraph_runs_the_kernel(spy: Spy) -> None:
    torch._dynamo.reset()
    module = PartialRMSNorm(32, 0.25, bias=True, kernel="cpu")
    compiled = torch.compile(module, fullgraph=True)
    x, dy = _arrays((6, 32), "bfloat16", 9)
    xt = to_torch(x).requires_grad_()
    y = compiled(xt)
    y.backward(to_torch(dy))
    assert spy.calls["forward"] == 1 and spy.calls["backward"] == 1
    spec = module.spec
    tolerances.assert_close(to_numpy(y), reference.normalize(x, spec))
    dx, dscale, dbias = reference.normalize_vjp(x, dy, spec)
    assert xt.grad is not None and module.weight is not None and module.bias is not None
    assert module.weight.grad is not None and module.bias.grad is not None
    assert dscale is not None and dbias is not None
    tolerances.assert_close(to_numpy(xt.grad), dx, quantity="grad")
    tolerances.assert_close(to_numpy(module.weight.grad), dscale, quantity="grad")
    tolerances.assert_close(to_numpy(module.bias.grad), dbias, quantity="grad")


def test_torch_func_grad_and_vmap(spy: Spy) -> None:
    from torch.func import functional_call, grad, vmap

    module = LayerNorm(16, kernel="cpu")
    spec = module.spec
    x, dy = _arrays((3, 4, 16), "float32", 13)
    xt, dyt = to_torch(x), to_torch(dy)
    params = {k: v.detach() for k, v in module.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xx: torch.Tensor, dd: torch.Tensor) -> torch.Tensor:
        return (functional_call(module, p, (xx,)) * dd).sum()

    grads = grad(loss, argnums=(0, 1))(params, xt, dyt)
    dx, dscale, dbias = reference.normalize_vjp(x, dy, spec)
    assert dscale is not None and dbias is not None
    tolerances.assert_close(to_numpy(grads[1]), dx, quantity="grad")
    tolerances.assert_close(to_numpy(grads[0]["weight"]), dscale, quantity="grad")
    tolerances.assert_close(to_numpy(grads[0]["bias"]), dbias, quantity="grad")
    ys = vmap(module)(xt)
    tolerances.assert_close(to_numpy(ys), reference.normalize(x, spec))
    per_sample = vmap(grad(loss, argnums=1), in_dims=(None, 0, 0))(params, xt, dyt)
    tolerances.assert_close(to_numpy(per_sample), dx, quantity="grad")
    assert spy.calls["forward"] > 0


def test_double_backward_through_the_composite_graph(spy: Spy) -> None:
    x = torch.randn(4, 8, dtype=torch.float32, requires_grad=True)
    (gx,) = torch.autograd.grad(RMSNorm(8, kernel="cpu")(x).pow(2).sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sum(), x)
    x2 = x.detach().requires_grad_()
    (gx2,) = torch.autograd.grad(RMSNorm(8, kernel="composite")(x2).pow(2).sum(), x2,
                                 create_graph=True)
    (ggx2,) = torch.autograd.grad(gx2.sum(), x2)
    torch.testing.assert_close(ggx, ggx2)


# ---- the switch ------------------------------------------------------------------------------


def test_auto_picks_the_kernel_on_cpu_for_every_covered_dtype(spy: Spy) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        RMSNorm(8, dtype=dtype)(torch.randn(2, 8, dtype=dtype))
    assert spy.calls["forward"] == 3
    RMSNorm(8, dtype=torch.float64)(torch.randn(2, 8, dtype=torch.float64))
    RMSNorm(1)(torch.randn(2, 1))
    LayerNorm(2)(torch.randn(2, 2))
    layer_norm(torch.randn(2, 8), 8, kernel="composite")
    assert spy.calls["forward"] == 3


def test_kernel_keyword_on_every_function_and_module(spy: Spy) -> None:
    x = torch.randn(3, 8)
    rms_norm(x, 8, kernel="cpu")
    partial_rms_norm(x, 8, 0.5, kernel="cpu")
    layer_norm(x, 8, kernel="cpu")
    normalize(x, NormSpec(), kernel="cpu")
    module = from_spec(NormSpec(kind="layer"), 8, kernel="cpu")
    module(x)
    assert spy.calls["forward"] == 5
    assert module.kernel == "cpu" and "kernel='cpu'" in repr(module)
    for fn in (rms_norm, partial_rms_norm, layer_norm, normalize, from_spec, RMSNorm,
               PartialRMSNorm, LayerNorm):
        parameter = inspect.signature(fn).parameters["kernel"]
        assert parameter.kind == inspect.Parameter.KEYWORD_ONLY and parameter.default == "auto"


def test_bad_kernel_names_and_unavailable_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"kernel='numba' is invalid: expected one of"):
        rms_norm(x, 8, kernel="numba")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kernel='fast' is invalid"):
        RMSNorm(8, kernel="fast")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"kernel='triton' runs on CUDA tensors \(or anywhere under TRITON_INTERPRET=1\); x is on cpu"):
        rms_norm(x, 8, kernel="triton")


def test_no_numba_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "NUMBA", False)
    monkeypatch.setitem(_plan._warned, "auto", False)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    module = RMSNorm(8)
    with pytest.warns(RuntimeWarning, match=r"numba is not installed.*normkit\[torch\]") as seen:
        y = module(x)
    assert seen[0].filename == __file__  # the user's call, not normkit's or torch's frames
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RMSNorm(8)(x)
    # RMSNorm(8) has torch's eps=None: float32's machine eps, which its spec records
    tolerances.assert_close(y.detach().numpy(), reference.normalize(x.numpy(), module.spec))
    with pytest.raises(RuntimeError, match=r"kernel='cpu' needs numba.*pip install 'normkit\[torch\]'"):
        rms_norm(x, 8, kernel="cpu")


@pytest.fixture
def broken_jit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """numba's module cannot be imported (as when numba is broken or fails to compile)."""
    monkeypatch.setitem(sys.modules, "normkit.torch.kernels._cpu_numba", None)
    monkeypatch.delattr(kernels, "_cpu_numba", raising=False)
    fresh: dict[str, Any] = {"module": None, "reason": None, "warned": False, "compiled": {}}
    monkeypatch.setattr(cpu, "_state", fresh)
    yield


def test_compile_failure_falls_back_with_one_warning(broken_jit: None) -> None:
    spec = NormSpec(kind="layer")
    x, dy = _arrays((3, 8), "bfloat16", 17)
    with pytest.warns(RuntimeWarning, match=r"CPU kernel is unavailable \(ModuleNotFoundError"):
        _check(spec, x, dy, None, None, "fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(spec, x, dy, None, None, "fallback again")


@pytest.mark.parametrize("spec", [NormSpec(), NormSpec(group_size=16, gate="after")],
                         ids=["plain", "gated"])
def test_cpu_tensors_under_another_default_device(spec: NormSpec) -> None:
    """Inside ``with torch.device("meta")`` (as when a model is built) a call on CPU tensors
    still runs the kernel on the CPU: its own buffers are made there, not on the default
    device."""
    x = torch.randn(4, 64, device="cpu", requires_grad=True)
    z = torch.randn(4, 64, device="cpu") if spec.gate else None
    weight = (1 + 0.1 * torch.randn(64, device="cpu")).requires_grad_(True)
    dy = torch.randn(4, 64, device="cpu")
    with torch.device("meta"):
        y = normalize(x, spec, weight, gate=z, kernel="cpu")
        y.backward(dy)
    assert y.device.type == "cpu" and x.grad is not None and weight.grad is not None
    xn, wn, dyn = (t.detach().double().numpy() for t in (x, weight, dy))
    if z is None:
        want_y = reference.normalize(xn, spec, wn)
        grads = reference.normalize_vjp(xn, dyn, spec, wn)
        dx, dw = grads.dx, grads.dscale
    else:
        zn = z.double().numpy()
        want_y = reference.gated_normalize(xn, zn, spec, wn)
        gated_grads = reference.gated_normalize_vjp(xn, zn, dyn, spec, wn)
        dx, dw = gated_grads.dx, gated_grads.dscale
    tolerances.assert_close(to_numpy(y), want_y, what="y")
    tolerances.assert_close(to_numpy(x.grad), dx, quantity="grad", what="dx")
    tolerances.assert_close(to_numpy(weight.grad), dw, quantity="grad", what="dweight")


def test_compile_failure_is_an_error_when_strict(broken_jit: None) -> None:
    with pytest.raises(RuntimeError, match=r"CPU kernel is unavailable \(ModuleNotFoundError"):
        cpu.norm_rows(torch.randn(2, 8), None, None, row_spec(NormSpec(eps=1e-6), 8),
                      strict=True)


def test_cache_goes_to_the_user_cache_folder_when_the_package_is_read_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """numba's locators: in-tree first; where that is not writable, the user-wide folder
    (XDG_CACHE_HOME here); NUMBA_CACHE_DIR, when set, wins."""
    from numba.core import caching

    from normkit.torch.kernels import _cpu_numba as jit

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(caching.config, "CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))

    def read_only(self: Any) -> None:
        raise PermissionError(f"read-only: {self.get_cache_path()}")

    monkeypatch.setattr(caching.InTreeCacheLocator, "ensure_cache_path", read_only)
    impl = caching.CompileResultCacheImpl(jit.forward.py_func)
    path = impl.locator.get_cache_path()
    assert isinstance(impl.locator, caching.UserWideCacheLocator)
    assert path.startswith(str(tmp_path / "user-cache" / "numba")), path
    assert os.path.isdir(path)


# ---- a machine where the kernel is not compiled yet --------------------------------------------


@pytest.fixture
def undecided(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> list[tuple[torch.dtype, bool]]:
    """A process that has not decided whether ``kernel="auto"`` runs the CPU kernel, on a
    machine whose cache (an empty folder) does not hold it, with background compiles recorded
    instead of started."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cpu.COMPILE, raising=False)
    monkeypatch.setitem(cpu._state, "ready", {})
    monkeypatch.setitem(cpu._state, "compiled", {})
    monkeypatch.setitem(cpu._state, "warned_cold", False)
    started: list[tuple[torch.dtype, bool]] = []
    monkeypatch.setattr(cpu, "_compile_in_background", lambda *key: started.append(key))
    return started


def _node(y: torch.Tensor) -> str:
    assert y.grad_fn is not None
    return type(y.grad_fn).__name__


def test_auto_takes_the_composite_path_until_the_kernel_is_compiled(
    undecided: list[tuple[torch.dtype, bool]],
) -> None:
    """No call waits for numba: where the kernel is not compiled, ``kernel="auto"`` runs the
    composite path (the kernel compiled by a process of its own) and keeps it for the whole
    process, even once the cache holds the kernel (a layer's bits do not change mid-run); a new
    decision (a new process) then loads the kernel. One warning in the process, of a category
    of its own, one line naming the command that avoids it, pointing at the user's call."""
    x = torch.randn(3, 64, requires_grad=True)
    with pytest.warns(cpu.KernelNotCompiledWarning) as seen:
        y = RMSNorm(64)(x)
    assert len(seen) == 1 and issubclass(cpu.KernelNotCompiledWarning, RuntimeWarning)
    message = str(seen[0].message)
    assert "\n" not in message and "composite path" in message and "`normkit warmup`" in message
    assert seen[0].filename == __file__
    assert _node(y) == "NormFunctionBackward"
    assert undecided == [(torch.float32, False)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _node(LayerNorm(64)(x)) == "FusedNormBackward"  # decided: no warning
        assert _node(RMSNorm(64)(x.bfloat16())) == "NormFunctionBackward"  # warned once only
    assert undecided == [(torch.float32, False), (torch.bfloat16, False)]
    cpu.load(torch.float32)  # compiled (marked) meanwhile, as the background process would
    assert os.path.exists(cpu._mark(torch.float32, False))
    assert _node(RMSNorm(64)(x)) == "NormFunctionBackward"
    cpu._state["ready"].clear()  # a process that starts now
    assert _node(RMSNorm(64)(x)) == "CpuNormFunctionBackward"
    assert _node(RMSNorm(64, kernel="cpu")(x.bfloat16())) == "CpuNormFunctionBackward"


def test_a_marked_cache_or_compile_wait_runs_the_kernel_from_the_first_call(
    undecided: list[tuple[torch.dtype, bool]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(3, 64, requires_grad=True)
    cpu._mark_compiled(torch.float32, False)  # what a compile leaves in the cache folder
    assert _node(RMSNorm(64)(x)) == "CpuNormFunctionBackward"
    monkeypatch.setenv(cpu.COMPILE, "wait")
    assert _node(RMSNorm(64)(x.bfloat16())) == "CpuNormFunctionBackward"
    assert undecided == []


def test_warmup_compiles_now_for_this_process_and_the_next(
    undecided: list[tuple[torch.dtype, bool]], tmp_path: Any,
) -> None:
    from normkit.torch import warmup

    warmup(["float32"], gated=False)
    assert os.path.exists(cpu._mark(torch.float32, False))
    x = torch.randn(3, 64, requires_grad=True)
    assert _node(RMSNorm(64)(x)) == "CpuNormFunctionBackward"
    with pytest.raises(ValueError, match=r"unknown dtype names \['half'\]"):
        warmup(["half"])
    assert undecided == []


def test_the_background_compile_starts_once_and_leaves_its_lock(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
) -> None:
    """`_compile_in_background` starts ``python -m normkit.torch.warmup --background`` for the
    kernels' family, with a lock file the process removes; a second start while it runs (the
    lock fresh) starts nothing."""
    import subprocess

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    started: list[list[str]] = []
    monkeypatch.setattr(subprocess, "Popen", lambda command, **kwargs: started.append(command))
    cpu._compile_in_background(torch.bfloat16, True)
    cpu._compile_in_background(torch.bfloat16, True)
    assert len(started) == 1
    command = started[0]
    assert command[1:5] == ["-m", "normkit.torch.warmup", "--background", "--lock"]
    assert command[-4:] == ["--dtype", "bfloat16", "--family", "gated"]
    assert os.path.exists(command[5])


def test_the_warmup_command_compiles_and_removes_its_lock(tmp_path: Any) -> None:
    module = importlib.import_module("normkit.torch.warmup")  # the module, not the function
    lock = tmp_path / "lock"
    lock.write_text("1\n")
    assert module.main(["--dtype", "float32", "--family", "plain", "--lock", str(lock)]) == 0
    assert not lock.exists()


def test_normkit_warmup_says_what_it_compiled_and_what_it_loaded(
    undecided: list[tuple[torch.dtype, bool]], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``normkit warmup``: the cache folder, then per dtype and family whether the kernels were
    compiled (announced first: it takes seconds) or loaded from the cache, and in how long;
    a bad dtype is a usage error; without numba it says so, naming the extra, and fails."""
    import re

    from normkit import cli

    assert cli.main(["warmup", "--dtype", "float32", "--no-gated"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("normkit's CPU kernel (numba), cached in ")
    assert lines[1] == "float32: compiling (once per machine: 10-30 s)"
    assert re.fullmatch(r"float32: compiled in \d+\.\d s", lines[2]), lines
    assert os.path.exists(cpu._mark(torch.float32, False))
    assert cli.main(["warmup", "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"float32: loaded from the cache in \d+\.\d s", lines[1]), lines
    assert lines[2:4] == ["float32, gated and grouped norms: compiling (once per machine: "
                          "10-30 s)", lines[3]] and "compiled in" in lines[3]
    assert cli.main(["warmup", "--dtype", "half"]) == 2
    assert "normkit warmup: error: unknown dtype names ['half']" in capsys.readouterr().err
    monkeypatch.setattr(kernels, "NUMBA", False)
    assert cli.main(["warmup"]) == 1
    assert "numba is not installed" in capsys.readouterr().out
    assert undecided == []


def test_the_harness_compiles_the_kernel_before_it_measures_or_checks(
    undecided: list[tuple[torch.dtype, bool]],
) -> None:
    """On a machine that has not compiled the kernel, the benchmark's and conformance's torch
    workers must not time or check the composite path in its place: their environment has
    ``NORMKIT_CPU_COMPILE=wait``, and the benchmark compiles first and says so in its
    versions."""
    from normkit import backends
    from normkit.bench import torch as bench

    assert backends.get("torch").env[cpu.COMPILE] == "wait"
    bench.cpu_kernel.cache_clear()
    try:
        assert re.fullmatch(r"compiled by this run \(\d+ s\)", bench.versions()["CPU kernel"])
        assert _node(RMSNorm(64)(torch.randn(3, 64, requires_grad=True))) == (
            "CpuNormFunctionBackward")
        bench.cpu_kernel.cache_clear()
        assert bench.cpu_kernel() == "compiled (cached)"
    finally:
        bench.cpu_kernel.cache_clear()
    assert undecided == []
