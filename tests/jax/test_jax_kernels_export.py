"""What the Pallas kernels' switch puts in each platform's program, read without a GPU.

`jax.export` lowers a jitted function for CUDA on a CPU-only machine: with the kernels selected
(``NORMKIT_JAX_KERNELS=pallas``, or ``implementation="pallas"``) the forward holds one Triton
call and the forward+backward two, no conditional (the only ``stablehlo.case`` ops are
`lax.platform_dependent`'s, whose index is a constant of the lowering), and nothing else reads
or writes an array of x's size (one pass over x per kernel). For the CPU the compiled program is
the XLA program's, instruction for instruction; for TPU the export holds no Triton call.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import normkit.jax as nkjax  # noqa: E402
from normkit import NormSpec  # noqa: E402
from normkit.jax import functional  # noqa: E402

TRITON = "__gpu$xla.gpu.triton"
#: The switch (`normkit.jax.functional.KERNELS_VARIABLE`), by name: also what the code before
#: it would have ignored.
KERNELS_VARIABLE = "NORMKIT_JAX_KERNELS"
SHAPE = (64, 1000)


@contextlib.contextmanager
def gpu_target() -> Iterator[None]:
    """An abstract H200 as the lowering's device: JAX 0.11's Triton lowering asks the device
    for its compute capability, and there is none here (JAX 0.10 needs nothing)."""
    if not hasattr(jax.sharding, "AbstractDevice"):
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                         platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                                     abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def exported(fn: Callable[..., Any], args: tuple[Any, ...], platform: str) -> str:
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]
    with gpu_target() if platform == "cuda" else contextlib.nullcontext():
        lowered = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)
        return str(lowered(*args).mlir_module())


def _walk(operation: Any) -> Iterator[Any]:
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op
                yield from _walk(op)


class Program(NamedTuple):
    """What an exported module holds: its conditionals (`conditionals`) and the operations
    besides the kernels that pass over x (`passes_besides_kernels`)."""

    conditionals: list[str]
    passes: list[str]


def read(text: str, size: int) -> Program:
    """The module ``text`` read with JAX's MLIR bindings (every operation, nested ones too)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context() as context:
        module = ir.Module.parse(text, context)
        ops = list(_walk(module.operation))
        return Program(conditionals(ops), passes_besides_kernels(ops, size))


def _elements(value: Any) -> int:
    shape = getattr(value.type, "shape", None)
    return int(np.prod(shape)) if shape is not None else 0


def _constant_region(region: Any) -> bool:
    """A region that only returns constants (`lax.platform_dependent`'s index map)."""
    ops = [op for block in region.blocks for op in block.operations]
    return all(op.name in ("stablehlo.constant", "stablehlo.return") for op in ops)


def conditionals(ops: list[Any]) -> list[str]:
    """The ``stablehlo.case`` ops that choose at run time: more than one region, not all of
    them returning constants (a platform selection lowered for one platform has one region
    holding the program, and an index map of constant regions)."""
    found = []
    for op in ops:
        if op.name != "stablehlo.case":
            continue
        if len(op.regions) > 1 and not all(_constant_region(r) for r in op.regions):
            found.append(op.name)
    return found


#: What may touch an x-sized array besides the kernels: moving it in and out of them, and the
#: sharding annotations of the abstract device's mesh (`gpu_target`).
_MOVES = ("stablehlo.custom_call", "stablehlo.reshape", "stablehlo.return", "func.return",
          "stablehlo.case", "sdy.sharding_constraint")


def _dead(op: Any) -> bool:
    """Whether nothing uses ``op``'s results but the return of a case region whose case result
    nothing uses, or a sharding annotation of such a value (XLA removes them): the other
    platform's residuals, zero-filled where the platform selection is differentiated."""
    return all(_dead_value(result) for result in op.results)


def _dead_value(value: Any) -> bool:
    for use in value.uses:
        owner = use.owner
        if owner.name == "sdy.sharding_constraint":
            if not _dead_value(owner.results[0]):
                return False
        elif owner.name == "stablehlo.return" and owner.parent.name == "stablehlo.case":
            if not _dead_value(owner.parent.results[use.operand_number]):
                return False
        else:
            return False
    return True


def passes_besides_kernels(ops: list[Any], size: int) -> list[str]:
    """The live operations besides the Triton calls (and the reshapes and returns around
    them) that read or write an array of ``size`` elements or more."""
    found = []
    for op in ops:
        if op.name in _MOVES or _dead(op):
            continue
        values = [*op.operands, *op.results]
        if any(_elements(v) >= size for v in values):
            found.append(op.name)
    return found


def _forward_backward(apply: Callable[..., Any]) -> Callable[..., Any]:
    def run(params: Any, x: jax.Array, dy: Any) -> Any:
        y, vjp = jax.vjp(apply, params, x)
        return y, vjp(dy)

    return run


