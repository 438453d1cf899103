"""Runs Hugging Face's LlamaRMSNorm and normkit.torch's RMSNorm with backward="autograd" on the
same inputs and writes both results to an .npz file (argv[1]), as float64 arrays.

A separate process: transformers imports triton, whose LLVM clashes with TensorFlow's when
TensorFlow was imported first, as it is in a test session that collected the Keras tests.
"""

import sys

import numpy as np
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import normkit.torch as nt

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CASES = [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float16", "float16"),
         ("float16", "float32")]


def run(module, x, dy, residual=None, dh=None):
    """Outputs and gradients of ``module`` on x (and a residual added as model code adds it)."""
    x = x.clone().requires_grad_()
    if residual is None:
        y = module(x)
        y.backward(dy.to(y.dtype))
        return {"y": y, "dx": x.grad, "dw": module.weight.grad}
    residual = residual.clone().requires_grad_()
    if isinstance(module, LlamaRMSNorm):
        h = x + residual
        y = module(h)
    else:
        y, h = module(x, residual)
    torch.autograd.backward([y, h], [dy.to(y.dtype), dh.to(h.dtype)])
    return {"y": y, "h": h, "dx": x.grad, "dres": residual.grad, "dw": module.weight.grad}


def case(half, weight, seed, with_residual, rows=16, n=256):
    torch.manual_seed(seed)
    w = (torch.randn(n) * 0.5 + 1).to(DTYPES[weight])
    x = (torch.randn(rows, n) * (1 + seed)).to(DTYPES[half])
    dy = torch.randn(rows, n)
    residual = torch.randn(rows, n).to(DTYPES[half]) if with_residual else None
    dh = torch.randn(rows, n) if with_residual else None
    options = dict(cast="before_scale", output_dtype="promote", dtype=DTYPES[weight],
                   residual="rounded" if with_residual else None)
    modules = {
        "hf": LlamaRMSNorm(n, eps=1e-6).to(DTYPES[weight]),
        "autograd": nt.RMSNorm(n, 1e-6, backward="autograd", **options),
        "exact": nt.RMSNorm(n, 1e-6, **options),
    }
    tag = f"{half}/{weight}/{seed}/{'residual' if with_residual else 'plain'}"
    out = {}
    for name, module in modules.items():
        with torch.no_grad():
            module.weight.copy_(w)
        results = run(module, x, dy, residual, dh)
        for key, t in results.items():
            out[f"{tag}/{name}/{key}"] = t.detach().double().numpy()
            out[f"{tag}/{name}/{key}.dtype"] = np.array(str(t.dtype))
    return out


def main(path):
    out = {}
    for half, weight in CASES:
        for seed in (0, 1):
            out.update(case(half, weight, seed, with_residual=False))
        out.update(case(half, weight, 2, with_residual=True))
    np.savez(path, **out)


if __name__ == "__main__":
    main(sys.argv[1])
