"""The launcher's account of a launch (harness.parallel.launcher.launch), its torchrun launches
replaced by what they leave: the rank records in the run folder and how the launch ended."""

from __future__ import annotations

import json

from harness.parallel import launcher
from harness.parallel.layouts import Layout, layout_dir


def _ended_writing_every_layout(infra: str):
    def one_launch(spec, layouts, world, run_dir, timeout_s, startup_s, on_done=None, stop=None):
        for lay in layouts:
            d = layout_dir(run_dir, lay)
            d.mkdir(parents=True)
            for r in range(world):
                (d / f"rank{r}.json").write_text(json.dumps({"rank": r}))
        return "exited", [], {r: {"code": 0} for r in range(world)}, 1.0, infra, {}
    return one_launch


def test_a_node_problem_after_every_layout_reported_is_a_warning_on_each_not_lost(tmp_path, monkeypatch):
    # the launch store could not bring back a file a rank sent, yet every layout's results arrived: the
    # launcher read the nodes' account only when layouts were missing, so this one was said nowhere
    lost = "the launch store could not bring back 1 file(s): rank 3's ../escape.json: outside the run folder"
    monkeypatch.setattr(launcher, "_one_launch", _ended_writing_every_layout(lost))
    lays = [Layout(tp=2), Layout(dp=2)]
    rep = launcher.launch({}, lays, 2, tmp_path)
    assert [o.status for o in rep.outcomes.values()] == ["ok", "ok"] and rep.launches == 1
    for o in rep.outcomes.values():
        assert o.warnings == [f"every layout reported, results kept; the launch's nodes: {lost}"], o.warnings
    monkeypatch.setattr(launcher, "_one_launch", _ended_writing_every_layout(""))
    assert all(not o.warnings for o in launcher.launch({}, lays, 2, tmp_path / "clean").outcomes.values())
