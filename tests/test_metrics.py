"""The naming convention: properties in, parsed back; metric directions."""

from __future__ import annotations

import math

import pytest

from harness import metrics


def test_round_trip_of_properties():
    props = metrics.meta_properties("kimi-k2", "smoke", "cpu", "float32", "x86_64", "tp2")
    props += [metrics.metric_property("loss_final", 4.25), metrics.metric_property("nan_metric", math.nan),
              metrics.tolerance_property("rel_rmse", 1e-5), metrics.detail_property("notes", "a; b")]
    p = metrics.parse_properties(props)
    assert p["meta"] == {"suite": "kimi-k2", "check": "smoke", "backend": "cpu", "dtype": "float32",
                         "device": "x86_64", "variant": "tp2"}
    assert p["metrics"]["loss_final"] == 4.25 and math.isnan(p["metrics"]["nan_metric"])
    assert p["tolerances"] == {"rel_rmse": 1e-5}
    assert p["details"] == {"notes": "a; b"}


@pytest.mark.parametrize("name,direction", [
    ("wall_time_s", "lower"), ("peak_memory_bytes", "lower"), ("loss_drop", "higher"),
    ("tokens_per_s", "higher"), ("prefill_time_s", "lower"), ("some_rmse", "lower"),
    ("logits_cosine", "higher"), ("parameters", "none"), ("mystery", "none")])
def test_directions(name, direction):
    import harness.checks.smoke  # noqa: F401 - declares the smoke metrics

    assert metrics.direction(name) == direction


def test_redeclaring_differently_is_an_error():
    metrics.declare("test_only_metric", "s", "lower", "x")
    metrics.declare("test_only_metric", "s", "lower", "x")  # identical: fine
    with pytest.raises(ValueError, match="declared twice"):
        metrics.declare("test_only_metric", "s", "higher", "x")
