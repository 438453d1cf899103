"""normkit.port without a framework: convert, save/load, refusing pickles and tampered files, the CLI."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from normkit import NormSpec, dtypes, port, reference, tolerances
from normkit.port import cli

save_file = pytest.importorskip("safetensors.numpy").save_file
RNG = np.random.default_rng(7)
LAYER = NormSpec("layer", eps=1e-5)
RMS = NormSpec("rms")
GEMMA = NormSpec("rms", scale_offset=1.0)


def rand(shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def layer_params(dtype=np.float32):
    return {"scale": rand(8, dtype), "bias": rand(8, dtype)}


# --- convert ------------------------------------------------------------------------------


@pytest.mark.parametrize("src", port.CONVENTIONS)
@pytest.mark.parametrize("dst", port.CONVENTIONS)
def test_convert_renames_bit_exactly(src, dst):
    values = layer_params()
    w, b = port.NAMES[src]
    out = port.convert({w: values["scale"], b: values["bias"]}, LAYER, src=src, dst=dst)
    w2, b2 = port.NAMES[dst]
    assert list(out) == [w2, b2]
    assert out[w2].tobytes() == values["scale"].tobytes() and out[w2].dtype == np.float32
    assert out[b2].tobytes() == values["bias"].tobytes()


def test_convert_accepts_the_keras_weight_list_in_get_weights_order():
    values = layer_params()
    out = port.convert([values["scale"], values["bias"]], LAYER, src="keras", dst="torch")
    assert out["weight"] is not None and np.array_equal(out["weight"], values["scale"])
    assert np.array_equal(out["bias"], values["bias"])


def test_offset_conversion_rounds_once_from_float64():
    w = rand(64, dtypes.bfloat16) * dtypes.bfloat16.type(0.01)
    out = port.convert({"scale": w}, GEMMA, src="flax", dst="torch", dst_spec=RMS)["weight"]
    assert out.dtype == dtypes.bfloat16
    expected = dtypes.round_to(w.astype(np.float64) + 1.0, dtypes.bfloat16)
    assert out.tobytes() == expected.tobytes()


def test_gemma_offset_to_zero_and_back_gives_the_same_outputs():
    x = rand((4, 32))
    w = rand(32) * np.float32(0.1)
    y = reference.normalize(x, GEMMA, w)
    w0 = port.convert({"weight": w}, GEMMA, src="torch", dst="numpy", dst_spec=RMS)["scale"]
    w1 = port.convert({"scale": w0}, RMS, src="numpy", dst="torch", dst_spec=GEMMA)["weight"]
    # the float32 parameters round once each way; the outputs stay within the float32 bound
    tolerances.assert_close(reference.normalize(x, RMS, w0), y, what="offset 0")
    tolerances.assert_close(reference.normalize(x, GEMMA, w1), y, what="offset 1 again")
    assert np.max(np.abs(w1 - w)) <= 2.0**-24 * 2  # one float32 ulp of 1 + w, at most


@pytest.mark.parametrize(
    "params, spec, kwargs, message",
    [
        ({"weight": np.ones(4, np.float32)}, RMS, {"src": "pytorch", "dst": "flax"},
         "src='pytorch' is not a convention; expected one of ('torch', 'keras', 'flax', 'numpy')"),
        ({"weight": np.ones(4, np.float32)}, RMS, {"src": "torch", "dst": "jax"},
         "dst='jax' is not a convention"),
        ({"weight": np.ones(4, np.float32)}, LAYER, {"src": "torch", "dst": "flax"},
         "params (torch convention) missing ['bias']: a spec with scale=True, bias=True has "
         "exactly ['weight', 'bias']"),
        ({"scale": np.ones(4, np.float32), "gamma": np.ones(4, np.float32)}, RMS,
         {"src": "flax", "dst": "torch"}, "params (flax convention) unexpected ['gamma']"),
        ({"scale": np.ones(4, np.float32)}, RMS, {"src": "torch", "dst": "flax"},
         "missing ['weight'] and unexpected ['scale']"),
        ({"scale": np.ones((2, 4), np.float32)}, RMS, {"src": "flax", "dst": "torch"},
         "parameter 'scale' has shape (2, 4), but the spec normalizes over axis (-1,): it needs "
         "1 positive size(s), one per axis"),
        ({"weight": np.ones(4, np.float32), "bias": np.ones(5, np.float32)}, LAYER,
         {"src": "torch", "dst": "flax"}, "the scale and bias must have one shape, got "
         "{'weight': (4,), 'bias': (5,)}"),
        ([np.ones(4, np.float32)], LAYER, {"src": "keras", "dst": "flax"},
         "params is a list of 1 arrays, but a layer with scale=True, bias=True has 2: "
         "['scale', 'bias'] (get_weights() order)"),
        ([np.ones(4, np.float32)], RMS, {"src": "torch", "dst": "flax"},
         "a list is accepted for src='keras' only"),
        ({"scale": np.ones(4, np.float32)}, RMS, {"src": "flax", "dst": "flax",
         "dst_spec": NormSpec("rms", eps=1e-5, cast="before_scale")},
         "the specs differ in ['eps', 'cast'] (eps: 1e-06 -> 1e-05, cast: 'after_scale' -> "
         "'before_scale'); convert changes scale_offset only"),
    ],
)
def test_convert_errors_name_the_problem(params, spec, kwargs, message):
    with pytest.raises(ValueError) as err:
        port.convert(params, spec, **kwargs)
    assert message in str(err.value)


def test_convert_refuses_integer_parameters():
    with pytest.raises(TypeError, match="parameter 'weight' has dtype int64; normkit supports"):
        port.convert({"weight": np.ones(4, np.int64)}, RMS, src="torch", dst="flax")


# --- save / load --------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
@pytest.mark.parametrize("dtype", [np.float32, dtypes.bfloat16, np.float16, np.float64])
def test_save_load_round_trip_is_bit_exact(tmp_path, suffix, dtype):
    params = layer_params(dtype)
    written = port.save(tmp_path / f"norm{suffix}", params, LAYER)
    assert written == tmp_path / f"norm{suffix}"
    loaded, spec = port.load(written)
    assert spec == LAYER
    for name in ("scale", "bias"):
        assert loaded[name].dtype == np.dtype(dtype)
        assert loaded[name].tobytes() == params[name].tobytes()
    torch_named, _ = port.load(written, to="torch")
    assert torch_named["weight"].tobytes() == params["scale"].tobytes()


def test_save_in_a_convention_and_load_in_another(tmp_path):
    w = rand((3, 4))
    spec = NormSpec("partial_rms", p=0.5, axis=(-2, -1))
    port.save(tmp_path / "n.safetensors", {"weight": w}, spec, convention="torch")
    loaded, got = port.load(tmp_path / "n.safetensors", to="keras")
    assert got == spec and list(loaded) == ["scale"] and loaded["scale"].tobytes() == w.tobytes()


def test_npz_is_the_fallback_without_safetensors(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.warns(UserWarning, match="safetensors is not installed: writing .*norm.npz instead"):
        written = port.save(tmp_path / "norm.safetensors", layer_params(), LAYER)
    assert written == tmp_path / "norm.npz"
    assert zipfile.is_zipfile(written)
    monkeypatch.undo()
    assert port.load(written)[1] == LAYER


def test_save_errors_name_the_layer(tmp_path):
    with pytest.raises(ValueError, match=r"layer 'blocks.0.norm': params \(numpy convention\) missing"):
        port.save_norms(tmp_path / "m.safetensors", {"blocks.0.norm": ({}, RMS)})
    with pytest.raises(ValueError, match=r"m.safetensors: no norm layers to write \(a model's norms must "
                       r"be normkit layers\)"):
        port.save_norms(tmp_path / "m.safetensors", {})
    with pytest.raises(TypeError, match="^spec must be a NormSpec, got dict"):
        port.save(tmp_path / "n.safetensors", {"scale": np.ones(3, np.float32)}, RMS.to_dict())
    with pytest.raises(ValueError, match=r"convention='jax' is not one of \('torch'"):
        port.save(tmp_path / "n.safetensors", {"scale": np.ones(3, np.float32)}, RMS, convention="jax")


def test_load_of_a_model_file_points_to_load_norms(tmp_path):
    one = {"scale": np.ones(3, np.float32)}
    path = port.save_norms(tmp_path / "m.safetensors", {"a.norm": (one, RMS), "b.norm": (one, RMS)})
    with pytest.raises(ValueError, match=r"holds the norms of a model \(2 layers: 'a.norm', "
                       r"'b.norm'\), not a single norm; use load_norms or import_norms"):
        port.load(path)
    assert set(port.load_norms(path)) == {"a.norm", "b.norm"}


class Payload:
    """Unpickling this creates ``marker``: the proof that a pickle was executed."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_raw_pickle_is_refused_and_not_executed(tmp_path):
    marker = tmp_path / "executed"
    path = tmp_path / "norm.pt"
    path.write_bytes(pickle.dumps({"weight": Payload(marker)}, protocol=2))
    with pytest.raises(ValueError, match="norm.pt: is a Python pickle; normkit never unpickles"):
        port.load(path)
    assert not marker.exists()


