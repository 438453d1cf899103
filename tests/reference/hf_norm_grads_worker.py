"""Runs Hugging Face's LlamaRMSNorm and GemmaRMSNorm forward and backward in torch and writes
every array to an .npz file (argv[1]), float32/float64 holding the half-precision values.

A separate process: transformers imports triton, whose LLVM clashes with TensorFlow's when
TensorFlow was imported first, as it is in a test session that collected the Keras tests.
"""

import sys

import numpy as np
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

HALVES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def arrays(prefix, **tensors):
    return {f"{prefix}/{k}": t.detach().double().numpy() for k, t in tensors.items()}


def llama(half, weight, seed, rows=16, n=256):
    torch.manual_seed(seed)
    module = LlamaRMSNorm(n, eps=1e-6).to(HALVES[weight])
    with torch.no_grad():
        module.weight.copy_(torch.randn(n) * 0.5 + 1)
    x = (torch.randn(rows, n) * (1 + seed)).to(HALVES[half]).requires_grad_()
    y = module(x)
    dy = torch.randn(rows, n).to(y.dtype)
    y.backward(dy)
    tag = f"llama/{half}/{weight}/{seed}"
    return arrays(
        tag, x=x, w=module.weight, y=y, dy=dy, dx=x.grad, dw=module.weight.grad
    )


def residual_llama(rows=8, n=128):
    torch.manual_seed(7)
    module = LlamaRMSNorm(n, eps=1e-6).to(torch.bfloat16)
    x = torch.randn(rows, n).to(torch.bfloat16).requires_grad_()
    res = torch.randn(rows, n).to(torch.bfloat16).requires_grad_()
    h = x + res
    y = module(h)
    dy, dh = (torch.randn(rows, n).to(torch.bfloat16) for _ in range(2))
    (torch.sum(y.float() * dy.float()) + torch.sum(h.float() * dh.float())).backward()
    return arrays(
        "residual",
        x=x,
        res=res,
        w=module.weight,
        h=h,
        y=y,
        dy=dy,
        dh=dh,
        dx=x.grad,
        dres=res.grad,
    )


def gemma(rows=16, n=64):
    torch.manual_seed(5)
    module = GemmaRMSNorm(n, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(torch.randn(n) * 0.1)
    x = torch.randn(rows, n).to(torch.bfloat16).requires_grad_()
    y = module(x)
    dy = torch.randn(rows, n).to(torch.bfloat16)
    y.backward(dy)
    return arrays(
        "gemma", x=x, w=module.weight, y=y, dy=dy, dx=x.grad, dw=module.weight.grad
    )


def main(path):
    out = {}
    for half in ("bfloat16", "float16"):
        for seed in (0, 1, 2):
            out.update(llama(half, half, seed))
        out.update(llama(half, "float32", 3))
    out.update(residual_llama())
    out.update(gemma())
    np.savez(path, **out)


if __name__ == "__main__":
    main(sys.argv[1])
