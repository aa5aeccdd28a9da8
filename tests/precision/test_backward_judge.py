"""The training check's judging as library calls, on rows built here: the first divergent module
walking backward, and the one failure in the check's order (first divergent module, an isolated
backward, the optimizer, the trajectory, the weights after it). (The check end to end, with
faults in real kernels: tests/checks/test_training.py.)"""

from __future__ import annotations

import json

from harness.precision import backward_judge as judge
from harness.precision.backward_judge import Row

ORDER = ["lm_head", "model.layers.1", "model.layers.0"]  # backward order: the head first
ENTRY = {"backward_order": ORDER, "params": {"lm_head.weight": {"group": "decay"},
                                             "model.layers.0.norm.weight": {"group": "no_decay"}}}
SPEC = {"optimizer": "fused", "steps": 2}
CALM = judge.Trajectory({"loss": [0.0, 1e-4]}, {"loss": [1e-3, 1e-3]})


def ok_rows() -> list[Row]:
    return [Row("gout", "lm_head", 1e-7, 1e-6), Row("gin", "model.layers.1", 1e-7, 1e-6),
            Row("param", "model.layers.0.norm.weight", 1e-7, 1e-6), Row("opt", "lm_head.weight", 1e-3, 1e-2)]


def fail(rs, traj=CALM, first=None):
    return judge.failure(rs, first, ENTRY, None, None, "bfloat16", SPEC, False, traj)


def test_the_first_divergent_module_received_an_agreeing_gradient():
    rs = ok_rows()
    assert judge.first_divergent(rs, ORDER) is None and fail(rs) is None
    rs[1] = Row("gin", "model.layers.1", 1e-3, 1e-6)
    m, row, why = judge.first_divergent(rs, ORDER)
    assert (m, row.name, why) == ("model.layers.1", "model.layers.1", "while the gradient it received agrees")
    f = fail(rs, first=(m, row, why))
    assert f.module == "model.layers.1" and f.message.startswith("model.layers.1: backward diverges from the golden")
    assert "isolated backward: no recorded inputs for it" in f.message and f.fields["tolerance"] == 1e-6
    assert f.fields["details"].splitlines()[0].startswith("FAIL gin")  # the table: failing rows first
    # the head's received gradient already wrong: the loss's own backward, named at the head
    rs[0] = Row("gout", "lm_head", 1e-3, 1e-6)
    rs.append(Row("gout", "model.layers.1", 1e-3, 1e-6))
    m, row, why = judge.first_divergent(rs, ORDER)
    assert (m, row.kind) == ("lm_head", "gout") and "before every captured module" in why
    assert judge.owner("model.layers.0.norm.weight", {m: i for i, m in enumerate(ORDER)}) == "model.layers.0"


def test_failures_come_in_the_checks_order():
    rs = ok_rows() + [Row("replay_gin", "model.layers.0", 1e-3, 1e-6), Row("upd", "model.layers.0.norm.weight", 1.0, 0.1)]
    rs[3] = Row("opt", "lm_head.weight", 1.0, 1e-2)
    out = judge.Trajectory({"loss": [0.0, 5e-3]}, {"loss": [1e-3, 1e-3]}, (1, "loss"))
    f = fail(rs, out)  # the isolated backward first
    assert f.module == "model.layers.0" and "isolated backward diverges from the golden" in f.message
    f = fail([r for r in rs if r.kind != "replay_gin"], out)
    assert f.module is None and f.message.startswith("optimizer: AdamW (fused) diverges from the float64 reference "
                                                     "in the decay group")
    f = fail([r for r in rs if r.kind not in ("replay_gin", "opt")], out)
    assert f.message == "loss trajectory leaves the reference's envelope at step 1 (loss deviation 0.005 > envelope 0.001)"
    assert f.fields["details"].splitlines()[0].split() == ["step", "loss"]
    f = fail([r for r in rs if r.kind not in ("replay_gin", "opt")])
    assert f.message.startswith("weights after 2 AdamW steps diverge from the reference in the no_decay group")
    assert "FAIL upd" in f.fields["details"]


def test_figures_and_plots():
    rs = ok_rows() + [Row("gin", "model.layers.0", 2e-6, None)]  # not resolvable: counted, not judged
    fig = judge.figures(rs, CALM)
    assert fig["training_backward_worst_budget_use"] == 0.1 and fig["training_backward_over_budget"] == 0
    assert fig["training_trajectory_worst_envelope_use"] == 0.1 and fig["training_trajectory_first_step_out"] == -1
    plots = judge.plots(rs, CALM, ORDER)
    # each module's worst use, backward order, its parameters' rows owned by it; unresolvable rows left out
    assert json.loads(plots["module_budget_use"]) == [["lm_head", 0.1], ["model.layers.1", 0.1], ["model.layers.0", 0.1]]
    assert json.loads(plots["trajectory"]) == {"loss": [[0.0, 0.001], [0.0001, 0.001]]}
    assert judge.rows({"gin": {"a": 1.0}, "gout": {"b": 2.0}}, lambda k, n: 3.0, "replay_") == [
        Row("replay_gin", "a", 1.0, 3.0), Row("replay_gout", "b", 2.0, 3.0)]
