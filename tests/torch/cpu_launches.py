"""The launches of normkit's CPU kernels, counted: a test's fixture over the compiled entry
points `normkit.torch.kernels.cpu` holds (``_state["compiled"]``, per dtype and gatedness:
``(forward, backward)`` or ``(gated_forward, gated_backward)``)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

from normkit.torch.kernels import cpu

_NAMES = {False: ("forward", "backward"), True: ("gated_forward", "gated_backward")}


def counted(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...], gated: tuple[bool, ...]
            ) -> collections.Counter[str]:
    """The kernels (ungated and, or, gated, as ``gated`` lists), compiled for every dtype, with
    the launches of those called ``names`` counted (each still runs)."""
    counts: collections.Counter[str] = collections.Counter()

    def counting(name: str, kernel: Any) -> Any:
        def launch(*args: Any) -> Any:
            counts[name] += 1
            return kernel(*args)

        return launch

    compiled = cpu._state["compiled"]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for each in gated:
            assert cpu.load(dtype, gated=each) is not None, cpu.unavailable_reason()
            monkeypatch.setitem(compiled, (dtype, each), tuple(
                counting(name, kernel) if name in names else kernel
                for name, kernel in zip(_NAMES[each], compiled[(dtype, each)], strict=True)
            ))
    return counts
