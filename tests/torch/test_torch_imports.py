"""Where the porting tools live: ``normkit.torch`` names ``normkit.port.huggingface`` for
``swap_norms`` whether it is reached as an attribute or imported from."""

from __future__ import annotations

import pytest

import normkit.torch

WHERE = "from normkit.port.huggingface import swap_norms"


def test_importing_swap_norms_from_normkit_torch_names_where_it_is() -> None:
    """The issue: Python's generic "cannot import name 'swap_norms'" hid the message."""
    with pytest.raises(ImportError, match=WHERE) as raised:
        from normkit.torch import swap_norms  # noqa: F401
    assert raised.value.name == "normkit.torch"


def test_attribute_access_and_hasattr_see_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match=WHERE):
        normkit.torch.swap_norms  # noqa: B018
    assert not hasattr(normkit.torch, "swap_norms")
    assert getattr(normkit.torch, "swap_norms", None) is None


def test_other_missing_names_keep_pythons_messages() -> None:
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'"):
        from normkit.torch import no_such_name  # type: ignore[attr-defined]  # noqa: F401
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        normkit.torch.no_such_name  # noqa: B018
