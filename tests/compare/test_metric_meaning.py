"""Every result carries its own meaning: a metric's unit and direction travel inside the JUnit XML
the run wrote (``harness.meaning.*``), so ``harness compare`` finds the same regressions wherever it
runs - from a folder with no suites (no check imported) as from the repository root.

The results come from the real writer inside a real pytest session: the harness plugin with
``--harness-results`` (what ``harness run`` passes), over items that record the properties a check
records. Each comparison runs in a fresh interpreter, so no check module this test process imported
can lend it a direction.
"""

from __future__ import annotations

import html
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness import metrics
from harness.compare.junit import read_results

ROOT = Path(__file__).resolve().parents[2]  # the repository root: suites/ (whose loading imports the checks)

# Two metrics whose direction only their check's declaration knows (no name suffix gives it away):
# each regresses in the current run. A budget use going up and a loss drop going down are both worse.
BUDGET = "training_backward_worst_budget_use"
BASE = {"training": {BUDGET: 0.2, "wall_time_s": 3.0},
        "smoke": {"loss_drop": 1.5, "wall_time_s": 2.0, "mystery_count": 4.0}}
CUR = {"training": {BUDGET: 0.6, "wall_time_s": 3.0},
       "smoke": {"loss_drop": 0.3, "wall_time_s": 2.0, "mystery_count": 9.0}}

_ITEMS = textwrap.dedent('''
    import json, os, pytest

    SPEC = json.loads(os.environ["MEANING_TEST_SPEC"])

    @pytest.mark.parametrize("name", sorted(SPEC))
    def test_item(name, record_property):
        for k, v in SPEC[name]:
            record_property(k, v)
''')


def _env() -> dict[str, str]:
    # nothing of this test session (its xdist worker, a settings file, extra suite folders) leaks in
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_", "HARNESS_"))} | {
        "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}


def _run_results(folder: Path, values: dict[str, dict[str, float]]) -> Path:
    """A real pytest session with harness's plugin and results writer; returns its junit.xml."""
    folder.mkdir(parents=True)
    (folder / "test_items.py").write_text(_ITEMS)
    spec = {}
    for check, ms in values.items():
        props = metrics.meta_properties("tiny", check, "cpu", "float32", "cpu")
        spec[check] = props + [metrics.metric_property(k, v) for k, v in ms.items()]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--harness-results",
                        str(folder / "results"), "test_items.py"], cwd=folder, capture_output=True, text=True,
                       env=_env() | {"MEANING_TEST_SPEC": json.dumps(spec)}, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return folder / "results" / "junit.xml"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("meaning")
    return _run_results(tmp / "base", BASE), _run_results(tmp / "cur", CUR)


