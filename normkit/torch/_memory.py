"""Large CPU tensors in storages kept for reuse: the outputs of the CPU kernel and the buffers of
the composite path.

Fresh memory is mapped page by page on its first write; with 4 KiB pages a 128 MiB tensor takes
32768 page faults, which cost more than writing it (most of ``clone``'s time on a virtual
machine), and whether the machine gives huge pages varies from call to call (a forward of 2048
x 4096 float32 took 6 to 22 ms in one loop). A storage used before is mapped already: a loop
that drops each tensor gets its memory back, written at memory speed. `empty_like` hands out
such storages for tensors of 32 MiB and more on Linux's CPU; elsewhere it is
``torch.empty_like``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import threading
from collections.abc import Callable

import torch

__all__ = ["HUGE_PAGE", "HUGE_PAGE_MIN_BYTES", "KEPT_BYTES", "empty_cache", "empty_like"]

HUGE_PAGE = 2**21
HUGE_PAGE_MIN_BYTES = 2**25
MADV_HUGEPAGE = 14
KEPT_BYTES = 2**32
"""The most bytes of storage kept for reuse (4 GiB); `empty_cache` gives back those no tensor
uses."""

_kept: dict[int, list[torch.UntypedStorage]] = {}
_kept_lock = threading.Lock()
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise(address, length, advice)`` on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    advise = ctypes.CDLL(None).madvise
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advise.restype = ctypes.c_int
    return advise


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous tensor shaped like ``t`` (of ``dtype``, default t's), uninitialized. On
    Linux's CPU one of 32 MiB or more starts on a 2 MiB boundary of a storage kept for reuse,
    advised onto transparent huge pages (``MADV_HUGEPAGE``) where that storage is new.

    torch's allocations start 64 bytes into a mapping, 4 KiB-aligned at best: the part before
    the first 2 MiB boundary and the part after the last could only take 4 KiB pages (about 512
    faults more than the 64 of a 128 MiB tensor, and a huge page two threads' claims would
    share). The tensor is therefore placed at the first 2 MiB boundary of a storage 2 MiB
    larger (storage offset nonzero).
    """
    dtype = t.dtype if dtype is None else dtype
    itemsize = dtype.itemsize
    size = t.numel() * itemsize
    advise = _madvise() if size >= HUGE_PAGE_MIN_BYTES and t.device.type == "cpu" else None
    if advise is None or _use_count is None:
        return torch.empty_like(t, dtype=dtype)
    strides = tuple(math.prod(t.shape[axis + 1:]) for axis in range(t.dim()))
    nbytes = size + HUGE_PAGE
    with _kept_lock:  # a storage is handed out once: the tensor on it is made under the lock
        kept = _kept.setdefault(nbytes, [])
        storage = next((s for s in kept if _use_count(s._cdata) == 1), None)
        fresh = storage is None
        if storage is None:
            storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
            if sum(each * len(held) for each, held in _kept.items()) + nbytes <= KEPT_BYTES:
                kept.append(storage)
        start = -(-storage.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        offset = (start - storage.data_ptr()) // itemsize  # allocations are 64-byte aligned
        out = torch.empty(0, dtype=dtype).set_(storage, offset, t.shape, strides)
    if fresh:
        advise(start, size // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)
    return out


def empty_cache() -> int:
    """Give back the storages kept for reuse that no tensor uses; returns their bytes. (CPU
    tensors of 32 MiB and more that normkit makes, the CPU kernel's outputs and the composite
    path's buffers, are made in storages kept for the next tensors of their size, at most
    `KEPT_BYTES`.)"""
    freed = 0
    with _kept_lock:
        for size, held in _kept.items():
            used = [s for s in held if _use_count is not None and _use_count(s._cdata) > 1]
            freed += size * (len(held) - len(used))
            held[:] = used
    return freed