def _arguments(apply: Callable[..., Any], params: Any, x: jax.Array, backward: bool
               ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The function to export and its arguments: ``apply(params, x)``, or its forward and
    backward for a cotangent of the outputs' shapes and dtypes (an argument, not a constant
    XLA could fold)."""
    if not backward:
        return apply, (params, x)
    outputs = jax.eval_shape(apply, params, x)
    dy = jax.tree.map(lambda out: jnp.ones(out.shape, out.dtype), outputs)
    return _forward_backward(apply), (params, x, dy)


def _linen(module: Any, x: jax.Array) -> tuple[Callable[..., Any], Any]:
    return module.apply, module.init(jax.random.key(0), x[:1])


def _nnx(module: Any) -> tuple[Callable[..., Any], Any]:
    graphdef, state = nnx.split(module)

    def apply(state: Any, x: jax.Array) -> Any:
        return nnx.merge(graphdef, state)(x)

    return apply, state


def programs(dtype: str) -> dict[str, tuple[Callable[..., Any], Any, Any]]:
    """``(apply(params, x), params, x)`` of each program, with the implementation the switch
    (`KERNELS_VARIABLE`) selects: the drop-ins for Flax's layers, and the functions
    with the options that change the kernels' inputs (a residual, a gate with groups, DyT)."""
    x = jnp.ones(SHAPE, dtype)
    n = SHAPE[-1]

    def function(spec: NormSpec) -> tuple[Callable[..., Any], Any, Any]:
        def apply(params: Any, x: jax.Array) -> Any:
            scale, bias, second = params
            if spec.residual is not None:
                return functional.add_norm(x, second, spec, scale, bias)
            return functional.normalize(x, spec, scale, bias, gate=second)

        second = None if spec.residual is None and spec.gate is None else jnp.ones(SHAPE, dtype)
        return apply, (jnp.ones(n), None if not spec.bias else jnp.zeros(n), second), x

    return {
        "linen-rms": (*_linen(nkjax.RMSNorm(), x), x),
        "linen-layer": (*_linen(nkjax.LayerNorm(), x), x),
        "nnx-rms": (*_nnx(nkjax.nnx.RMSNorm(n)), x),
        "nnx-layer-two-pass": (*_nnx(nkjax.nnx.LayerNorm(n, use_fast_variance=False)), x),
        "partial-llama-cast": function(NormSpec("partial_rms", p=0.25, cast="before_scale")),
        "residual": function(NormSpec(residual="float32_normalized")),
        "gate-groups": function(NormSpec(gate="after", group_size=100)),
        "dyt": function(NormSpec("dyt")),
    }



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("name", list(programs("float32")))
def test_cuda_program_is_the_kernels_alone(
    name: str, backward: bool, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One Triton call per kernel, no conditional, and no other pass over x."""
    monkeypatch.setenv(KERNELS_VARIABLE, "pallas")
    apply, params, x = programs(dtype)[name]
    fn, args = _arguments(apply, params, x, backward)
    text = exported(fn, args, "cuda")
    found = (text.count(f"@{TRITON}"), read(text, x.size))
    assert found == (2 if backward else 1, Program(conditionals=[], passes=[]))


@pytest.mark.parametrize("spec", [NormSpec(), NormSpec("layer", eps_placement="outside")],
                         ids=["rms", "layer-outside"])
def test_long_rows_take_the_backward_in_slices(spec: NormSpec) -> None:
    """Rows of 16384: the backward first reads the rows whole for their statistic and sums (a
    third Triton call), then takes them in slices; still no conditional, no other pass."""
    x = jnp.ones((16, 16384), jnp.bfloat16)

    def apply(scale: jax.Array, x: jax.Array) -> Any:
        return functional.normalize(x, spec, scale, implementation="pallas")

    fn, args = _arguments(apply, jnp.ones(16384), x, backward=True)
    text = exported(fn, args, "cuda")
    assert (text.count(f"@{TRITON}"), read(text, x.size)) == (3, Program([], []))


def test_the_xla_program_on_cuda_has_its_conditional(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the checks above read, on the XLA program: its guard is a conditional, and its
    reductions pass over x (so they can fail)."""
    monkeypatch.setenv(KERNELS_VARIABLE, "xla")
    x = jnp.ones(SHAPE)
    apply, params = _linen(nkjax.RMSNorm(), x)
    program = read(exported(apply, (params, x), "cuda"), x.size)
    assert program.conditionals and program.passes


def _program(text: str) -> str:
    """A compiled HLO module without names: its computations and instructions, each name
    replaced by its order of appearance, metadata and the module's name dropped."""
    text = text[text.index("\n%"):] if "\n%" in text else text
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    names: dict[str, str] = {}
    return re.sub(r"%([\w.\-]+)", lambda m: "%" + names.setdefault(m.group(1), f"v{len(names)}"),
                  text)


def _compiled(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    return _program(jax.jit(fn).lower(*args).compile().as_text())


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("name", ["linen-rms", "nnx-layer-two-pass", "residual", "gate-groups"])
def test_cpu_program_is_unchanged_by_the_switch(
    name: str, backward: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU keeps the tuned XLA program: compiled with the kernels selected, it is the
    program compiled without, instruction for instruction."""
    if jax.default_backend() != "cpu":
        pytest.skip("compiles for this machine's CPU")
    found = []
    for switch in ("xla", "pallas"):
        monkeypatch.setenv(KERNELS_VARIABLE, switch)
        apply, params, x = programs("bfloat16")[name]
        fn, args = _arguments(apply, params, x, backward)
        found.append(_compiled(fn, args))
    assert found[0] == found[1]


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_the_modules_select_the_kernels_by_argument(api: str) -> None:
    """``implementation="pallas"`` without the environment variable."""
    x = jnp.ones(SHAPE)
    if api == "linen":
        apply, params = _linen(nkjax.LayerNorm(implementation="pallas"), x)
    else:
        apply, params = _nnx(nkjax.nnx.RMSNorm(SHAPE[-1], implementation="pallas"))
    assert exported(apply, (params, x), "cuda").count(f"@{TRITON}") == 1


def test_tpu_program_is_the_xla_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """Platforms other than CUDA keep the XLA program: no Triton call."""
    monkeypatch.setenv(KERNELS_VARIABLE, "pallas")
    apply, params, x = programs("float32")["linen-rms"]
    text = exported(*_arguments(apply, params, x, backward=True), "tpu")
    assert TRITON not in text
