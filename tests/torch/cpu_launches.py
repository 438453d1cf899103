"""The launches of normkit's CPU kernels, counted: a test's fixture over
`normkit.torch.kernels.cpu`'s compiled module."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

from normkit.torch.kernels import cpu


def counted(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...], gated: tuple[bool, ...]
            ) -> collections.Counter[str]:
    """The kernels (ungated and, or, gated, as ``gated`` lists), compiled for every dtype, with
    the launches of those called ``names`` counted (each still runs)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for each in gated:
            assert cpu.load(dtype, gated=each) is not None, cpu.unavailable_reason()
    module = cpu._state["module"]
    counts: collections.Counter[str] = collections.Counter()

    def counting(name: str, kernel: Any) -> Any:
        def launch(*args: Any) -> Any:
            counts[name] += 1
            return kernel(*args)

        return launch

    for name in names:
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    return counts
