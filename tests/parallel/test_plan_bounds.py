"""`harness plan` refuses inputs no cluster has, and never plans more context-parallel ranks than tokens."""

from __future__ import annotations

import pytest

from harness.cli import main as harness_main


@pytest.mark.parametrize("args, needle", [(["--devices", "8", "--device-memory", "0"], "--device-memory must be > 0"),
                                          (["--devices", "99999999", "--device-memory", "80GiB"], "--devices must be"),
                                          (["--devices", "8", "--device-memory", "80GiB", "--nodes", "200000"],
                                           "--devices x --nodes must be")])
def test_plan_refuses_physically_meaningless_inputs(capsys, args, needle):
    assert harness_main(["plan", "llama-3.1-8b", *args]) == 2
    assert needle in capsys.readouterr().err


def test_cp_never_exceeds_the_tokens(capsys):
    assert harness_main(["plan", "llama-3.1-8b", "--devices", "1024", "--device-memory", "80GiB",
                         "--context", "4", "--json", "-"]) == 0
    import json

    rep = json.loads(capsys.readouterr().out)
    assert rep["layouts"] and max(x["degrees"]["cp"] for x in rep["layouts"]) <= 4