def test_a_torch_save_zip_is_refused_and_not_executed(tmp_path):
    marker = tmp_path / "executed"
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w") as archive:  # the layout of torch.save's files
        archive.writestr("archive/data.pkl", pickle.dumps(Payload(marker)))
        archive.writestr("archive/version", "3\n")
    with pytest.raises(ValueError, match=r"model.pt: is a zip archive holding 'archive/data.pkl', "
                       r"'archive/version', not an .npz of arrays \(a torch.save file\?\); normkit "
                       "never unpickles"):
        port.load(path)
    assert not marker.exists()


def test_an_npz_with_an_object_array_is_refused_and_not_executed(tmp_path):
    marker = tmp_path / "executed"
    path = tmp_path / "norm.npz"
    np.savez(path, scale=np.array([Payload(marker)], dtype=object))
    with pytest.raises(ValueError, match="norm.npz: holds object arrays, which only a pickle can "
                       "read; normkit never unpickles"):
        port.load(path)
    assert not marker.exists()


def metadata(**changes):
    meta = {"format": "normkit.norms", "version": 1, "convention": "numpy",
            "layers": {"": LAYER.to_dict()}}
    meta.update(changes)
    return {"normkit": json.dumps(meta)}


@pytest.mark.parametrize(
    "tensors, meta, message",
    [
        (layer_params(), None, "has no normkit metadata (key 'normkit'); write it with "
         "normkit.port.save or export_norms"),
        (layer_params(), {"normkit": "{not json"}, "the normkit metadata is not valid JSON"),
        (layer_params(), {"normkit": "[1, 2]"}, "the normkit metadata is malformed: expected "
         "format 'normkit.norms'"),
        (layer_params(), metadata(version=2), "normkit format version 2; this normkit reads version 1"),
        (layer_params(), metadata(convention="tf"), "the metadata's convention 'tf' is not one of"),
        (layer_params(), metadata(layers=[]), "the metadata's 'layers' must map layer names to NormSpecs"),
        (layer_params(), metadata(layers={"": {**LAYER.to_dict(), "eps": -1.0}}),
         "invalid spec: NormSpec.eps=-1.0 is invalid"),
        (layer_params(), metadata(layers={"": {**LAYER.to_dict(), "gamma": 1}}),
         "invalid spec: unknown NormSpec fields ['gamma']"),
        (layer_params(), metadata(layers={"": RMS.to_dict()}),
         "tensors ['bias'] are parameters of no layer its specs describe (a spec with "
         "bias=False has no bias): the metadata and the tensors disagree"),
        ({"scale": rand(8)}, metadata(), "params (numpy convention) missing ['bias']"),
        ({"scale": rand((2, 8)), "bias": rand((2, 8))}, metadata(),
         "parameter 'scale' has shape (2, 8), but the spec normalizes over axis (-1,)"),
        ({**layer_params(), "extra.scale": rand(8)}, metadata(),
         "tensors ['extra.scale'] are parameters of no layer its specs describe"),
        ({"scale": np.ones(8, np.int32), "bias": rand(8)}, metadata(),
         "parameter 'scale' has dtype int32"),
    ],
)
def test_a_tampered_safetensors_file_is_refused(tmp_path, tensors, meta, message):
    path = tmp_path / "norm.safetensors"
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError) as err:
        port.load(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_corrupt_bytes_are_refused(tmp_path):
    path = tmp_path / "norm.safetensors"
    port.save(path, layer_params(), LAYER)
    data = bytearray(path.read_bytes())
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="junk.safetensors: is neither a safetensors nor an .npz "
                       r"file \(unrecognized header\)"):
        port.load(tmp_path / "junk.safetensors")
    path.write_bytes(bytes(data[:-4]))  # the last tensor's bytes are cut short
    with pytest.raises(ValueError, match="norm.safetensors: is not a readable safetensors file"):
        port.load(path)


