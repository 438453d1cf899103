"""Which aten ops a piece of torch code dispatches, for structural tests (nothing is timed)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOps(TorchDispatchMode):
    """The aten ops dispatched inside the mode, by name, in order. A dispatch mode is
    thread-local: ops another thread runs (a CUDA backward on autograd's device thread) are
    not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))
