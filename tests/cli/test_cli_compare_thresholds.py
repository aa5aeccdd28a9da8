"""`harness compare` takes a suite's own metric thresholds from its TOML; the command line wins."""

from __future__ import annotations

import shutil

from harness.cli import build_parser
from harness.cli.compare import config_from
from tests_support import REPO_SUITES, TINY_PRUNE


def test_suite_thresholds_reach_the_comparator(tmp_path, monkeypatch):
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    (tmp_path / "suites" / "tiny.toml").write_text(
        "[thresholds]\nwall_time_s = 0.25\nloss_final = 0.05\n"
        "[model]\nconfig = 'configs/Llama-3.1-8B.json'\n" + TINY_PRUNE)
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["compare", "x.xml", "--metric-threshold", "tiny:loss_final=0.5"])
    cfg = config_from(args)
    assert cfg.threshold_for("tiny", "wall_time_s") == 0.25
    assert cfg.threshold_for("tiny", "loss_final") == 0.5  # command line over the suite
    assert cfg.threshold_for("other", "wall_time_s") == args.threshold