def _compare(cwd: Path, out: Path, cur: Path, base: Path) -> dict:
    """``harness compare`` in a fresh interpreter in ``cwd``; what it found, filed and kept."""
    out.mkdir(parents=True)
    history = out / "h.sqlite"
    r = subprocess.run([sys.executable, "-m", "harness", "compare", str(cur), "--baseline", str(base),
                        "--history", str(history), "--min-bad-runs", "1", "--sink", "file", "--out-dir",
                        str(out / "issues"), "--mute-file", "", "--run-id", "r1", "--summary", str(out / "s.md")],
                       cwd=cwd, capture_output=True, text=True, env=_env(), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    filed = out / "issues" / "issues.json"  # written when an issue is
    state = json.loads(filed.read_text()) if filed.exists() else {}
    bodies = html.unescape("\n".join(i["body"] for i in state.values()))
    db = sqlite3.connect(history)
    kept = {n for (n,) in db.execute("SELECT DISTINCT name FROM metrics")}
    db.close()
    return {"titles": sorted(i["title"] for i in state.values()),
            "regressed": sorted(m for m in (BUDGET, "loss_drop", "wall_time_s", "mystery_count") if m in bodies),
            "history": sorted(kept), "stderr": r.stderr}


def test_compare_finds_the_same_regressions_from_an_empty_folder_as_from_the_repository(runs, tmp_path):
    base, cur = runs
    empty = tmp_path / "empty"
    empty.mkdir()
    away = _compare(empty, tmp_path / "away", cur, base)
    assert list(empty.iterdir()) == []  # it wrote nothing where it ran, and found no suites there
    home = _compare(ROOT, tmp_path / "home", cur, base)
    assert away["regressed"] == sorted([BUDGET, "loss_drop"]), away
    assert away["titles"] == ["[harness] performance regression: tiny on cpu"], away
    assert {k: away[k] for k in ("titles", "regressed", "history")} == \
        {k: home[k] for k in ("titles", "regressed", "history")}
    # the history keeps what has a direction, by the run's own word: both budget and loss drop
    assert {BUDGET, "loss_drop", "wall_time_s"} <= set(away["history"])
    assert "no meaning" not in away["stderr"] + home["stderr"]


def test_report_from_an_empty_folder_shows_the_regressions(runs, tmp_path):
    base, cur = runs
    r = subprocess.run([sys.executable, "-m", "harness", "report", str(cur), "--baseline", str(base), "--history",
                        "", "--min-bad-runs", "1", "-o", str(tmp_path / "r.html")], cwd=tmp_path, capture_output=True,
                       text=True, env=_env(), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    page = html.unescape((tmp_path / "r.html").read_text())
    assert "loss_drop" in page and BUDGET in page and "metric regression" in page


def test_the_writer_puts_one_meaning_per_metric_in_each_file(runs):
    _base, cur = runs
    suite = ET.parse(cur).getroot().find("testsuite")
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    meanings = {k: v for k, v in props.items() if k.startswith(metrics.PREFIX_MEANING)}
    # one per distinct metric of the file, at the testsuite level, none per test case
    assert sorted(meanings) == [metrics.PREFIX_MEANING + n for n in sorted({m for ms in CUR.values() for m in ms})]
    assert not [p for p in suite.iter("property") if p.get("name").startswith(metrics.PREFIX_MEANING)
                and p not in suite.find("properties")]
    import harness.checks.smoke  # noqa: F401 - declares loss_drop, as the run's own process had
    import harness.checks.training  # noqa: F401

    for name in (BUDGET, "loss_drop", "wall_time_s"):
        assert metrics.parse_meaning(metrics.PREFIX_MEANING + name, meanings[metrics.PREFIX_MEANING + name]) == \
            metrics.spec(name)
    # a metric nobody declared still says how it was judged, and that it was a guess
    mystery = json.loads(meanings[metrics.PREFIX_MEANING + "mystery_count"])
    assert mystery["direction"] == "none" and "not declared" in mystery["description"]
    assert read_results([str(cur)]).meanings["loss_drop"].direction == "higher"


def test_older_results_without_meanings_fall_back_and_say_so(runs, tmp_path):
    """XML written before results carried meanings: judged by the comparing process's declarations or
    the name's suffix - in one warning line naming the metrics, never silently."""
    _base, cur = runs
    old = tmp_path / "old.xml"
    tree = ET.parse(cur)
    sp = tree.getroot().find("testsuite").find("properties")
    for p in [p for p in sp if p.get("name").startswith(metrics.PREFIX_MEANING)]:
        sp.remove(p)
    tree.write(old)
    base_old = tmp_path / "base-old.xml"
    shutil.copy(old, base_old)
    r = subprocess.run([sys.executable, "-m", "harness", "compare", str(old), "--baseline", str(base_old),
                        "--history", "", "--summary", str(tmp_path / "s.md")], cwd=tmp_path, capture_output=True,
                       text=True, env=_env(), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    note = [line for line in r.stderr.splitlines() if "no meaning" in line]
    assert len(note) == 1 and "loss_drop" in note[0] and BUDGET in note[0], r.stderr
    assert "no meaning" in (tmp_path / "s.md").read_text()


def test_shards_that_disagree_on_a_meaning_are_a_warning(runs, tmp_path):
    base, cur = runs
    other = tmp_path / "other.xml"
    text = cur.read_text()
    marker = f'name="{metrics.PREFIX_MEANING}loss_drop" value="{{&quot;unit&quot;:&quot;nats&quot;,' \
             '&quot;direction&quot;:&quot;higher&quot;'
    assert marker in text
    other.write_text(text.replace(marker, marker.replace("higher", "lower")))
    res = read_results([str(base), str(other)])
    assert res.meanings["loss_drop"].direction == "higher"  # the first file's word
    assert [w for w in res.warnings if "'loss_drop' means lower" in w and str(other) in w]
    broken = tmp_path / "broken.xml"
    broken.write_text(text.replace(marker, f'name="{metrics.PREFIX_MEANING}loss_drop" value="{{oops'))
    res = read_results([str(broken)])
    assert "loss_drop" not in res.meanings and [w for w in res.warnings if "loss_drop" in w]


def test_a_cut_off_file_keeps_the_meanings_written_before_its_cases(runs, tmp_path):
    _base, cur = runs
    text = cur.read_text()
    cut = tmp_path / "cut.xml"
    cut.write_text(text[: text.index("</testcase>") + len("</testcase>") + 20])
    res = read_results([str(cut)])
    assert res.partial and len(res.cases) == 1
    assert res.meanings["loss_drop"].direction == "higher" and res.meanings[BUDGET].direction == "lower"
