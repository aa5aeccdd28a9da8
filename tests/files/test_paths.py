"""Every place harness joins a path with a value read from a file (suite, perf sidecar, weights
manifest, safetensors index, JUnit) refuses ``..``, absolute paths, symlinks out of the root and
NUL, through the public functions and the ``harness`` CLI; and a guard that fails when new code
joins a path with a non-constant value outside the known, checked sites."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from harness.cli import main as harness_main
from harness.files import paths
from harness.golden import store
from harness.parallel.layouts import Layout, layout_dir
from harness.suite.loader import SuiteError, load_suite
from harness.weights.layout import WeightsError, open_checkpoint
from harness.weights.manifest import verify

REPO = Path(__file__).resolve().parents[2]
BAD = ["..", "../../../../elsewhere/escape", "/etc/escape", "a\x00b", "", ".hidden", "a/b"]


# --- the helper itself ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", BAD + [None, 3, "x" * 300])
def test_a_name_that_is_not_a_plain_component_is_refused_in_one_line(value):
    with pytest.raises(paths.PathRefused) as e:
        paths.name(value, source="suites/x.toml", field="model.name")
    assert str(e.value).startswith("suites/x.toml: model.name: ") and "\n" not in str(e.value)


def test_plain_names_and_relative_paths_pass(tmp_path):
    assert paths.name("kimi-k2", source="f", field="k") == "kimi-k2"
    assert paths.join(tmp_path, "sub/model-00001-of-00002.safetensors", source="f", field="k", plain=False) \
        == tmp_path / "sub" / "model-00001-of-00002.safetensors"


def test_a_symlink_inside_the_root_that_leaves_it_is_refused(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path / "outside")
    for plain, value in ((True, "link"), (False, "link/secret.safetensors")):
        with pytest.raises(paths.PathRefused, match="outside"):
            paths.join(tmp_path / "root", value, source="f", field="k", plain=plain)


# --- the join sites, each with every bad value ----------------------------------------------------
def _suite(tmp_path, body: str) -> Path:
    cfg = REPO / "suites" / "configs"
    conf = next(cfg.glob("*Llama*.json"))
    p = tmp_path / "s.toml"
    p.write_text(f'[model]\nconfig = "{conf}"\n{body}\n')
    return p


@pytest.mark.parametrize("value", BAD[:4] + [".hidden"])
def test_site_suite_model_name_golden_dir_and_precision_plots(tmp_path, value):
    with pytest.raises(SuiteError, match="model.name"):  # the suite refuses it before anything runs
        load_suite(_suite(tmp_path, f"name = {json.dumps(value)}"))
    with pytest.raises(store.GoldenError):  # and golden's own gate, for a name from anywhere else
        store.golden_dir(value, tmp_path)


@pytest.mark.parametrize("value", BAD[:4] + [".hidden"])
def test_site_parallel_layout_name_ranks_result_folder(tmp_path, value):
    p = _suite(tmp_path, f"[[checks.parallel.configs]]\ntp = 2\nname = {json.dumps(value)}")
    with pytest.raises(SuiteError, match=r"checks.parallel.configs\[0\].name"):
        load_suite(p)
    with pytest.raises(paths.PathRefused):  # the spec file the ranks read builds Layouts too
        Layout(tp=2, name=value)
    assert not list(tmp_path.parent.glob("**/escape"))


def test_site_parallel_layout_folder_symlinked_out(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tp2").symlink_to(tmp_path)
    with pytest.raises(paths.PathRefused, match="outside"):
        layout_dir(tmp_path / "run", Layout(tp=2))


def _sidecar(results: Path, **over) -> Path:
    rec = {"format": 1, "suite": "kimi-k2", "key": "cpu-float32", "backend": "cpu", "dtype": "float32",
           "fingerprint": {"backend": "cpu"}, "samples": {"forward_s": [0.1, 0.1]}, **over}
    d = results / "perf" / "kimi-k2"
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"sidecar-{len(list(d.iterdir()))}.json"  # the file's own name is not what is tested
    p.write_text(json.dumps(rec))
    return p


@pytest.mark.parametrize("field", ["suite", "key"])
@pytest.mark.parametrize("value", BAD[:4])
def test_site_perf_sidecar_to_baseline_update(tmp_path, capsys, field, value):
    results, golden = tmp_path / "results", tmp_path / "repo" / "golden"
    _sidecar(results, **{field: value if field == "suite" else value})
    _sidecar(results, key="cpu-bfloat16")  # a good one beside it keeps its result
    code = harness_main(["baseline", "update", str(results), "--golden-dir", str(golden)])
    err = capsys.readouterr()
    assert code == 1 and f"{field}: " in err.err and "refused" in err.err
    written = [p for p in tmp_path.rglob("*.json") if "results" not in p.parts]
    assert all(p.is_relative_to(golden / "perf" / "kimi-k2") for p in written) and written


# (XML 1.0 cannot carry a NUL: such a file does not parse, and is skipped as bad XML)
@pytest.mark.parametrize("value", ["../../../../elsewhere/victim.json", "/etc/passwd"])
def test_site_junit_perf_samples_property(tmp_path, capsys, value):
    results = tmp_path / "results"
    _sidecar(results)
    (results / "junit.xml").write_text(
        '<testsuites><testsuite><testcase name="perf[cpu-float32]"><properties>'
        f'<property name="harness.detail.perf_samples" value={json.dumps(value)}/>'
        "</properties></testcase></testsuite></testsuites>")
    code = harness_main(["baseline", "update", str(results), "--golden-dir", str(tmp_path / "golden")])
    out = capsys.readouterr()
    assert code == 1 and "junit.xml: harness.detail.perf_samples: " in out.err and "outside" in out.err
    assert "1 item(s)" in out.out  # the sidecar in the results dir still becomes the baseline


def _ckpt(d: Path) -> None:
    d.mkdir(parents=True)
    save_file({"w": torch.zeros(2, 2)}, str(d / "model-00001-of-00001.safetensors"))


@pytest.mark.parametrize("value", ["../outside/secret.safetensors", "/tmp/secret.safetensors", "a\x00b",
                                   "link/secret.safetensors"])
def test_site_safetensors_index_weight_map(tmp_path, value):
    d = tmp_path / "ckpt"
    _ckpt(d)
    (tmp_path / "outside").mkdir()
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "outside" / "secret.safetensors"))
    (d / "link").symlink_to(tmp_path / "outside")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": value}}))
    with pytest.raises(WeightsError, match=r"model.safetensors.index.json: weight_map\['w'\]"):
        open_checkpoint(d)


@pytest.mark.parametrize("value", ["../outside/secret.safetensors", "/etc/passwd", "a\x00b", "link/secret.safetensors"])
def test_site_weights_manifest_files(tmp_path, value):
    d = tmp_path / "ckpt"
    _ckpt(d)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.safetensors").write_bytes(b"x")
    (d / "link").symlink_to(tmp_path / "outside")
    ck = open_checkpoint(d)
    problems = verify(ck, {"files": {value: {"bytes": 1, "sha256": "0" * 64}}}, checksums=False)
    assert any("harness-manifest.json: files[" in p for p in problems), problems


def test_site_checkpoint_shard_symlinked_out_of_the_folder(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "secret.safetensors"))
    (d / "model.safetensors").symlink_to(tmp_path / "secret.safetensors")
    with pytest.raises(WeightsError, match="outside"):
        open_checkpoint(d)


def test_hf_cache_snapshot_symlinks_into_blobs_still_load(tmp_path):
    repo = tmp_path / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    save_file({"w": torch.zeros(2, 2)}, str(repo / "blobs" / "0123"))
    (repo / "snapshots" / "abc" / "model.safetensors").symlink_to("../../blobs/0123")
    assert "w" in open_checkpoint(repo / "snapshots" / "abc").tensors


# --- the guard ------------------------------------------------------------------------------------
# Every `a / b` path join (and os.path.join) in harness/ whose right side is not a constant string,
# with why it is safe. A new join of a non-constant value fails here until it goes through
# harness.files.paths (paths.join / paths.name) or is added with its reason.
CHECKED = {
    # constants and numbers in f-strings: never data
    'f"rank{r}', 'f"status-{r}', 'f"exit-{r}', 'f"shard-{k}', "f'shard-{k}", 'f"w{world}-launch{n}',
    'f"rank{self.rank}', 'f"rank{rank}', 'f"exit-{rank}', 'f"status-{rank}', 'f"issue-{number}', "MANIFEST_NAME", "INDEX_NAME", "CURRENT",
    "RESERVE", "LOCK_NAME",
}
ALLOWED = {
    ("harness/launch/channel.py", "os.path.join(base, f)"): "os.walk's own entries under the rank's run folder",
    ("harness/launch/channel.py", "os.path.join(self.run_dir, rel)"): "rel: a file os.walk found in the run folder",
    ("harness/launch/nodes.py", 'root / f"node{k}"'): "k is a node index (an int)",
    ("harness/launch/noderun.py", "Path(path) / scratch.OWNER"): "path passed paths.join in resolve(); OWNER a constant",
    ("harness/launch/nodes.py", "self.run_dir / name"): "name: LaunchSpec.stage, the caller's constant file names",
    ("harness/checks/comm.py", 'Path(d) / spec["out"]'): 'spec["out"] is the check\'s constant "out/rank0.json"',
    ("harness/perf/comm.py", 'os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), spec["out"])'):
        "the comm check's own spec, written a moment before by the check",
    ("harness/cli/run_slurm.py", 'results / f"slurm-{job}.out"'): "job: the digits sbatch --parsable printed",
    ("harness/checks/weights.py", "ctx.suite.path.parent / cfg.manifest"): "a location the suite author chooses",
    ("harness/cli/init.py", 'out_dir / f"{name}.toml"'): "name is slug() of a command-line argument",
    ("harness/golden/store.py", "path / name"): "name matched VERSION_RX (v-<time>-<id>) just before",
    ("harness/golden/store.py", 'folder / f"{fname}.safetensors"'): "fname is one of FILES (constants)",
    ("harness/golden/store.py", "path / version"): "version is _new_version()'s own v-<time>-<id>",
    ("harness/golden/store.py", "current_dir(path) / fname"): "fname is one of FILES (constants)",
    ("harness/golden/store.py", "g.path / fname"): "fname is one of FILES (constants), for a message",
    ("harness/golden/store.py", "ls.path.parent.parent / path"): "path is golden_dir()'s checked result",
    ("harness/oplists/generate.py", 'OPLIST_DIR / f"{backend}-{safe}.txt"'): "backend is a registered name",
    ("harness/run/results.py", "self.dir / name"): "names of the results writer's own files (constants)",
    ("harness/suite/loader.py", "path.parent / suite.model.config"): "a location the suite author chooses",
    ("harness/suite/loader.py", "path.parent / suite.model.weights"): "a location the suite author chooses",
    ("harness/suite/loader.py", "self.path.parent / os.path.expanduser(w)"): "a location (suite or its env var)",
    ("harness/suite/loader.py", 'Path(root) / f"{n}.toml"'): "n is a command-line suite name",
    ("harness/suite/loader.py", 'd / f"{n}.toml"'): "n is a command-line suite name",
    ("harness/weights/layout.py", "root / shard"): "shards passed shard_path() in open_checkpoint",
    ("harness/weights/layout.py", "root / s"): "shards passed shard_path() in open_checkpoint",
    ("harness/weights/layout.py", "self.root / s"): "shards passed shard_path() in open_checkpoint",
    ("harness/weights/manifest.py", "ckpt.root / f"): "ckpt.shards passed shard_path() in open_checkpoint",
    ("harness/parallel/worker.py", "os.path.join(run_dir, lay.label)"): "Layout() refuses a name that is "
                                                                        "not plain (layouts.py __post_init__)",
    ("harness/checks/serve.py", 'root / "runs" / f"{ctx.suite.name}-{ctx.backend.name}-{ctx.dtype}"'):
        "a loaded suite's name (its file's stem), a registered backend and a DTYPES value",
    ("harness/serve/engine.py", "Path(root or DEFAULT_ROOT) / engine.name"): "an engine build's name, checked as "
    "a plain name when it is registered (EngineRegistry.add: paths.name)",
    ("harness/serve/engine.py", 'd.parent / f"{engine.name}-setup.log"'): "the same checked build name",
    ("harness/serve/engine.py", "self.base / p"): "a pins or runner path the user's own harness.toml declares, "
    "relative to that file (as a backend's op_list): the user's configuration, not data someone else wrote",
    ("harness/serve/export.py", 'Path(root) / f"{ls.name}-{dtype}"'):
        "a loaded suite's name (its file's stem) and a DTYPES value",
    ("harness/backends/__init__.py", "Path.cwd() / p"): "an op-list location from harness.toml (settings)",
    ("harness/compare/junit.py", 'os.path.join(p, "**", "*.xml")'): "p is a command-line argument",
    ("harness/cli/server.py", "os.path.join(root, f)"): "os.walk of harness's own package folder (the server's "
                                                        "key: stat only)",
}


def _joins(root: Path = REPO):
    import re

    pathy = re.compile(r"(dir|root|path|folder|base|parent|ckpt|home|out|cache|logs|golden|"
                       r"(Path|_root|_dir|cwd)\(.*\))$", re.I)
    for f in sorted((root / "harness").rglob("*.py")):
        src = f.read_text(encoding="utf-8")
        rel = f.relative_to(root).as_posix()
        # ast.get_source_segment splits the whole file into lines on every call (25 s over harness/
        # for this walk); the lines once, as UTF-8 bytes (col_offset counts bytes)
        lines = [(line + "\n").encode() for line in src.split("\n")]

        def segment(node, lines=lines):
            a, b = node.lineno - 1, node.end_lineno - 1
            if a == b:
                return lines[a][node.col_offset:node.end_col_offset].decode()
            return b"".join([lines[a][node.col_offset:], *lines[a + 1:b], lines[b][:node.end_col_offset]]).decode()

        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                left, right = segment(node.left), segment(node.right)
                if isinstance(node.right, ast.Constant) or not (
                        isinstance(node.right, ast.JoinedStr) or pathy.search(left.splitlines()[-1])):
                    continue
                if isinstance(node.right, ast.Name) and node.right.id.isupper() or any(c in right for c in CHECKED):
                    continue
                yield rel, f"{left} / {right}", node.lineno
            elif (isinstance(node, ast.Call) and segment(node.func) == "os.path.join"
                  and not all(isinstance(a, ast.Constant) for a in node.args[1:])):
                text = segment(node)
                if not any(c in text for c in CHECKED):
                    yield rel, text, node.lineno


def test_every_path_join_of_a_non_constant_value_is_a_checked_site():
    # the left operand of a join like `a / b / c` is itself a join: only the outermost right part is new
    new = [f"{rel}:{line}: {text}" for rel, text, line in _joins()
           if not any(rel == f and text.endswith(t) for f, t in ALLOWED)
           and not any(rel == f and t in text for f, t in ALLOWED)]
    assert not new, ("path joins of non-constant values that bypass harness.files.paths (use paths.join, or "
                     "add the site to ALLOWED with why its value is not data):\n" + "\n".join(new))


def test_the_guard_sees_a_new_unchecked_join(tmp_path, monkeypatch):
    # the guard is not vacuous: a join of a value read from JSON is found. The probe lives in a copy
    # of the tree's shape, not in harness/ itself, where every other test (and `harness server`'s key,
    # which hashes harness's sources) would see it come and go under pytest-xdist.
    bad = tmp_path / "harness" / "files" / "_guard_probe_tmp.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f(root, rec):\n    return root / rec['suite']\n")
    assert [(rel, text) for rel, text, _ in _joins(tmp_path)] == [("harness/files/_guard_probe_tmp.py",
                                                                   "root / rec['suite']")]
