"""`normkit doctor` on tiny checkpoints of each family, converted by the real converters, with
each bug planted: every planted bug found, no finding on a clean conversion."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("gguf")

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as C  # noqa: E402

from normkit.doctor import FINDINGS, examine  # noqa: E402
from normkit.doctor.fix import fix  # noqa: E402

WITH_WEIGHTS = [f for f in C.FAMILIES if f != "olmo"]  # OLMo's LayerNorm has no parameters
BAKED = ["gemma", "gemma2", "gemma3", "qwen3_next", "qwen3_5"]
MLX = ["llama", "gemma", "gemma2", "gemma3", "qwen3", "qwen3_next", "cohere", "olmo2"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("doctor")


@pytest.fixture(scope="module")
def hf(root: Path):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = C.hf_model(family, root / family)
        return made[family]

    return get


def verdicts(report) -> dict[str, tuple[str, ...]]:
    return {t.name: t.verdicts for t in report.tensors}


def assert_clean(report) -> None:
    assert report.tensors, report.notes
    assert not report.findings, report.describe()
    assert all(set(t.verdicts) <= {"fine", "offset_baked_in"} for t in report.tensors)


@pytest.mark.parametrize("family", WITH_WEIGHTS)
def test_a_clean_hugging_face_directory_has_no_finding(family, hf):
    report = examine(hf(family))
    assert report.format == "huggingface"
    assert_clean(report)
    offsets = {t.convention.module: t.convention.scale_offset for t in report.tensors}
    gemma_style = {"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen3NextRMSNorm",
                   "Qwen3_5RMSNorm"}
    assert offsets == {m: 1.0 if m in gemma_style else 0.0 for m in offsets}  # probed
    assert all(t.confidence == "medium" for t in report.tensors)


def test_olmo_has_no_norm_tensor_to_judge(hf):
    report = examine(hf("olmo"))
    assert report.tensors == () and "no norm tensor" in report.notes[0]


@pytest.mark.parametrize("family", WITH_WEIGHTS)
def test_a_gguf_written_as_llama_cpp_does_has_no_finding(family, hf, root):
    gguf = C.to_gguf(hf(family), root / f"{family}.gguf", family)
    for report in (examine(gguf), examine(gguf, against=hf(family))):
        assert report.format == "gguf"
        assert_clean(report)
        baked = {name for name, v in verdicts(report).items() if v == ("offset_baked_in",)}
        expected = {n for n in verdicts(report) if family in BAKED and n.endswith(
            "norm.weight") and not n.endswith("ssm_norm.weight")}
        assert baked == expected
    assert {t.comparison.relation for t in report.tensors} == (
        {"+1", "equal"} if family in ("qwen3_next", "qwen3_5") else
        {"+1"} if family in BAKED else {"equal"})


@pytest.mark.parametrize("family", ["gemma", "gemma3", "qwen3_next"])
def test_a_gguf_without_the_baked_offset_is_found(family, hf, root):
    gguf = C.to_gguf(hf(family), root / f"{family}-missing.gguf", family, bake=0.0)
    shifted = {n for n in verdicts(examine(gguf)) if not n.endswith("ssm_norm.weight")}
    by_stats = examine(gguf)
    exact = examine(gguf, against=hf(family))
    for report, confidence in ((by_stats, "high"), (exact, "exact")):
        found = {t.name for t in report.findings}
        assert found == shifted
        assert all(t.findings == ("offset_missing",) and t.confidence == confidence
                   for t in report.findings)


@pytest.mark.parametrize("family", ["gemma2", "qwen3_5"])
def test_a_gguf_with_the_offset_baked_twice_is_found(family, hf, root):
    gguf = C.to_gguf(hf(family), root / f"{family}-doubled.gguf", family, bake=2.0)
    for report, confidence in ((examine(gguf), "medium"), (examine(gguf, against=hf(family)),
                                                           "exact")):
        assert report.findings
        assert all(t.findings == ("offset_doubled",) and t.confidence == confidence
                   for t in report.findings)
        assert all(t.name.endswith("ssm_norm.weight") for t in report.tensors
                   if not t.findings)


@pytest.mark.parametrize("family", ["llama", "cohere", "t5"])
def test_a_gguf_with_another_eps_is_found_against_the_original(family, hf, root):
    gguf = C.to_gguf(hf(family), root / f"{family}-eps.gguf", family, eps=3e-4)
    report = examine(gguf, against=hf(family))
    assert {t.findings for t in report.tensors} == {("eps_differs",)}
    assert "0.0003" in report.findings[0].reason
    # without the original nothing says what the eps should be: not a finding, and not claimed
    assert not examine(gguf).findings


def test_a_gguf_with_narrowed_norms_is_found(hf, root):
    gguf = C.to_gguf(hf("gemma"), root / "gemma-bf16.gguf", "gemma", norm_type="BF16")
    for report in (examine(gguf), examine(gguf, against=hf("gemma"))):
        assert {t.findings for t in report.tensors} == {("dtype_narrowed",)}


@pytest.fixture(scope="module")
def mlx(hf, root):
    pytest.importorskip("mlx_lm")
    made: dict[str, Path] = {}

    def get(family: str, **options) -> Path:
        key = f"{family}-mlx{''.join(f'-{k}{v}' for k, v in options.items())}"
        if key not in made:
            made[key] = C.to_mlx(hf(family), root / key, **options)
        return made[key]

    return get


@pytest.mark.parametrize("family", MLX)
def test_an_mlx_lm_conversion_has_no_finding(family, hf, mlx):
    for report in (examine(mlx(family)), examine(mlx(family), against=hf(family))):
        assert report.format == "mlx-lm"
        assert_clean(report)
    if family == "qwen3_next":  # mlx-lm's sanitize bakes the 1 in, for its nn.RMSNorm
        sources = {t.convention.source for t in report.tensors if t.verdicts == (
            "offset_baked_in",)}
        assert sources and all("sanitize" not in s for s in sources)
        assert {t.comparison.relation for t in report.tensors} == {"+1", "equal"}


@pytest.mark.parametrize(("family", "shift", "bug"), [
    ("gemma", 1.0, "offset_doubled"),        # 1 + w stored where mlx-lm's RMSNorm adds 1
    ("qwen3_next", 1.0, "offset_doubled"),   # sanitize's + 1 applied twice
    ("qwen3_next", -1.0, "offset_missing"),  # converted without sanitize's + 1
])
def test_an_mlx_lm_directory_with_a_planted_offset_bug_is_found(family, shift, bug, hf, mlx,
                                                                root):
    clean = examine(mlx(family), against=hf(family))
    offset_norms = {t.name for t in clean.tensors if t.convention.model_offset}
    planted = C.edit(mlx(family), root / f"{family}-mlx-{bug}",
                     lambda n, v: v + np.float32(shift) if n in offset_norms else v)
    for report, confidence in ((examine(planted), None), (examine(planted, against=hf(family)),
                                                          "exact")):
        assert {t.name for t in report.findings} == offset_norms
        assert {t.findings for t in report.findings} == {(bug,)}
        if confidence:
            assert {t.confidence for t in report.findings} == {confidence}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_an_mlx_lm_directory_with_another_eps_is_found(family, hf, mlx, root):
    planted = C.edit(mlx(family), root / f"{family}-mlx-eps", lambda n, v: v,
                     config={"rms_norm_eps": 1e-3})
    report = examine(planted, against=hf(family))
    assert {t.findings for t in report.tensors} == {("eps_differs",)}
    assert report.findings[0].convention.eps == pytest.approx(1e-3)  # probed in mlx-lm's class


def test_an_mlx_lm_conversion_to_bfloat16_narrows_the_norms(hf, mlx):
    converted = mlx("llama", dtype="bfloat16")
    for report in (examine(converted), examine(converted, against=hf("llama"))):
        assert {t.findings for t in report.tensors} == {("dtype_narrowed",)}


def test_a_hugging_face_directory_with_the_offset_baked_in_is_doubled(hf, root):
    planted = C.edit(hf("gemma3"), root / "gemma3-doubled",
                     lambda n, v: v + np.float32(1) if "norm" in n else v)
    assert {t.findings for t in examine(planted).tensors} == {("offset_doubled",)}
    exact = examine(planted, against=hf("gemma3"))
    assert {(t.findings, t.comparison.relation) for t in exact.tensors} == {
        (("offset_doubled",), "+1")}


def test_one_doubled_tensor_is_found_exactly_but_not_by_the_statistics(hf, root):
    planted = C.edit(hf("gemma"), root / "gemma-one",
                     lambda n, v: v + np.float32(1) if n == "model.norm.weight" else v)
    by_stats = examine(planted)
    assert not by_stats.findings  # one layer alone is not a conversion bug by the rules...
    assert verdicts(by_stats)["model.norm.weight"] == ("unsure",)  # ...but is not called fine
    exact = examine(planted, against=hf("gemma"))
    assert [t.name for t in exact.findings] == ["model.norm.weight"]


def test_a_sharded_directory_is_read_through_its_index(hf, root):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf("qwen3"))
    model.save_pretrained(root / "qwen3-sharded", max_shard_size="20KB")
    assert (root / "qwen3-sharded" / "model.safetensors.index.json").exists()
    assert len(list((root / "qwen3-sharded").glob("*.safetensors"))) > 1
    report = examine(root / "qwen3-sharded", against=hf("qwen3"))
    assert_clean(report)
    assert len(report.tensors) == len(examine(hf("qwen3")).tensors)


def test_a_normkit_norms_file_is_judged_by_its_specs(hf, root):
    import torch
    import transformers

    from normkit import port
    from normkit.port.huggingface import swap_norms

    model, _ = swap_norms(transformers.AutoModelForCausalLM.from_pretrained(hf("gemma")))
    path = port.export_norms(model, root / "gemma-norms.safetensors")
    assert_clean(examine(path, against=hf("gemma")))
    layers = port.load_norms(path, to="torch")
    wrong = {name: ({"weight": p["weight"] + np.float32(1)}, s.replace(eps=1e-5))
             for name, (p, s) in layers.items()}
    planted = port.save_norms(root / "gemma-norms-bad.safetensors", wrong, convention="torch")
    report = examine(planted, against=hf("gemma"))
    assert {t.findings for t in report.tensors} == {("offset_doubled", "eps_differs")}
    assert {t.findings for t in examine(planted).tensors} == {("offset_doubled",)}
    del torch


@pytest.mark.parametrize("family", ["gemma2", "qwen3_next"])
def test_fix_corrects_an_exact_finding(family, hf, root):
    planted = C.to_gguf(hf(family), root / f"{family}-tofix.gguf", family, bake=2.0, eps=1e-3,
                        norm_type="BF16")
    report = examine(planted, against=hf(family))
    assert {"offset_doubled", "eps_differs", "dtype_narrowed"} <= {
        v for t in report.tensors for v in t.findings}
    fixed = fix(report, root / f"{family}-fixed.gguf")
    after = examine(fixed, against=hf(family))
    assert_clean(after)
    assert {t.stored.dtype for t in after.tensors} == {"float32"}


def test_fix_corrects_a_directory_and_refuses_what_is_not_exact(hf, mlx, root):
    planted = C.edit(mlx("gemma"), root / "gemma-mlx-tofix",
                     lambda n, v: v + np.float32(1) if "norm" in n else v,
                     config={"rms_norm_eps": 1e-4})
    with pytest.raises(ValueError, match="against"):
        fix(examine(planted), root / "nope")
    report = examine(planted, against=hf("gemma"))
    fixed = fix(report, root / "gemma-mlx-fixed")
    assert_clean(examine(fixed, against=hf("gemma")))
    assert json.loads((fixed / "config.json").read_text())["rms_norm_eps"] == 1e-6
    assert not list(root.glob(".gemma-mlx-fixed*"))  # built beside it, renamed in place
    assert fix(examine(hf("gemma")), root / "unused") is None


def test_a_directory_of_pickles_is_refused_unread(root):
    folder = root / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    with pytest.raises(ValueError, match="never unpickles"):
        examine(folder)


def test_the_command_line_gates_on_findings(hf, root, capsys):
    from normkit.cli import main

    gguf = C.to_gguf(hf("gemma"), root / "cli.gguf", "gemma", bake=0.0)
    assert main(["doctor", str(gguf)]) == 1
    assert "offset_missing" in capsys.readouterr().out
    out = root / "cli.json"
    assert main(["doctor", str(hf("gemma")), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["findings"] == [] and data["format"] == "huggingface"
    assert main(["doctor", str(gguf), "--fix", str(root / "cli-fixed.gguf")]) == 2
    assert "--against" in capsys.readouterr().err
    assert main(["doctor", str(gguf), "--against", str(hf("gemma")), "--fix",
                 str(root / "cli-fixed.gguf")]) == 1
    assert "wrote" in capsys.readouterr().out
    assert main(["doctor", str(root / "cli-fixed.gguf"), "--against", str(hf("gemma"))]) == 0
    folder = root / "cli-pickled"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.pt").write_bytes(b"\x80\x04")
    assert main(["doctor", str(folder)]) == 2
    assert "never unpickles" in capsys.readouterr().err


def test_findings_are_the_documented_verdicts():
    assert FINDINGS == {"offset_doubled", "offset_missing", "eps_differs", "dtype_narrowed",
                        "weights_differ"}