def test_a_tampered_npz_is_refused(tmp_path):
    path = tmp_path / "norm.npz"
    np.savez(path, **layer_params())
    with pytest.raises(ValueError, match="norm.npz: has no normkit metadata"):
        port.load(path)
    meta = json.loads(metadata()["normkit"])
    np.savez(path, **layer_params(), __normkit__=np.array(json.dumps({**meta, "bfloat16": ["gamma"]})))
    with pytest.raises(ValueError, match=r"norm.npz: metadata 'bfloat16' must list stored tensor "
                       r"names, got \['gamma'\]"):
        port.load(path)
    np.savez(path, **layer_params(), __normkit__=np.array(json.dumps({**meta, "bfloat16": ["scale"]})))
    with pytest.raises(ValueError, match="norm.npz: bfloat16 tensor 'scale' is stored as float32, "
                       "not uint16 bits"):
        port.load(path)
    np.savez(path, **layer_params(), __normkit__=np.array([1.0]))
    with pytest.raises(ValueError, match="norm.npz: '__normkit__' must be a JSON string, got float64"):
        port.load(path)


# --- CLI ----------------------------------------------------------------------------------


def parse(argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_rewrites_a_file_for_another_convention(tmp_path, capsys):
    w = rand(16) * np.float32(0.1)
    src = port.save_norms(tmp_path / "torch.safetensors",
                          {"layers.0.norm": ({"weight": w}, GEMMA)}, convention="torch")
    dst = tmp_path / "flax.npz"
    assert cli.run(parse([str(src), str(dst), "--to", "flax"])) == 0
    assert capsys.readouterr().out.strip() == f"wrote {dst}: 1 norm layer(s), flax convention"
    params, spec = port.load_norms(dst, to="flax")["layers.0.norm"]
    assert spec == GEMMA and params["scale"].tobytes() == w.tobytes()
    assert cli.run(parse([str(src), str(dst), "--to", "flax", "--scale-offset", "0"])) == 0
    params, spec = port.load_norms(dst, to="flax")["layers.0.norm"]
    assert spec == RMS
    assert params["scale"].tobytes() == dtypes.round_to(w.astype(np.float64) + 1, np.float32).tobytes()


def test_cli_needs_a_known_convention(capsys, tmp_path):
    src = port.save(tmp_path / "n.safetensors", layer_params(), LAYER)
    with pytest.raises(SystemExit):
        parse([str(src), str(tmp_path / "out.npz"), "--to", "jax"])
    assert "invalid choice: 'jax'" in capsys.readouterr().err


def test_load_errors_for_a_bad_convention_and_a_missing_safetensors(tmp_path, monkeypatch):
    path = port.save(tmp_path / "n.safetensors", layer_params(), LAYER)
    with pytest.raises(ValueError, match=r"to='jax' is not one of \('torch', 'keras', 'flax', 'numpy'\)"):
        port.load(path, to="jax")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"n.safetensors: reading safetensors needs safetensors: pip install 'normkit\[port\]'"):
        port.load(path)


