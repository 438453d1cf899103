"""`fix`: write a corrected copy of a checkpoint whose findings are exact.

Only a report made with the original (``against``) is corrected, and only when every finding
was compared with the original's tensor: each such tensor becomes the original's values moved
to the runtime's offset, ``round(original + (original offset - runtime offset))``, rounded once
to the stored dtype (to the original's dtype when the stored one was narrowed; GGUF norms to
F32, as llama.cpp's converter stores them); an eps that differs is set to the original's in the
config key, GGUF metadata key or spec the runtime reads it from. Everything else is copied as
it is. The output is written whole, beside its destination first (`normkit.files`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from normkit import dtypes
from normkit.doctor import llama_cpp
from normkit.doctor.checkpoint import Checkpoint
from normkit.doctor.read import read_checkpoint
from normkit.doctor.report import Report, TensorReport
from normkit.doctor.verdicts import EPS_TOLERANCE
from normkit.files import write_atomically

__all__ = ["fix"]


def fix(report: Report, out: str | os.PathLike[str]) -> Path | None:
    """Write ``report``'s checkpoint to ``out`` with its findings corrected; None (nothing
    written) when there is no finding.

    Raises ValueError when the report was made without the original, when a finding was not
    compared with the original's tensor (not exact), or when an eps is not read from a place
    the checkpoint holds (a class that fixes its own eps).
    """
    if not report.findings:
        return None
    if report.against is None:
        raise ValueError(
            f"{report.path}: only exact findings are corrected; examine it against the original "
            "checkpoint (--against) first"
        )
    inexact = [t.name for t in report.findings if t.comparison is None]
    if inexact:
        raise ValueError(
            f"{report.path}: {len(inexact)} finding(s) were not compared with the original "
            f"(no counterpart there), so their correction is not known: {inexact[:3]}"
        )
    checkpoint = read_checkpoint(report.path)
    original = read_checkpoint(report.against)
    values = {t.name: _corrected(t, checkpoint, original) for t in report.findings
              if set(t.findings) - {"eps_differs"}}
    eps = {t.name: (t.convention.eps, t.comparison.original_eps) for t in report.findings
           if "eps_differs" in t.findings and t.comparison is not None}
    out = Path(out)
    if checkpoint.format in ("huggingface", "mlx-lm"):
        return _fix_directory(checkpoint, values, eps, out)
    if checkpoint.format == "gguf":
        return _fix_gguf(checkpoint, values, eps, out)
    return _fix_norms(checkpoint, values, eps, out)


def _corrected(tensor: TensorReport, checkpoint: Checkpoint, original: Checkpoint) -> np.ndarray:
    """The original's values at the runtime's offset, rounded once to the dtype to store."""
    assert tensor.comparison is not None
    source = original.tensor(tensor.comparison.original)
    expected = tensor.comparison.expected
    shift = 0.0 if expected == "equal" else float(expected)
    dtype = source.dtype if "dtype_narrowed" in tensor.findings else checkpoint.tensor(
        tensor.name).dtype
    if checkpoint.format == "gguf":
        dtype = np.dtype(llama_cpp.NORM_DTYPE)
    return dtypes.round_to(source.astype(np.float64) + shift, dtype)


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= EPS_TOLERANCE * max(abs(a), abs(b))


def _eps_values(eps: Mapping[str, tuple[float | None, float | None]]) -> dict[float, float]:
    """``{wrong eps: the original's}``; ValueError when one wrong eps has two corrections."""
    moves: dict[float, float] = {}
    for name, (wrong, right) in eps.items():
        if wrong is None or right is None:
            raise ValueError(f"{name}: its eps or the original's is unknown")
        if any(_same(wrong, w) and not _same(right, r) for w, r in moves.items()):
            raise ValueError(f"{name}: norms with eps {wrong:g} need different corrections")
        moves[wrong] = right
    return moves


def _fix_directory(checkpoint: Checkpoint, values: Mapping[str, np.ndarray],
                   eps: Mapping[str, tuple[float | None, float | None]], out: Path) -> Path:
    """A copy of the model directory with the shards holding ``values`` rewritten and the
    config's eps keys corrected, built beside ``out`` and renamed to it."""
    from safetensors import safe_open
    from safetensors.numpy import save

    if out.exists():
        raise ValueError(f"{out}: exists; the corrected checkpoint goes to a new directory")
    config = dict(checkpoint.config)
    moves = _eps_values(eps)
    fixed_keys = set()
    for wrong, right in moves.items():
        keys = [k for k, v in _eps_entries(config) if _same(v, wrong)]
        if not keys:
            raise ValueError(
                f"{checkpoint.path}: no eps key of config.json holds {wrong:g}: the runtime's "
                "eps does not come from the config, so it cannot be corrected there"
            )
        for key in keys:
            _set(config, key, right)
        fixed_keys.update(keys)
    building = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    building.mkdir(parents=True)
    try:
        for item in checkpoint.path.iterdir():
            if item.is_file():
                shutil.copy2(item, building / item.name)
        (building / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for shard in {checkpoint.files[name] for name in values}:
            with safe_open(str(shard), framework="numpy") as f:
                metadata = f.metadata()
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            tensors.update({k: v for k, v in values.items() if checkpoint.files[k] == shard})
            _write_bytes(building / shard.name, save(tensors, metadata=metadata))
        os.replace(building, out)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return out


def _write_bytes(path: Path, data: bytes) -> None:
    write_atomically(path, lambda f: f.write(data))


def _eps_entries(config: Mapping[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """Every float under a key containing ``eps``, nested configs included (dotted keys)."""
    found = []
    for key, value in config.items():
        if isinstance(value, Mapping):
            found += _eps_entries(value, f"{prefix}{key}.")
        elif "eps" in str(key) and isinstance(value, float):
            found.append((f"{prefix}{key}", value))
    return found


def _set(config: dict[str, Any], dotted: str, value: float) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node[part] = dict(node[part])
        node = node[part]
    node[last] = value


def _fix_gguf(checkpoint: Checkpoint, values: Mapping[str, np.ndarray],
              eps: Mapping[str, tuple[float | None, float | None]], out: Path) -> Path:
    """A copy of the GGUF file with ``values`` as F32 tensors and the eps key corrected."""
    import gguf

    moves = _eps_values(eps)
    found = llama_cpp.eps_key(checkpoint.config)
    new_eps: dict[str, float] = {}
    if moves:
        if found is None or not any(_same(found[1], wrong) for wrong in moves):
            raise ValueError(f"{checkpoint.path}: the metadata's eps is not the one to correct")
        new_eps[found[0]] = next(r for w, r in moves.items() if _same(found[1], w))
    reader = gguf.GGUFReader(checkpoint.path)
    arch = str(checkpoint.architecture)
    temporary = out.with_name(f".{out.name}.{secrets.token_hex(4)}.gguf.tmp")
    try:
        writer = gguf.GGUFWriter(temporary, arch, endianess=reader.endianess)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            value = new_eps.get(field.name, field.contents())
            writer.add_key_value(field.name, value, kind, sub_type=sub)
        data = {}
        for tensor in reader.tensors:
            if tensor.name in values:
                shape = tuple(int(d) for d in reversed(tensor.shape))
                array = np.asarray(values[tensor.name], np.float32).reshape(shape)
                data[tensor.name] = array
                writer.add_tensor_info(tensor.name, array.shape, array.dtype, array.nbytes,
                                       gguf.GGMLQuantizationType.F32)
            else:
                data[tensor.name] = tensor.data
                writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                                       tensor.data.nbytes, tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in reader.tensors:
            writer.write_tensor_data(data[tensor.name], tensor_endianess=reader.endianess)
        writer.close()
        with open(temporary, "rb") as source:
            write_atomically(out, lambda f: shutil.copyfileobj(source, f))
    finally:
        temporary.unlink(missing_ok=True)
    return out


def _fix_norms(checkpoint: Checkpoint, values: Mapping[str, np.ndarray],
               eps: Mapping[str, tuple[float | None, float | None]], out: Path) -> Path:
    """A copy of the normkit norms file (torch's parameter names) with ``values`` and the eps
    of the layers with an eps finding corrected."""
    from normkit.port.files import load_norms, save_norms

    moves = _eps_values(eps)
    wrong_layers = {name.rpartition(".")[0] for name in eps}
    layers = load_norms(checkpoint.path, to="torch")
    fixed = {}
    for layer, (params, spec) in layers.items():
        params = dict(params)
        for param in list(params):
            name = f"{layer}.{param}" if layer else param
            params[param] = values.get(name, params[param])
        wrong = next((w for w in moves if layer in wrong_layers and spec.eps is not None
                      and _same(spec.eps, w)), None)
        fixed[layer] = (params, spec if wrong is None else spec.replace(eps=moves[wrong]))
    return save_norms(out, fixed, convention="torch")
