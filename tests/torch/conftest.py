"""Fixtures of the torch tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# kernel="auto" runs the CPU kernel in the tests whether or not it is compiled on this machine
# yet (normkit.torch.kernels.cpu.ready: compiled in the call that first needs it, as
# kernel="cpu" is); the tests of the other choice set it themselves.
os.environ.setdefault("NORMKIT_CPU_COMPILE", "wait")


@pytest.fixture(autouse=True)
def _fresh_function_plans() -> Iterator[None]:
    """Each test starts without the plans earlier tests made for normkit.torch's functions
    (`normkit.torch._plan`): a test that changes what a plan reads (numba missing, a broken
    kernel) must get a plan made under its changes, and leave none behind."""
    from normkit.torch import functional

    functional._plans_of.cache_clear()
    yield
    functional._plans_of.cache_clear()
