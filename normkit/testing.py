"""Testing helpers for people's own norm implementations: `assert_conforms`, for any pytest suite.

    from normkit import NormSpec
    from normkit.testing import assert_conforms

    def test_my_rmsnorm():
        assert_conforms(my_rms_norm, NormSpec("rms", eps=1e-5), backend="torch")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from normkit.backends import bridge as get_bridge
from normkit.conformance.cases import Case
from normkit.conformance.compare import compare
from normkit.spec import NormSpec

__all__ = ["assert_conforms"]


def assert_conforms(
    fn: Callable[..., Any],
    spec: NormSpec,
    *,
    backend: str,
    dtypes: Sequence[str] = ("float32", "float16", "bfloat16"),
    shapes: Sequence[tuple[int, ...]] = ((5, 7), (4, 256)),
    grad: bool = True,
    params: bool = False,
    device: str = "cpu",
) -> None:
    """Raise AssertionError unless ``fn`` computes ``spec`` within `normkit.tolerances`.

    Args:
      fn: a function of the framework ``backend``: ``fn(x) -> y``, or ``fn(x, scale, bias) -> y``
        with ``params=True`` (``scale``/``bias`` None where the spec has none). Without params
        the reference uses their initial values (an effective scale of 1, a zero bias).
      spec: the norm ``fn`` should compute.
      backend: ``"torch"``, ``"jax"`` or ``"tf"`` (TensorFlow, eager).
      dtypes: input dtypes to check; half inputs follow the spec's cast policy.
      shapes: input shapes; ``spec.axis`` picks the normalized axes.
      grad: also check the gradients (input, and the params with ``params=True``).
      params: whether ``fn`` takes ``scale`` and ``bias``.
      device: a device the framework sees, e.g. ``"cpu"`` or ``"cuda:0"``.

    The error message names the worst case (dtype, shape) and its figures: max abs, max rel and
    max ulp errors against the bound, and any dtype mismatch.
    """
    bridge = get_bridge(backend)
    quantities = ("y", "dx", "dscale", "dbias") if params else ("y", "dx")
    if not grad:
        quantities = ("y",)
    failures: list[tuple[float, str]] = []
    for dtype in dtypes:
        for shape in shapes:
            case = Case(spec, tuple(shape), dtype)
            x, dy, scale, bias = case.inputs()
            if not params:
                scale = bias = None
            call = fn if params else (lambda x, scale, bias: fn(x))
            if grad:
                outputs = bridge.vjp(call, x, dy, scale, bias, device)
            else:
                outputs = (bridge.forward(call, x, scale, bias, device), None, None, None)
            problems, measured = compare(spec, (x, dy, scale, bias), outputs, quantities)  # type: ignore[arg-type]
            if problems:
                worst = max((m.error / m.bound.value for m in measured.values()), default=float("inf"))
                dtype_problem = any("dtype" in p for p in problems)
                failures.append((float("inf") if dtype_problem else worst, f"{dtype}{list(shape)}: " + "; ".join(problems)))
    if failures:
        failures.sort(key=lambda f: -f[0])
        lines = [f"{fn_name(fn)} does not conform to {spec} in {len(failures)} case(s); worst first:"]
        lines += [f"  {text}" for _, text in failures[:3]]
        raise AssertionError("\n".join(lines))


def fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
