"""`user_stacklevel`: where a warning of normkit.torch points, the user's own call."""

from __future__ import annotations

import os
import sys

import torch

_INSIDE = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` called where this is called that names the
    first frame outside normkit.torch and torch: the user's line that called the layer or the
    function (its module's ``__call__`` and the plans between are torch's and normkit's)."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame = frame.f_back
        level += 1
    return level
