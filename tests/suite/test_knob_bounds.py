"""Every number of every check's table is bounded where it enters (issue #49: `checks.decode.steps =
10**9` and `compile.prompt_lens = [10**9]` passed `harness validate`, then `golden generate` allocated
until MemoryError; TOML's `nan` and `inf` were taken as tolerances and time limits). The rule holds by
construction (CheckConfig's validator), and this test holds it for every knob of every registered
check, a vendor's included: a count of 10**9 and NaN/inf are refused, naming the key."""

from __future__ import annotations

import math
import typing

import pytest
from pydantic import ValidationError

from harness.checks import registry
from harness.cli import main
from tests_support import TINY_PRUNE

TOO_BIG = 10**9


def _numeric_knobs():
    for name in registry().names():
        model = registry().get(name).config_model
        for key, field in model.model_fields.items():
            kinds = {a for a in typing.get_args(field.annotation) or (field.annotation,)}
            inner = {a for k in kinds for a in typing.get_args(k)} if any(typing.get_origin(k) in (list, dict)
                                                                          for k in kinds) else set()
            origin = {typing.get_origin(k) for k in kinds}
            for t in (int, float):
                if t in kinds:
                    yield name, model, key, t, None
                elif t in inner and (list in origin or dict in origin):
                    yield name, model, key, t, "list" if list in origin else "dict"


KNOBS = sorted({(n, k, t.__name__, c) for n, _m, k, t, c in _numeric_knobs()})


def test_there_are_many_knobs_to_hold():
    assert len(KNOBS) > 60, KNOBS


@pytest.mark.parametrize("check,key,kind,container", KNOBS)
def test_every_numeric_knob_refuses_a_huge_value_and_nan(check, key, kind, container):
    model = registry().get(check).config_model
    big = TOO_BIG if kind == "int" else 1e300
    bad = [big] + ([math.nan, math.inf] if kind == "float" else [])
    for v in bad:
        value = [v] if container == "list" else {"float32": v} if container == "dict" else v
        with pytest.raises(ValidationError) as e:
            model.model_validate({key: value})
        assert key in str(e.value), str(e.value)


@pytest.mark.parametrize("table,line", [("decode", "steps = 1000000000"), ("compile", "prompt_lens = [1000000000]"),
                                         ("precision", "budget_k = nan"), ("serve", "timeout_s = inf")])
def test_validate_refuses_the_issues_examples(write_suite, capsys, table, line):
    path = write_suite(f"knob{table}", f'[model]\nconfig = "configs/Llama-3.1-8B.json"\n{TINY_PRUNE}\n'
                                       f"[checks.{table}]\n{line}\n")
    assert main(["validate", "--no-build", str(path)]) != 0
    out = capsys.readouterr()
    assert f"checks.{table}.{line.split()[0]}" in out.out + out.err, out