def test_importing_normkit_port_imports_no_framework_and_no_safetensors():
    code = ("import sys, normkit.port; print([m for m in ('torch', 'tensorflow', 'keras', 'jax', "
            "'flax', 'safetensors') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# --- what is not a regular file, and interrupted writes -----------------------------------


def finishes_within(seconds, call, *, release=None):
    """What ``call()`` raised (None if it returned); fails the test if it has not returned within
    ``seconds``, after ``release()`` (opening a pipe's other end) lets the blocked call go."""
    outcome = {}

    def target():
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if release is not None:
            release()
        thread.join(5)
        pytest.fail(f"blocked for more than {seconds} s")
    return outcome.get("error")


def open_other_end(fifo, flags):
    def release():
        fd = os.open(fifo, flags | os.O_NONBLOCK)
        time.sleep(0.5)
        os.close(fd)

    return release


def not_regular_paths(tmp_path):
    """(path, what the error says it is, the FIFO behind it or None)."""
    fifo = tmp_path / "norms.safetensors"
    os.mkfifo(fifo)
    link = tmp_path / "link.safetensors"
    link.symlink_to(fifo)
    folder = tmp_path / "folder.safetensors"
    folder.mkdir()
    found = [
        (fifo, "is a named pipe (FIFO), not a regular file", fifo),
        (link, f"is a named pipe (FIFO) (a symlink to {fifo}), not a regular file", fifo),
        (folder, "is a directory, not a regular file", None),
    ]
    if os.path.exists("/dev/zero"):
        found.append((Path("/dev/zero"), "is a character device, not a regular file", None))
    return found


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
def test_load_refuses_what_is_not_a_regular_file_without_waiting(tmp_path):
    for path, what, fifo in not_regular_paths(tmp_path):
        release = open_other_end(fifo, os.O_WRONLY) if fifo else None
        err = finishes_within(10, lambda p=path: port.load(p), release=release)
        assert isinstance(err, ValueError), (path, err)
        assert str(err) == f"{path}: {what} (nothing was read)"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
def test_save_refuses_to_replace_what_is_not_a_regular_file(tmp_path):
    for path, what, fifo in not_regular_paths(tmp_path):
        if str(path).startswith("/dev/"):
            continue  # never written, even to test a refusal
        release = open_other_end(fifo, os.O_RDONLY) if fifo else None
        err = finishes_within(10, lambda p=path: port.save(p, layer_params(), LAYER), release=release)
        assert isinstance(err, ValueError), (path, err)
        assert str(err) == f"{path}: {what} (nothing was written)"
    assert stat.S_ISFIFO(os.stat(tmp_path / "norms.safetensors").st_mode)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
def test_the_port_command_refuses_a_named_pipe_as_a_usage_error(tmp_path, capsys):
    fifo = tmp_path / "p.safetensors"
    os.mkfifo(fifo)
    out = tmp_path / "o.safetensors"
    for argv in ([str(fifo), str(out)], [str(port.save(out, layer_params(), LAYER)), str(fifo)]):
        with pytest.raises(SystemExit) as exited:
            parse([*argv, "--to", "torch"])
        assert exited.value.code == 2
        assert f"{fifo} is a named pipe (FIFO), not a regular file" in capsys.readouterr().err


# The child writes under a 4 KiB file-size limit: its write of a 4 MiB file fails part-way, as
# on a full disk (EFBIG), or, with SIGXFSZ's default action restored (Python ignores it), the
# kernel kills it in the middle of the write.
INTERRUPTED_WRITE = """
import resource, signal, sys
import numpy as np
import safetensors.numpy
from normkit import NormSpec, cli, port

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if sys.argv[1] == "killed":
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
big = {"scale": np.ones(1 << 20, np.float32)}
if sys.argv[2] == "save":
    port.save(sys.argv[3], big, NormSpec("rms"))
else:
    sys.exit(cli.main(["port", *sys.argv[3:], "--to", "flax"]))
"""


def interrupted_write(how, *argv):
    return subprocess.run(
        [sys.executable, "-c", INTERRUPTED_WRITE, how, *argv],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file-size limits")
@pytest.mark.parametrize("how", ["killed", "full"])
@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_an_interrupted_save_leaves_the_old_file_intact(tmp_path, how, suffix):
    old = {"scale": rand(2048), "bias": rand(2048)}  # 16 KiB: beyond the child's limit
    path = port.save(tmp_path / f"norms{suffix}", old, LAYER)
    before = path.read_bytes()
    done = interrupted_write(how, "save", str(path))
    if how == "killed":
        assert done.returncode == -signal.SIGXFSZ, done.stderr
    else:
        assert done.returncode == 1 and "File too large" in done.stderr, done.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing left behind
    assert path.read_bytes() == before
    loaded, spec = port.load(path)
    assert spec == LAYER and all(np.array_equal(loaded[k], old[k]) for k in old)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file-size limits")
def test_an_interrupted_port_command_leaves_the_old_destination_intact(tmp_path):
    src = port.save_norms(tmp_path / "src.safetensors",
                          {f"layers.{i}.norm": ({"scale": rand(4096)}, RMS) for i in range(4)})
    dst = port.save(tmp_path / "dst.npz", {"scale": rand(2048), "bias": rand(2048)}, LAYER)
    before = dst.read_bytes()
    done = interrupted_write("full", "port", str(src), str(dst))
    assert done.returncode == 2 and "File too large" in done.stderr, done.stderr
    assert dst.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst.npz", "src.safetensors"]


def test_a_save_keeps_the_replaced_file_s_mode_and_symlink(tmp_path):
    path = port.save(tmp_path / "norms.safetensors", layer_params(), LAYER)
    path.chmod(0o640)
    link = tmp_path / "link.safetensors"
    link.symlink_to(path.name)
    params = layer_params()
    assert port.save(link, params, LAYER) == link
    assert link.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o640
    loaded, _ = port.load(path)
    assert all(np.array_equal(loaded[k], params[k]) for k in params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.safetensors", "norms.safetensors"]
