"""The shipped op lists (harness/oplists/<backend>-<version>.txt) and their generator."""

from __future__ import annotations

import re

import pytest
import torch

from harness.cli import main
from harness.inspect.coverage import (
    COMPOSITE,
    FALLBACK,
    MISSING,
    NATIVE,
    classify_op,
    composite_kind,
    declared_op_lists,
    dispatcher_name,
    parse_op_list,
)
from harness.oplists.format import OPLIST_DIR
from harness.oplists.generate import BACKENDS, extract, packaged_native_functions

SHIPPED = {"cuda", "rocm", "xpu", "npu", "musa", "mlu"}
_OP = re.compile(r"^[a-z_][a-z0-9_]*\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+$")


def _has(op: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(dispatcher_name(op), key)
    except RuntimeError:
        return False


@pytest.fixture(scope="module")
def yaml_cpu_cuda():
    """The installed torch's packaged native_functions.yaml, read for the CPU and the CUDA key."""
    path = packaged_native_functions()
    return extract(path, "cpu", dispatch_key="CPU").ops, extract(path, "cuda").ops


def test_every_shipped_list_parses_with_provenance():
    lists = declared_op_lists()
    assert SHIPPED <= set(lists), sorted(lists)
    for backend in SHIPPED:
        for path in lists[backend]:
            ol = parse_op_list(path)
            meta = ol.meta
            assert meta["backend"] == backend and ol.version and path.name == f"{backend}-{ol.version}.txt"
            assert meta["dispatch_key"] == BACKENDS[backend].dispatch_key
            assert ol.unlisted == (FALLBACK if backend in ("npu", "mlu") else MISSING)
            assert re.fullmatch(r"\d+\.\d+\.\d+", meta["torch"])
            assert meta["source"], path
            for src in meta["source"]:  # repository, path, tag/commit (40 hex), date
                assert re.search(r"\b[0-9a-f]{40}\b", src) and re.search(r"\b20\d\d-\d\d-\d\d\b", src) or \
                    "packaged in" in src, src
                assert re.match(r"[\w.-]+/[\w.-]+ \S+\.(yaml|template)\b", src), src
            assert len(ol) > 500, (path, len(ol))
            assert all(_OP.match(op) for op in ol), [op for op in ol if not _OP.match(op)][:5]
            counts = dict(x.split() for x in meta["counts"].split(", "))
            tags = {"native": NATIVE, "composite": COMPOSITE, "fallback": FALLBACK}
            assert {k: sum(1 for t in ol.values() if t == tags[k]) for k in counts} == \
                {k: int(v) for k, v in counts.items()}


def test_yaml_reading_matches_the_cpu_dispatcher(yaml_cpu_cuda):
    """The generator's reading of native_functions.yaml (dispatch keys, structured delegates, ufunc
    kernels) gives exactly the CPU kernels this torch registers, except 8 quantized RNN overloads that
    ATen registers from C++ rather than from the YAML."""
    cpu_yaml = {op for op, t in yaml_cpu_cuda[0].items() if t == NATIVE}
    cpu_dispatcher = set(parse_op_list(OPLIST_DIR / "cpu.txt"))  # == `harness inspect --dump-op-list CPU`
    assert cpu_yaml <= cpu_dispatcher
    assert {op.split(".")[1] for op in cpu_dispatcher - cpu_yaml} == {"quantized_gru", "quantized_lstm"}


def test_cuda_list_agrees_with_the_dispatcher_on_cpu_cuda_pairs(yaml_cpu_cuda):
    """Every op whose CPU and CUDA registrations are both in the packaged YAML: the CPU dispatcher has
    the kernel and the cuda list says native. On a CUDA build the dispatcher is asked for CUDA too; on
    this CPU build torch registers no aten CUDA kernel at all (checked), so the YAML pairing stands in."""
    cpu, cuda = yaml_cpu_cuda
    shipped = parse_op_list(OPLIST_DIR / f"cuda-{torch.__version__.split('+')[0]}.txt")
    pairs = sorted(op for op, t in cpu.items() if t == NATIVE and cuda.get(op) == NATIVE)
    assert len(pairs) > 900
    for op in pairs:
        assert _has(op, "CPU"), op
        assert shipped.get(op) == NATIVE, op
        assert classify_op(op, op_list=shipped) == (NATIVE, "declared in op list")
    if torch.version.cuda:
        assert all(_has(op, "CUDA") for op in pairs)
    else:
        assert not any(_has(op, "CUDA") for op in pairs)
    # ops the list calls composite have a composite kernel in this torch (where it registers them)
    names = set(torch._C._dispatch_get_all_op_names())
    comp = [op for op, t in shipped.items() if t == COMPOSITE and dispatcher_name(op) in names and not _has(op, "CPU")]
    assert len(comp) > 1000
    assert [op for op in comp if not composite_kind(op)] == []


def test_rocm_and_cuda_differ_only_by_the_vendor_library_stubs():
    v = torch.__version__.split("+")[0]
    cuda, rocm = parse_op_list(OPLIST_DIR / f"cuda-{v}.txt"), parse_op_list(OPLIST_DIR / f"rocm-{v}.txt")
    assert {op.split(".")[1] for op in set(cuda) - set(rocm)} <= {
        n for n in {op.split(".")[1] for op in cuda} if re.match(r"_?cudnn", n)}
    assert {op.split(".")[1] for op in set(rocm) - set(cuda)} <= {
        n for n in {op.split(".")[1] for op in rocm} if n.startswith("miopen")}
    assert "aten.miopen_convolution.default" in rocm and "aten.cudnn_convolution.default" in cuda


def test_vendor_lists_carry_the_facts_the_sources_say():
    npu = parse_op_list(OPLIST_DIR / "npu-2.13.0.txt")
    assert npu["aten.mm.default"] == NATIVE and npu["npu.npu_format_cast.default"] == NATIVE
    assert npu.get("aten.scatter.src") == COMPOSITE  # structured functional over the listed scatter.src_out
    xpu = parse_op_list(OPLIST_DIR / "xpu-2.13.0.txt")
    assert xpu["aten.cholesky.default"] == FALLBACK  # XPUFallback.template's fallback_list
    assert xpu["aten.mm.default"] == NATIVE and xpu["aten.histc.default"] == NATIVE
    musa = parse_op_list(OPLIST_DIR / "musa-2.7.1.txt")
    assert musa["aten.cat.default"] == NATIVE  # structured `cat` listed with only a quantized dispatch
    mlu = parse_op_list(OPLIST_DIR / "mlu-1.25.0+torch2.4.1.txt")
    assert mlu["torchvision.nms.default"] == NATIVE and "aten._coalesce.default" not in mlu  # sparse only


# --- the generator on each vendor format ------------------------------------------------------------
def test_update_from_the_installed_torch_reproduces_the_shipped_cuda_list(tmp_path):
    out = tmp_path / "cuda.txt"
    assert main(["oplist", "update", "--backend", "cuda", "--from", "torch", "-o", str(out)]) == 0
    v = torch.__version__.split("+")[0]
    assert parse_op_list(out) == parse_op_list(OPLIST_DIR / f"cuda-{v}.txt")
    assert parse_op_list(out).meta["source"] == parse_op_list(OPLIST_DIR / f"cuda-{v}.txt").meta["source"]


def test_update_reads_each_vendor_format(tmp_path, capsys):
    stubs = tmp_path / "npu_native_functions.yaml"
    stubs.write_text("backend: NPU\ncpp_namespace: at_npu::native\nsupported:\n  - mm\n  - func: clone\n"
                     "    op_api: True\ncustom:\n  - func: npu_thing(Tensor self) -> Tensor\ntocpu:\n  - histc\n")
    plugin = tmp_path / "op_plugin_functions.yaml"
    plugin.write_text("all_version: [v2.1, v2.5, v2.6, v2.7]\nofficial:\n"
                      "  - func: silu(Tensor self) -> Tensor\n    op_api: all_version\n"
                      "  - func: topk(Tensor self, SymInt k) -> (Tensor, Tensor)\n    acl_op: [v2.1, v2.5]\n"
                      "  - func: sort(Tensor self) -> (Tensor, Tensor)\n    op_api: [v2.6, newest]\n"
                      "  - func: cumsum(Tensor self, int dim) -> Tensor\n    acl_op: v2.1, v2.6\n")
    out = tmp_path / "npu.txt"
    assert main(["oplist", "update", "--backend", "npu", "--from", str(stubs), "--from", str(plugin),
                 "--version", "2.6.0", "--source", "a/b x.yaml @ 1 (2026-01-01)", "--source", "c/d y.yaml @ 2",
                 "-o", str(out)]) == 0
    ol = parse_op_list(out)
    assert ol == {"aten.mm.default": NATIVE, "aten.clone.default": NATIVE, "npu.npu_thing.default": NATIVE,
                  "aten.histc.default": FALLBACK, "aten.silu.default": NATIVE, "aten.sort.default": NATIVE,
                  "aten.cumsum.default": NATIVE}  # topk: only up to v2.5
    assert ol.unlisted == FALLBACK and ol.meta["torch"] == "2.6.0" and ol.meta["version"] == "2.6.0"
    assert ol.meta["source"][0].startswith("a/b x.yaml @ 1 (2026-01-01)")
    assert classify_op("aten.topk.default", op_list=ol)[0] == FALLBACK  # npu runs unlisted ops on the host

    musa = tmp_path / "musa_functions.yaml"
    musa.write_text("- func: cat\n  dispatch:\n    QuantizedPrivateUse1: CatQ\n- func: cat.out\n"
                    "  dispatch:\n    PrivateUse1: CatOut\n- func: _coalesce\n  dispatch:\n    SparsePrivateUse1: C\n"
                    "- func: silu\n")
    mlu = tmp_path / "mlu_functions.yaml"
    mlu.write_text("aten:\n  - func: mm\n  - func: _coalesce\n    dispatch: SparsePrivateUse1\n"
                   "vision:\n  - func: nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor\n"
                   "custom:\n  - func: fused_sgd(Tensor a) -> bool\n")
    fb = tmp_path / "XPUFallback.template"
    fb.write_text('TORCH_LIBRARY_IMPL(aten, XPU, m) {\n  std::vector<std::string> fallback_list = {\n'
                  '    "cholesky",\n    // "geqrf",\n    "linalg_eig.out",\n  };\n}\n')
    for backend, src, version, want in (
            ("musa", musa, "2.7.1", {"aten.cat.default": NATIVE, "aten.cat.out": NATIVE, "aten.silu.default": NATIVE}),
            ("mlu", mlu, "1.25.0+torch2.4.1", {"aten.mm.default": NATIVE, "torchvision.nms.default": NATIVE,
                                               "torch_mlu.fused_sgd.default": NATIVE}),
            ("xpu", fb, "2.13.0", {"aten.cholesky.default": FALLBACK, "aten.linalg_eig.out": FALLBACK})):
        out = tmp_path / f"{backend}.txt"
        assert main(["oplist", "update", "--backend", backend, "--from", str(src), "--version", version,
                     "-o", str(out)]) == 0, capsys.readouterr().err
        got = parse_op_list(out)
        assert {k: v for k, v in got.items() if v != COMPOSITE} == want, backend
    assert parse_op_list(tmp_path / "mlu.txt").meta["torch"] == "2.4.1"


def test_update_rejects_bad_input_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")
    assert main(["oplist", "update", "--backend", "npu", "--from", str(bad), "--version", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"harness oplist: {bad}: not valid YAML") and "\n" not in err
    plugin = tmp_path / "p.yaml"
    plugin.write_text("all_version: [v2.1]\nofficial: []\n")
    assert main(["oplist", "update", "--backend", "npu", "--from", str(plugin), "--version", "2.9.0"]) == 2
    assert "has no version 'v2.9'" in capsys.readouterr().err
    assert main(["oplist", "update", "--backend", "npu", "--from", str(tmp_path / "nope.yaml"),
                 "--version", "1"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["oplist", "update", "--backend", "mydev", "--from", str(plugin), "--version", "1"]) == 2
    assert "pass --dispatch-key" in capsys.readouterr().err


def test_show_lists_the_bundled_lists(capsys):
    assert main(["oplist", "show", "--backend", "npu"]) == 0
    out = capsys.readouterr().out
    assert "npu 2.13.0: npu-2.13.0.txt" in out and "Ascend/op-plugin" in out
