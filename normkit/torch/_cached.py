"""`cached`: ``functools.lru_cache`` for the functions a ``torch.compile`` trace goes through.

Dynamo warns on every call of an ``lru_cache``-wrapped function it traces (it traces the
function and ignores the cache), so a model with normkit layers would print warnings under
``torch.compile`` that one with torch's layers does not. A function wrapped by `cached` looks
its result up in eager code and is itself traced (once, its result a constant of the graph).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["cached"]

_F = TypeVar("_F", bound=Callable[..., Any])


def cached(maxsize: int) -> Callable[[_F], _F]:
    """``functools.lru_cache(maxsize)``, except while Dynamo traces (then the function itself
    runs); ``cache_clear`` as lru_cache's."""

    def decorate(function: _F) -> _F:
        memo = functools.lru_cache(maxsize)(function)

        @functools.wraps(function)
        def call(*args: Any) -> Any:
            if torch.compiler.is_compiling():
                return function(*args)
            return memo(*args)

        call.cache_clear = memo.cache_clear  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return decorate
