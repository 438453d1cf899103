"""Where the Triton kernels' time goes on a GPU: the kernels alone at each launch
configuration against the copy floor, the layers against torch's own, and the host cost per
call.

python3 scripts/triton_sweep.py [--out FILE] [--only PARTS]   (a CUDA GPU; one JSON line per
figure; PARTS among calls,host,profile,layers,kernels)

``calls`` (first) times what a user's call costs the host, microseconds per call, forward and
forward+backward, normkit's layers beside torch's: at one token (1 x 4096) with a sync after
the calls, and at the large shapes as the time to issue calls back to back (the GPU still busy
with them).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from functools import partial
from typing import Any

import torch
import triton
from triton.testing import do_bench

from normkit import NormSpec
from normkit.torch import LayerNorm, RMSNorm
from normkit.torch._spec import encode, row_spec
from normkit.torch.kernels import triton as nk

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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="triton-sweep.jsonl")
    parser.add_argument("--only", default="calls,host,profile,layers,kernels")
    args = parser.parse_args()
    log = Log(args.out)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    log(gpu=torch.cuda.get_device_name(), sms=sms, torch=torch.__version__,
        triton=triton.__version__)
    for part in args.only.split(","):
        started = time.perf_counter()
        parts = {"calls": calls, "host": host, "profile": profile, "layers": layers,
                 "kernels": lambda log: kernels(log, sms)}
        parts[part](log)
        log(part=part, seconds=round(time.perf_counter() - started, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
