"""Where the Triton kernels' time goes on a GPU: the kernels alone at each launch
configuration against the copy floor, the layers against torch's own, the host cost per
call, and the fused backward (NORMKIT_TRITON_BACKWARD=fused) beside the default one.

python3 scripts/triton_sweep.py [--out FILE] [--only PARTS]   (a CUDA GPU; one JSON line per
figure; PARTS among backward,calls,host,profile,layers,kernels)

``calls`` (first) times what a user's call costs the host, microseconds per call, forward and
forward+backward, normkit's layers beside torch's: at one token (1 x 4096) with a sync after
the calls, and at the large shapes as the time to issue calls back to back (the GPU still busy
with them).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import Any

import torch
import triton
from triton.testing import do_bench

from normkit import NormSpec, reference, tolerances
from normkit.torch import LayerNorm, RMSNorm
from normkit.torch._spec import encode, row_spec
from normkit.torch.kernels import triton as nk
from normkit.torch.kernels import triton_backward as fused

ELEMENTS = 32 * 2**20
EPS = 1e-6


class Log:
    def __init__(self, path: str) -> None:
        self.file = open(path, "w")

    def __call__(self, **record: Any) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def timed(log: Log, fn: Any, **record: Any) -> None:
    grads = record.pop("grads", None)
    try:
        log(**record, ms=do_bench(fn, grad_to_none=grads))
    except Exception as error:  # a configuration out of resources
        log(**record, error=str(error)[:200])


def forward_launch(x, w, y, r, layer, single, block, warps):
    rows, n = x.shape
    nk._forward_kernel[(rows,)](
        x, x, x, w, w, y, y, r, n, n, 1, EPS, 0.0, LAYER=layer, OUTSIDE=False, HAS_W=True,
        HAS_B=layer, BEFORE_SCALE=False, RESIDUAL=0, GROUPED=False, GATE_IN="none",
        GATE_OUT="none", ROUND_AFFINE=False, SINGLE=single, BLOCK=block, num_warps=warps,
    )


def backward_launch(x, w, r, dy, dx, parts, layer, single, block, warps):
    rows, n = x.shape
    nk._backward_kernel[(parts.shape[0],)](
        x, x, x, r, dy, dy, w, w, dx, dx, parts, parts, rows, n, n, 1, EPS, 0.0, LAYER=layer,
        OUTSIDE=False, HAS_W=True, HAS_B=layer, NEED_DW=True, NEED_DB=layer, HAS_DH=False,
        RESIDUAL=0, GROUPED=False, GATE_IN="none", GATE_OUT="none", SINGLE=single, BLOCK=block,
        num_warps=warps,
    )


def forward_backward(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    module(x).backward(dy)


def host_cost(fn, calls=300) -> float:
    """Microseconds per call on the host, on an input too small to keep the GPU busy."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def kernels(log: Log, sms: int) -> None:
    dtype = torch.bfloat16
    for n in (1024, 4096, 8192, 16384):
        rows = ELEMENTS // n
        x = torch.randn(rows, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=dtype)
        dy, y, dx = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
        r = torch.empty(rows, device="cuda", dtype=torch.float32)
        case = dict(dtype="bfloat16", n=n)
        timed(log, x.clone, **case, what="copy")
        block = triton.next_power_of_2(n)
        for layer in (False, True):
            kind = "layer" if layer else "rms"
            for warps in (2, 4, 8, 16):
                timed(log, partial(forward_launch, x, w, y, r, layer, True, block, warps),
                      **case, what=f"{kind} forward", warps=warps)
            forward_launch(x, w, y, r, layer, True, block, 8)
            configs = [(True, block, warps, 4) for warps in (4, 8, 16, 32)
                       if 1 <= block // (32 * warps) <= 64]
            if n >= 4096:
                configs += [(False, b, warps, 4) for b, warps in
                            ((2048, 4), (2048, 8), (4096, 8), (4096, 16))]
            for single, b, warps, per_sm in configs:
                programs = max(1, min(rows // 2, per_sm * sms))
                parts = torch.zeros(programs, n, device="cuda", dtype=torch.float32)
                timed(log, partial(backward_launch, x, w, r, dy, dx, parts, layer, single, b,
                                   warps),
                      **case, what=f"{kind} backward", single=single, block=b, warps=warps,
                      per_sm=per_sm)


def layers(log: Log) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1024, 4096, 16384):
            rows = ELEMENTS // n
            x = torch.randn(rows, n, device="cuda", dtype=dtype, requires_grad=True)
            dy = torch.randn_like(x)
            case = dict(dtype=str(dtype).removeprefix("torch."), n=n)
            timed(log, x.clone, **case, what="copy")
            candidates = {
                "torch.nn.RMSNorm": torch.nn.RMSNorm(n, EPS),
                "torch.nn.LayerNorm": torch.nn.LayerNorm(n, EPS),
                "normkit RMSNorm triton": RMSNorm(n, EPS, kernel="triton"),
                "normkit LayerNorm triton": LayerNorm(n, EPS, kernel="triton"),
                "normkit RMSNorm auto": RMSNorm(n, EPS),
            }
            for name, module in candidates.items():
                module.to(device="cuda", dtype=dtype)
                with torch.no_grad():
                    timed(log, partial(module, x), **case, what=f"{name} forward")
                timed(log, partial(forward_backward, module, x, dy), **case,
                      what=f"{name} fwd+bwd", grads=[x, *module.parameters()])


def issue_cost(fn, calls: int) -> float:
    """Microseconds per call on the host to issue ``calls`` calls back to back (no sync
    between them; the GPU may still be running them when the last returns)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / calls * 1e6


def calls(log: Log) -> None:
    """Host microseconds per call of the layers, normkit's beside torch's, forward (no_grad)
    and forward+backward: one token, then the large shapes (`issue_cost`); the Triton
    kernels launched directly (`nk.DIRECT_LAUNCH`, reported) and, for comparison, through
    ``JITFunction.run``."""
    # the direct launch is opt-in until it has run on a GPU: measured with it, and without it
    nk.DIRECT_LAUNCH = nk._direct_launch_supported()
    log(what="direct launch", enabled=nk.DIRECT_LAUNCH, triton=triton.__version__)
    for dtype in (torch.bfloat16, torch.float32):
        for rows, n, count in ((1, 4096, 300), (8192, 4096, 20), (2048, 16384, 20)):
            x = torch.randn(rows, n, device="cuda", dtype=dtype)
            xg = x.clone().requires_grad_()
            dy = torch.randn_like(x)
            case = dict(dtype=str(dtype).removeprefix("torch."), rows=rows, n=n)
            candidates = {
                "torch.nn.RMSNorm": torch.nn.RMSNorm(n, EPS),
                "torch.nn.LayerNorm": torch.nn.LayerNorm(n, EPS),
                "normkit RMSNorm": RMSNorm(n, EPS),
                "normkit LayerNorm": LayerNorm(n, EPS),
                "normkit RMSNorm composite": RMSNorm(n, EPS, kernel="composite"),
            }
            for name, module in candidates.items():
                module.to(device="cuda", dtype=dtype)

                def forward(module=module, x=x):
                    with torch.no_grad():
                        module(x)

                timer = host_cost if rows == 1 else partial(issue_cost, calls=count)
                measure = {"forward": forward,
                           "fwd+bwd": partial(forward_backward, module, xg, dy)}
                for kind, fn in measure.items():
                    log(what="host per call", layer=name, phase=kind, **case, us=timer(fn))
            if rows == 1 and nk.DIRECT_LAUNCH:  # the same calls through JITFunction.run
                module = RMSNorm(n, EPS).to(device="cuda", dtype=dtype)
                nk.DIRECT_LAUNCH = False
                try:
                    with torch.no_grad():
                        log(what="host per call", layer="normkit RMSNorm, JITFunction.run",
                            phase="forward", **case, us=host_cost(partial(module, x)))
                    log(what="host per call", layer="normkit RMSNorm, JITFunction.run",
                        phase="fwd+bwd", **case,
                        us=host_cost(partial(forward_backward, module, xg, dy)))
                finally:
                    nk.DIRECT_LAUNCH = True


def host(log: Log) -> None:
    small = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    y, r = torch.empty_like(small), torch.empty(8, device="cuda", dtype=torch.float32)
    module = RMSNorm(1024, EPS, kernel="triton").to(device="cuda", dtype=torch.bfloat16)
    theirs = torch.nn.RMSNorm(1024, EPS).to(device="cuda", dtype=torch.bfloat16)
    grad = small.clone().requires_grad_()
    for what, fn in (
        ("kernel launch", lambda: forward_launch(small, w, y, r, False, True, 1024, 4)),
        ("norm_rows", lambda: nk.norm_rows(small, w, None, row_spec(NormSpec(eps=EPS), 1024))),
        ("normkit RMSNorm(kernel='triton')", lambda: module(small)),
        ("normkit RMSNorm(kernel='triton') requires_grad", lambda: module(grad)),
        ("normkit RMSNorm(kernel='triton') fwd+bwd", partial(forward_backward, module, grad, y)),
        ("torch.nn.RMSNorm fwd+bwd", partial(forward_backward, theirs, grad, y)),
        ("torch rms_norm", lambda: torch.nn.functional.rms_norm(small, (1024,), w, EPS)),
        ("clone", lambda: small.clone()),
    ):
        log(what=f"host {what}", us=host_cost(fn))
    backward_parts(log, module, small, w, grad, y)


def backward_parts(log: Log, module: torch.nn.Module, small: torch.Tensor, w: torch.Tensor,
                   grad: torch.Tensor, dy: torch.Tensor) -> None:
    """The host cost of a forward+backward's pieces: the backward's launches called from this
    thread, its buffers, the autograd engine with and without its device thread, the backward
    without its launches, the custom op's autograd, and a Python autograd.Function that
    launches nothing backward."""
    rows, n = small.shape
    r = torch.ones(rows, device=small.device, dtype=torch.float32)
    programs = nk._programs(small, rows, 1)
    backward_rows = partial(nk._backward_rows, small, None, None, r, dy, None, w, None, None,
                            "rms", n, EPS, False, 0.0, n, "none", "none", 0, small.dtype, True,
                            False)

    def calling_thread() -> None:
        with torch.autograd.set_multithreading_enabled(False):
            forward_backward(module, grad, dy)

    outputs, launching = backward_rows(), nk._backward_rows

    def without_backward_launches() -> None:
        nk._backward_rows = lambda *args: outputs
        try:
            forward_backward(module, grad, dy)
        finally:
            nk._backward_rows = launching

    spec = encode(row_spec(NormSpec(eps=EPS), n))
    weight = next(module.parameters())

    for what, fn in (
        ("_backward_rows (dx, dw) from this thread", backward_rows),
        ("_programs", lambda: nk._programs(small, rows, 1)),
        ("torch.zeros of the dw parts", lambda: torch.zeros(programs, n, device=small.device)),
        ("torch.empty of the dw parts", lambda: torch.empty(programs, n, device=small.device)),
        ("normkit RMSNorm(kernel='triton') forward with grad, then torch.autograd.grad",
         lambda: torch.autograd.grad(module(grad), [grad, *module.parameters()], dy)),
        ("normkit RMSNorm(kernel='triton') fwd+bwd, backward on this thread", calling_thread),
        ("normkit RMSNorm(kernel='triton') fwd+bwd, the backward's results made once",
         without_backward_launches),
        ("the custom op (torch.library) fwd+bwd",
         lambda: nk._norm_rows_op(grad, None, None, weight, None, spec, False)[0].backward(dy)),
        ("autograd.Function clone fwd+bwd", lambda: _Clone.apply(grad).backward(dy)),
    ):
        log(what=f"host {what}", us=host_cost(fn))
    for what, fn in (
        ("_backward_rows (dx, dw)", backward_rows),
        ("torch.zeros of the dw parts", lambda: torch.zeros(programs, n, device=small.device)),
    ):
        log(what=f"host {what} from another Python thread", us=on_another_thread(fn))


def on_another_thread(fn) -> float:
    """`host_cost` of ``fn`` measured on a fresh Python thread while this one waits: whether a
    thread other than the main one (as autograd's device thread is) makes the same calls
    slower."""
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(host_cost(fn)))
    worker.start()
    worker.join()
    return result[0]


class _Clone(torch.autograd.Function):
    """One copy forward, nothing launched backward: what autograd adds around a Python
    backward on CUDA."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
        return dy


def profile(log: Log) -> None:
    """Where an eager forward+backward spends its time, host and device (torch.profiler)."""
    n = 4096
    x = torch.randn(ELEMENTS // n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    for name, module in (("normkit RMSNorm triton", RMSNorm(n, EPS, kernel="triton")),
                         ("torch.nn.RMSNorm", torch.nn.RMSNorm(n, EPS))):
        module.to(device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            forward_backward(module, x, dy)
        torch.cuda.synchronize()
        with torch.profiler.profile() as prof:
            for _ in range(10):
                forward_backward(module, x, dy)
            torch.cuda.synchronize()
        log(what=f"profile {name} fwd+bwd x10",
            table=prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


# The fused backward (normkit.torch.kernels.triton_backward) beside the default one: the bench's
# three large shapes, float32 and bfloat16, RMSNorm and LayerNorm (with a bias), in throughput
# mode (BACKWARD_CALLS back-to-back calls between two CUDA events), in latency mode (a sync
# after each call; the median) and by do_bench (the kernels' time), against the copy floor; and
# the fused one's dx, dw and db checked against the default's and the reference's.

BACKWARD_SHAPES = ((ELEMENTS // 1024, 1024), (ELEMENTS // 4096, 4096), (ELEMENTS // 16384, 16384))
BACKWARD_DTYPES = (torch.bfloat16, torch.float32)
BACKWARD_CALLS = 50
LATENCY_CALLS = 20
REFERENCE_ROWS = 32
#: Rows for compiling every variant in worker processes first: enough that the partial sums
#: take as many programs as at the large shapes (the sums kernel's blocks depend on it).
WARM_ROWS = 2304


def _backward_variants(n: int, dtype: torch.dtype) -> list[tuple[str, fused.Config | None]]:
    """The fused backward's default configuration, and the alternatives its choice rests on:
    for bfloat16 no prefetch and the other occupancy (8 or 16 warps a multiprocessor); where a
    row is cut in two slices (16384), slices of half that size, and for float32 there no
    prefetch either (its registers spill)."""
    default = fused.config(n, dtype.itemsize)
    variants: list[tuple[str, fused.Config | None]] = [("fused", None)]
    if dtype == torch.bfloat16 or default.split == 2:
        variants.append(("fused, no prefetch", default._replace(prefetch=False)))
    warps = default.per_sm * default.num_warps
    other = default.per_sm * 2 if warps <= 8 else default.per_sm // 2
    if dtype == torch.bfloat16 and other >= 1:
        variants.append((f"fused, {other} programs a multiprocessor",
                         default._replace(per_sm=other)))
    if default.split == 2:
        variants.append(("fused, slices of half",
                         fused.config(n, dtype.itemsize, slice_max=default.slice // 2)))
    return variants


def _backward_inputs(kind: str, rows: int, n: int, dtype: torch.dtype,
                     device: str) -> dict[str, Any]:
    """x, dy, the parameters in x's dtype (a bias for LayerNorm), the saved r(s) (computed in
    float64), and the backward's arguments (`triton._backward_rows`')."""
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(rows, n, device=device, dtype=dtype, generator=gen)
    dy = torch.randn(rows, n, device=device, dtype=dtype, generator=gen)
    w = (1 + 0.1 * torch.randn(n, device=device, generator=gen)).to(dtype)
    b = (0.1 * torch.randn(n, device=device, generator=gen)).to(dtype) if kind == "layer" else None
    r = torch.rsqrt(_centered(kind, x.double()).square().mean(dim=1) + EPS).float()
    args = (x, None, None, r, dy, None, w, None, None if b is None else b.dtype, kind, n, EPS,
            False, 0.0, n, "none", "none", 0, dtype, True, True)
    return {"x": x, "dy": dy, "w": w, "b": b, "args": args}


def _centered(kind: str, x: torch.Tensor) -> torch.Tensor:
    """x less its row means for LayerNorm, else x."""
    return x - x.mean(dim=1, keepdim=True) if kind == "layer" else x


def _default_backward(args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """The default backward, whatever NORMKIT_TRITON_BACKWARD says."""
    selected, fused.FUSED = fused.FUSED, False
    try:
        return nk._backward_rows(*args)
    finally:
        fused.FUSED = selected


def _warm_backward(cases: list[tuple[str, int, str, str]], device: str = "cuda",
                   rows: int = WARM_ROWS) -> float:
    """Compile (into Triton's cache) what `backward` launches for ``cases`` (kind, n, dtype,
    variant label), on ``rows`` rows; run in a worker process."""
    started = time.perf_counter()
    for kind, n, dtype_name, label in cases:
        dtype = getattr(torch, dtype_name)
        inputs = _backward_inputs(kind, rows, n, dtype, device)
        _default_backward(inputs["args"])
        chosen = dict(_backward_variants(n, dtype))[label]
        fused.backward_rows(*inputs["args"], launch_config=chosen)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _throughput_us(fn: Any, calls: int, device: str) -> float:
    """Microseconds per call over ``calls`` back-to-back calls between two syncs (CUDA events
    on a GPU)."""
    fn()
    if device != "cuda":
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - started) / calls * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def _latency_us(fn: Any, calls: int, device: str) -> float:
    """The median microseconds of a call followed by a sync."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(calls):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The unit in the last place of ``dtype`` at |t| (t in float32 or float64)."""
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    exponent = torch.frexp(t.abs().clamp_min(torch.finfo(dtype).tiny))[1]
    return torch.ldexp(torch.ones_like(t), exponent - bits)


def _backward_checks(kind: str, inputs: dict[str, Any], default: tuple[torch.Tensor, ...],
                     first: tuple[torch.Tensor, ...], again: tuple[torch.Tensor, ...]
                     ) -> dict[str, Any]:
    """The fused backward's dx, dw and db: the same bits twice; within twice normkit's
    tolerance of the default's (dx: 4 ulps of a half dtype, or 2e-5 max|dx| in float32); dw
    and db within the reordering of their float32 sums (2 rows 2**-24 sum |term|, plus an ulp
    of the rounding); dx of REFERENCE_ROWS rows against normkit.reference."""
    x, dy, w, b = inputs["x"], inputs["dy"], inputs["w"], inputs["b"]
    rows, n = x.shape
    dtype = x.dtype
    found: dict[str, Any] = {
        "bit_identical": all(torch.equal(p, q) for p, q in zip(first, again, strict=True))}
    dx_new, dx_old = first[0].double(), default[0].double()
    gap = (dx_new - dx_old).abs()
    if dtype == torch.float32:
        dx_bound = 2 * tolerances.GRAD_REL * dx_old.abs().max()
    else:
        floor = tolerances.ULP_FLOOR * dx_old.abs().amax(dim=1, keepdim=True)
        dx_bound = 2 * tolerances.GRAD_ULPS * _ulp(torch.maximum(dx_old.abs(), floor), dtype)
    found["dx_vs_default"] = float((gap / dx_bound).max())
    centered, dyf = _centered(kind, x.double()), dy.double()
    y_hat = centered * torch.rsqrt(centered.square().mean(dim=1, keepdim=True) + EPS)
    for name, index, terms, out_dtype in (("dw", 2, dyf * y_hat, w.dtype),
                                          ("db", 3, dyf, None if b is None else b.dtype)):
        if out_dtype is None:
            continue
        old, new = default[index].double(), first[index].double()
        bound = 2 * rows * 2.0**-24 * terms.abs().sum(dim=0) + _ulp(old, out_dtype)
        found[f"{name}_vs_default"] = float(((new - old).abs() / bound).max())
    sample = torch.linspace(0, rows - 1, REFERENCE_ROWS, device=x.device).long()
    spec = NormSpec(kind, eps=EPS, bias=kind == "layer")
    to_np = lambda t: t.float().cpu().numpy()  # noqa: E731
    want = reference.normalize_vjp(to_np(x[sample]), to_np(dy[sample]), spec, to_np(w),
                                   None if b is None else to_np(b))[0]
    measured = tolerances.measure(to_np(first[0][sample]), want, dtype=str(dtype)[6:],
                                  quantity="grad")
    found["dx_vs_reference"] = measured.error / measured.bound.value
    found["passed"] = (found["bit_identical"] and measured.passed
                       and all(v <= 1.0 for k, v in found.items() if k.endswith("_vs_default")))
    return found


def _compiled_kernels() -> list[dict[str, Any]]:
    """Registers, spills and warps of each fused backward kernel compiled (best effort: Triton's
    cache of compiled kernels is internal)."""
    found = []
    for cache in getattr(fused._backward_kernel, "device_caches", {}).values():
        for kernel in (cache[0] if isinstance(cache, tuple) else cache).values():
            metadata = getattr(kernel, "metadata", None)
            found.append({
                "registers": getattr(kernel, "n_regs", None),
                "spills": getattr(kernel, "n_spills", None),
                "warps": getattr(metadata, "num_warps", None),
                "shared": getattr(metadata, "shared", None),
                "constants": str(getattr(getattr(kernel, "src", None), "constants", ""))[:400],
            })
    return found


def backward(log: Log, device: str = "cuda", shapes: tuple[tuple[int, int], ...] = BACKWARD_SHAPES,
             dtypes: tuple[torch.dtype, ...] = BACKWARD_DTYPES, kinds: tuple[str, ...] = (
                 "rms", "layer"), calls: int = BACKWARD_CALLS, latency_calls: int = LATENCY_CALLS,
             workers: int | None = None) -> None:
    """The fused backward beside the default one (see the section's comment); one record per
    implementation and case, one check per case, and a summary. ``workers``: processes that
    compile every variant first (default: the CPU count, at most 12; 0: none). An error is
    logged and the rest still runs. The defaults are the GPU run's; a test runs it on a CPU
    tensor in Triton's interpreter."""
    cases = [(kind, rows, n, dtype) for rows, n in shapes for dtype in dtypes for kind in kinds]
    workers = min(12, os.cpu_count() or 1) if workers is None else workers
    if workers:
        _warm_in_workers(log, cases, workers, device, WARM_ROWS if device == "cuda"
                         else shapes[0][0])
    summary = []
    for kind, rows, n, dtype in cases:
        case = dict(kind=kind, n=n, rows=rows, dtype=str(dtype)[6:])
        timings = _backward_case(log, case, _backward_inputs(kind, rows, n, dtype, device),
                                 calls, latency_calls, device)
        if "fused" in timings and "default" in timings:
            summary.append(dict(**case, fused_of_floor=round(timings["fused"]["of_floor"], 3),
                                default_of_floor=round(timings["default"]["of_floor"], 3),
                                speedup=round(timings["default"]["throughput_us"]
                                              / timings["fused"]["throughput_us"], 3)))
    try:
        log(what="backward kernels", kernels=_compiled_kernels())
    except Exception as error:
        log(what="backward kernels", error=str(error)[:500])
    log(what="backward summary", cases=summary)


def _warm_in_workers(log: Log, cases: list[tuple[str, int, int, torch.dtype]], workers: int,
                     device: str, rows: int) -> None:
    """Every variant of ``cases`` compiled into Triton's cache by ``workers`` processes, a
    case's variants in one of them."""
    started = time.perf_counter()
    per_case = [[(kind, n, str(dtype)[6:], label) for label, _ in _backward_variants(n, dtype)]
                for kind, _, n, dtype in cases]
    shares = [sum(per_case[i::workers], []) for i in range(min(workers, len(per_case)))]
    try:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(len(shares), mp_context=context) as pool:
            busy = list(pool.map(partial(_warm_backward, device=device, rows=rows), shares))
    except Exception as error:  # compiled in this process instead, as each case runs
        log(what="backward compile", error=str(error)[:500])
        return
    log(what="backward compile", variants=sum(map(len, shares)), workers=len(shares),
        seconds=round(time.perf_counter() - started, 1), busiest_worker_s=round(max(busy), 1))


def _backward_case(log: Log, case: dict[str, Any], inputs: dict[str, Any], calls: int,
                   latency_calls: int, device: str) -> dict[str, dict[str, float]]:
    """The copy floor, the check and each implementation's figures for one case."""
    x, args = inputs["x"], inputs["args"]
    copy_us = _throughput_us(x.clone, calls, device)
    # x and dy read, dx written, w read (dw and db written): against a copy's read and write
    moved = 3 * x.numel() * x.element_size() + 3 * x.shape[1] * x.element_size()
    floor_us = copy_us * moved / (2 * x.numel() * x.element_size())
    log(what="backward copy floor", **case, copy_us=round(copy_us, 2), floor_us=round(floor_us, 2))
    try:
        default = _default_backward(args)
        first, again = fused.backward_rows(*args), fused.backward_rows(*args)
        log(what="backward check", **case,
            **_backward_checks(case["kind"], inputs, default, first, again))
    except Exception as error:
        log(what="backward check", **case, passed=False, error=str(error)[:500])
    implementations = [("default", partial(_default_backward, args))]
    implementations += [(label, partial(fused.backward_rows, *args, launch_config=chosen))
                        for label, chosen in _backward_variants(x.shape[1], x.dtype)]
    timings = {}
    for label, fn in implementations:
        try:
            figures = {"throughput_us": _throughput_us(fn, calls, device)}
            if label in ("default", "fused"):
                figures["latency_us"] = _latency_us(fn, latency_calls, device)
                if device == "cuda":
                    figures["device_us"] = do_bench(fn, warmup=10, rep=40) * 1e3
        except Exception as error:
            log(what="backward", impl=label, **case, error=str(error)[:500])
            continue
        figures["of_floor"] = floor_us / figures["throughput_us"]
        timings[label] = figures
        log(what="backward", impl=label, **case, **{k: round(v, 3) for k, v in figures.items()})
    return timings

def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="triton-sweep.jsonl")
    parser.add_argument("--only", default="backward,calls,host,profile,layers,kernels")
    args = parser.parse_args()
    log = Log(args.out)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    log(gpu=torch.cuda.get_device_name(), sms=sms, torch=torch.__version__,
        triton=triton.__version__)
    for part in args.only.split(","):
        started = time.perf_counter()
        parts = {"calls": calls, "host": host, "profile": profile, "layers": layers,
                 "kernels": lambda log: kernels(log, sms), "backward": backward}
        parts[part](log)
        log(part=part, seconds=round(time.perf_counter() - started, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
