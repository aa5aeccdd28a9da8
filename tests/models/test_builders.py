"""Model builders: one registry (harness.models entry points), 'hf' among them, import strings kept."""

from __future__ import annotations

import pytest

from harness.models.build import AdapterError
from harness.models.builders import Builder, BuilderRegistry, registry, resolve


def test_hf_is_registered_through_harness_own_entry_point():
    from importlib.metadata import entry_points

    assert any(ep.value == "harness.models.builders:register" and ep.dist.name == "harness"
               for ep in entry_points(group="harness.models"))
    assert "hf" in registry() and resolve("hf").source == "builtin"


def test_import_strings_still_name_a_builder_and_unknown_names_list_the_registered():
    b = resolve("json:dumps")
    assert b.fn.__name__ == "dumps" and b.name == "json:dumps"
    with pytest.raises(AdapterError, match=r"model.adapter: unknown model builder 'nope' \(registered: hf"):
        resolve("nope")
    with pytest.raises(AdapterError, match="cannot import 'no_such_pkg.mod'"):
        resolve("no_such_pkg.mod:build")


def test_the_registry_refuses_what_is_not_a_builder():
    reg = BuilderRegistry()
    with pytest.raises(ValueError, match="must be an instance of harness.models.builders.Builder"):
        reg.add(lambda config, **kw: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="without ':'"):
        reg.add(Builder("pkg:thing", print))
