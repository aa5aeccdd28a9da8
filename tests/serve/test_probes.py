"""The probes' requests (harness/serve/probes.py) and the runner's fit of the prefix probe to the engine's
prefix-cache hit unit (harness/serve/engines/vllm_runner.py ``fit_prefix``); the engine runs are in
tests/checks/test_serve_day0.py (gemma-4's pages of 32 and 64 tokens) and tests/serve/test_server_mode.py."""

from __future__ import annotations

import importlib.util

from harness.serve import engine as eng
from harness.serve import probes


def _runner():
    # the file the engine's python runs; it imports only the standard library at module level
    spec = importlib.util.spec_from_file_location("vllm_runner_under_test", eng.DATA / "vllm_runner.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tokens(n, length, i):
    return [[(1000 * i + 100 * j + t) % 509 for t in range(length)] for j in range(n)]


def _prefix(block=32):
    (p,) = probes.build(["prefix"], _tokens(2, 16, 0), _tokens, 4, block, 0, 12)
    return p


def test_the_prefix_probe_shares_one_page_and_leaves_the_engine_room_to_grow_it():
    p = _prefix()
    miss, hit = p["groups"][0][0]["ids"], p["groups"][1][0]["ids"]
    assert miss[:32] == hit[:32] and miss[32:] != hit[32:] and len(hit) == 32 + 8
    assert p["shared"] == 32 and p["grow_to"] == probes.PREFIX_ROOM * 32
    assert probes.max_len([p]) == len(hit) + 4 + (probes.PREFIX_ROOM - 1) * 32  # the engine's length limit


def test_a_hit_unit_of_two_pages_grows_the_shared_part_and_the_served_ids_are_judged():
    run = _runner()
    p = _prefix()
    assert run.fit_prefix(p, 32) is p and run.fit_prefix(p, None) is p  # one page is a hit already
    f = run.fit_prefix(p, 64)
    miss, hit = f["groups"][0][0]["ids"], f["groups"][1][0]["ids"]
    assert miss[:64] == hit[:64] and len(hit) == 64 + 8 and f["shared"] == 64
    assert hit[64:] == p["groups"][1][0]["ids"][32:] and hit[:32] == p["groups"][1][0]["ids"][:32]
    # the engine's result says what it served; what is judged (and what the reference reads) is that
    res = {"groups": [[{"tokens": [1], "num_cached_tokens": 0}], [{"tokens": [2], "num_cached_tokens": 64}]],
           "prefix_unit": 64, **run.served_ids(p, f)}
    assert [r["ids"] for r, _ in probes.judged(p, res)] == [miss, hit]
    assert probes.sequences([p], {"prefix": res}) == [miss + [1], hit + [2]]
    did, problem = probes._exercised(p, res)
    assert problem is None and did.startswith("hit: 64 of 72") and "grown to the engine's hit unit, 64" in did


def test_a_hit_unit_beyond_the_room_is_said_as_the_reason_the_probe_probed_nothing():
    run = _runner()
    p = _prefix()
    assert run.fit_prefix(p, 256) is p  # more than PREFIX_ROOM pages: sent as built
    res = {"groups": [[{"tokens": [], "num_cached_tokens": 0}], [{"tokens": [], "num_cached_tokens": 0}]],
           "prefix_unit": 256}
    did, problem = probes._exercised(p, res)
    assert problem.startswith("the engine caches prefixes in units of 256 tokens here"), problem
    res["prefix_unit"] = 32
    assert probes._exercised(p, res)[1] == "the engine served the hit request from 0 cached tokens"
