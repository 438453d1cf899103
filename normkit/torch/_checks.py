"""The checks of a call's tensors that the plans (`normkit.torch._plan`) and the sharded norms
(`normkit.torch.distributed`) share."""

from __future__ import annotations

import torch

__all__ = ["SUPPORTED_DTYPES", "check_param", "check_tensor", "dtype_name"]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64
)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_tensor(t: object, what: str) -> torch.Tensor:
    """``t`` if it is a tensor of a supported dtype, else TypeError naming the problem."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)
        raise TypeError(
            f"{what} has dtype {dtype_name(t.dtype)}; normkit.torch supports {names}"
        )
    return t


def check_param(
    value: torch.Tensor | None, name: str, present: bool, shape: tuple[int, ...]
) -> None:
    """ValueError for a parameter the spec lacks or of another shape than ``shape``,
    TypeError for one of an unsupported dtype; nothing for None."""
    if value is None:
        return
    if not present:
        field = "scale" if name == "weight" else name
        raise ValueError(f"{name} was given but the spec has {field}=False")
    check_tensor(value, name)
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
