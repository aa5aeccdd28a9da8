"""Issue #28: the parallel check on the test device, on its own collective (``hdccl``,
testdev/harness_testdev/distributed.py; docs/parallel.md "On a device backend").

The device runs only in subprocesses (fixtures in conftest.py). The device-free tests at the end pin
the device-path defects of harness's parallel worker that the test device exposed.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from testdev_support import ROOT, run_items

# --- (a) the collective itself ----------------------------------------------------------------------
COLLECTIVES = """
    import json, os, torch, torch.distributed as dist
    import harness_testdev
    from torch.distributed import _functional_collectives as fc
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    index = rank % torch.hdev.device_count()
    torch.hdev.set_device(index)
    dev = torch.device("hdev", index)
    dist.init_process_group("hdccl")
    gloo = dist.new_group(backend="gloo")  # the same collectives on CPU tensors, for the expected values
    harness_testdev.reset_collective_counts()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1234 + rank))  # differs per rank
    peer = 1 - rank

    def all_reduce(d, g):
        t = x.to(d); dist.all_reduce(t, group=g); return [t]
    def all_gather_into_tensor(d, g):
        o = torch.empty(world * 6, 4, device=d); dist.all_gather_into_tensor(o, x.to(d), group=g); return [o]
    def all_gather(d, g):
        o = [torch.empty(6, 4, device=d) for _ in range(world)]; dist.all_gather(o, x.to(d), group=g); return o
    def reduce_scatter_tensor(d, g):
        o = torch.empty(6 // world, 4, device=d); dist.reduce_scatter_tensor(o, x.to(d), group=g); return [o]
    def all_to_all_single(d, g):
        o = torch.empty(6, 4, device=d); dist.all_to_all_single(o, x.to(d), group=g); return [o]
    def broadcast(d, g):
        t = x.to(d); dist.broadcast(t, src=1, group=g); return [t]
    def send_recv(d, g):
        r = torch.empty(6, 4, device=d)
        if rank == 0:
            dist.send(x.to(d), 1, group=g); dist.recv(r, 1, group=g)
        else:
            dist.recv(r, 0, group=g); dist.send(2 * x.to(d), 0, group=g)
        return [r]
    def isend_irecv(d, g):  # both ranks post their send first (pipelining's batch_isend_irecv)
        r = torch.empty(6, 4, device=d)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x.to(d), peer, g),
                                         dist.P2POp(dist.irecv, r, peer, g)]):
            w.wait()
        return [r]
    def functional(d, g):  # what DTensor issues
        g = g or dist.group.WORLD
        return [fc.wait_tensor(t) for t in (fc.all_reduce(x.to(d), "sum", g), fc.all_gather_tensor(x.to(d), 0, g),
                                           fc.reduce_scatter_tensor(x.to(d), "sum", 0, g))]

    out = {"device": str(dev), "same": {}}
    for f in (all_reduce, all_gather_into_tensor, all_gather, reduce_scatter_tensor, all_to_all_single, broadcast,
              send_recv, isend_irecv, functional):
        on_dev, on_cpu = f(dev, None), f(torch.device("cpu"), gloo)
        out["same"][f.__name__] = (all(t.device == dev for t in on_dev)
                                   and all(torch.equal(a.cpu(), b) for a, b in zip(on_dev, on_cpu, strict=True)))
    dist.barrier()
    out["counts"] = harness_testdev.collective_counts()
    out["backend"] = dist.get_backend()
    print("RESULT " + json.dumps(out))
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hdccl_collectives_on_hdev_equal_gloo_on_cpu_and_are_counted(env, tmp_path):
    """Two processes (torchrun's environment variables, by hand): every collective harness's parallel
    check uses, on hdev tensors through hdccl, gives gloo's values on the same CPU tensors bit for bit,
    leaves its results on the rank's own device, and is counted per kind on the device."""
    script = tmp_path / "collectives.py"
    script.write_text(textwrap.dedent(COLLECTIVES))
    base = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    print(f"2-rank hdccl launch {time.monotonic() - t0:.1f} s")
    res = []
    for p, (so, se) in zip(procs, outs, strict=True):
        assert p.returncode == 0, se[-3000:]
        res.append(json.loads(next(ln for ln in so.splitlines() if ln.startswith("RESULT "))[len("RESULT "):]))
    assert [r["device"] for r in res] == ["hdev:0", "hdev:1"]  # rank % device_count
    for r in res:
        assert r["backend"] == "hdccl"
        assert all(r["same"].values()), r["same"]
        c = r["counts"]
        for kind in ("all_reduce", "all_gather", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
                     "send", "recv", "barrier"):
            assert c.get(kind, 0) >= 1, (kind, c)
        assert c["all_gather_into_tensor"] >= 2 and c["all_reduce"] >= 2 and c["recv"] == 2, c  # functional too
        assert not any(k.endswith("[cpu]") for k in c), c  # the gloo group's CPU calls are not hdccl's


# --- (b) the parallel check on the device -----------------------------------------------------------
def _parallel_run(env, tmp_path, suite: str, *extra: str) -> tuple[dict, dict[str, int], float]:
    log = tmp_path / "fallbacks.jsonl"
    env = dict(env, TESTDEV_FALLBACK_LOG=str(log))
    t0 = time.monotonic()
    items = run_items(env, tmp_path / "results", suite, "--backend", "testdev", "--check", "parallel", "--scope",
                      "nightly", "--dtype", "float32", *extra, timeout=900)
    wall = time.monotonic() - t0
    colls: dict[str, int] = {}
    ranks = 0
    for line in log.read_text().splitlines() if log.exists() else []:
        rec = json.loads(line)
        if "harness/parallel/worker.py" in " ".join(rec["argv"]) or "harness.parallel.worker" in " ".join(rec["argv"]):
            ranks += 1
        for k, n in rec.get("collectives", {}).items():
            colls[k] = colls.get(k, 0) + n
    print(f"{suite}: harness run --check parallel on testdev {wall:.1f} s, {ranks} rank processes logged")
    return {v: i for (_, _, v), i in items.items()}, colls, wall


def _every_world2_layout_passes_on_hdev(items: dict, colls: dict[str, int]) -> None:
    ran = {v: i for v, i in items.items() if i["outcome"] != "skipped"}
    assert ran, items
    for v, it in items.items():
        p = it["props"]
        if it["outcome"] == "skipped":  # world 4 and up: the test device has 2 devices
            assert "devices, 2 present" in it["message"] or "max_world" in it["message"], (v, it["message"])
            continue
        assert it["outcome"] == "passed", (v, it["message"])
        assert p["metric.parallel_world_size"] in ("2", "2.0"), (v, p["metric.parallel_world_size"])
        assert p["harness.device"].startswith("hdev"), p["harness.device"]
        assert p["harness.detail.rank_devices"] == "hdev:0,hdev:1", (v, p["harness.detail.rank_devices"])
    # the ranks' collectives went through hdccl on device tensors: DTensor's, FSDP2's, DDP's, the pipeline's
    for kind in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "send", "recv", "broadcast"):
        assert colls.get(kind, 0) > 0, (kind, colls)


def test_parallel_check_passes_every_world2_layout_on_hdev_over_hdccl(env, tmp_path):
    """``harness run llama-3.1-8b --backend testdev --check parallel --scope nightly``: tp2, pp2, dp2 and
    fsdp2-ac (the default dense matrix at world 2) pass against the CPU reference with every rank on its
    own hdev device and every collective through hdccl; tp2xdp2 (4 ranks) is skipped saying why."""
    items, colls, _ = _parallel_run(env, tmp_path, "llama-3.1-8b")
    assert {"tp2", "pp2", "dp2", "fsdp2-ac"} <= {v for v, i in items.items() if i["outcome"] == "passed"}, items
    _every_world2_layout_passes_on_hdev(items, colls)
    tp = items["tp2"]["props"]
    assert float(tp["metric.comm_all_reduce_count"]) > 0  # harness's own CommCounter saw hdccl's collectives


def test_parallel_check_moe_suite_on_hdev_expert_parallel(env, tmp_path):
    """The MoE default matrix at world 2 (ep2 with its all_to_all_single, tp2, pp2, dp2, fsdp2-ac) on
    the device; world-4 layouts skipped (2 devices)."""
    items, colls, _ = _parallel_run(env, tmp_path, "mixtral-8x7b")
    assert items["ep2"]["outcome"] == "passed", items["ep2"]["message"]
    _every_world2_layout_passes_on_hdev(items, colls)
    assert colls.get("all_to_all_single", 0) > 0, colls


# --- device-free pins of the device-path defects ------------------------------------------------------
def test_the_launch_spec_carries_the_backends_device_type_and_module_not_its_name(monkeypatch):
    """Defect: the parallel check handed its ranks the collective only, and every rank built its model
    and its mesh on "cpu" whatever the backend (the device path never ran). The spec now carries the
    backend's device type and vendor module; a backend whose name differs from its device type
    (testdev / hdev) gets the device type."""
    from harness.backends import Backend
    from harness.checks import CheckContext
    from harness.checks import parallel as par
    from harness.parallel import launcher
    from tests.parallel.helpers import suite_with

    seen = {}

    class Captured(Exception):
        pass

    class Launch:
        def __init__(self, spec, *a, **k):
            seen.update(spec)
            raise Captured

    monkeypatch.setattr(launcher, "BackgroundLaunch", Launch)

    ls = suite_with("qwen3-8b", configs=[{"dp": 2}])
    be = Backend("vendorname28", "vendordev28", "vccl28", module="vendor_mod28", dispatch_key="PrivateUse1")
    monkeypatch.setattr(be, "device_count", lambda: 2)
    ctx = CheckContext(ls, be, "float32", "dp2", check="parallel")
    chk = par.ParallelCheck()
    st = type("St", (), {})()
    st.cfg = ls.suite.checks.parallel
    st.peers = par.layouts_of(ls, st.cfg)
    st.layout = st.peers[0]
    try:
        par.reset_launches()
        with pytest.raises(Captured):
            chk.launch(ctx, st)
    finally:
        par.reset_launches()
    assert seen["device_type"] == "vendordev28" and seen["module"] == "vendor_mod28" and seen["collective"] == "vccl28"


FAKE_VENDOR = """
import torch
calls = []
class _Mod:
    def device_count(self): return 3
    def set_device(self, i): calls.append(("set_device", i))
    def manual_seed(self, s): calls.append(("manual_seed", s))
torch.privateuseone = _Mod()
"""


def test_each_rank_imports_the_vendor_module_then_takes_device_rank_mod_count(tmp_path, monkeypatch):
    """``rank_device``: the vendor module first (it registers ``torch.<device_type>``), then index
    rank % device_count made current and its generator seeded alike on every rank; a backend *name*
    where the device type belongs fails saying so."""
    from harness.parallel.worker import rank_device

    (tmp_path / "fake_vendor28p.py").write_text(FAKE_VENDOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        spec = {"device_type": "privateuseone", "module": "fake_vendor28p", "seed": 7}
        assert rank_device(spec, 4) == torch.device("privateuseone", 1)
        assert sys.modules["fake_vendor28p"].calls == [("set_device", 1), ("manual_seed", 7)]
        assert rank_device({"device_type": "cpu", "module": None, "seed": 0}, 3) == torch.device("cpu")
        with pytest.raises(RuntimeError, match="torch has no 'testdev' device module"):
            rank_device({"device_type": "testdev", "module": None, "seed": 0}, 0)
    finally:
        sys.modules.pop("fake_vendor28p", None)
        if hasattr(torch, "privateuseone"):
            del torch.privateuseone


def test_cp_position_ids_are_made_on_the_ranks_device():
    """Defect: context parallelism's position ids were made on the CPU, beside device weights in the
    rotary embedding."""
    from harness.parallel.cp import positions

    p = positions(8, 2, 1, device="meta")
    assert p.device.type == "meta" and p.shape == (1, 4)
    assert positions(8, 2, 1).tolist() == [[4, 5, 6, 7]]


def test_ep_capacity_positions_follow_the_expert_ids_device():
    """Defect: expert parallelism's capacity cut made its queue positions with a bare ``torch.arange``
    (the default device), beside expert ids on the rank's device."""
    from harness.parallel.ep import plan_dispatch

    flat_e = torch.tensor([3, 0, 1, 3, 3, 2, 0, 1])
    with torch.device("meta"):  # a default device other than the ids': the old code mixed them
        order, keep, counts = plan_dispatch(flat_e, num_experts=4, ep=2, capacity=2)
    assert keep.device.type == "cpu" and int((~keep).sum()) == 1 and counts.tolist() == [4, 3]


def test_pipeline_stage_buffers_are_made_on_the_ranks_device(monkeypatch):
    """Defect: ``PipelineStage`` was given ``torch.device("cpu")`` on every backend (its send/receive
    buffers on the host: host activations into device layers, host tensors into the collective)."""
    import torch.distributed.pipelining as pipelining
    import torch.distributed.pipelining.schedules as schedules

    from harness.parallel import apply

    got = {}

    class Stage:
        def __init__(self, mod, idx, n, device, group=None):
            got["device"] = device

    monkeypatch.setattr(pipelining, "PipelineStage", Stage)
    monkeypatch.setattr(schedules, "get_schedule_class", lambda name: lambda stage, mb, loss_fn: None)
    monkeypatch.setattr(apply.dist, "get_rank", lambda g=None: 0)
    monkeypatch.setattr(apply.dist, "get_world_size", lambda g=None: 2)
    apply.pipeline_stage(torch.nn.Linear(2, 2), None, 2, "GPipe", device=torch.device("meta"))
    assert got["device"] == torch.device("meta")
    apply.pipeline_stage(torch.nn.Linear(2, 2), None, 2, "GPipe")
    assert got["device"] == torch.device("cpu")


def test_the_step_optimizer_is_the_per_parameter_loop_on_every_device():
    """Defect: on an accelerator torch's SGD defaults to its foreach kernels (on the CPU to the
    loop); over a tensor-parallel model - DTensor weights beside plain replicated norms of the same
    device and dtype - they raised "got mixed torch.Tensor and DTensor" in the tp2 step on hdev. The
    loop everywhere (also the CPU reference's arithmetic), ZeRO-1's local optimizer included."""
    from harness.parallel.reference import make_optimizer

    opt = make_optimizer([torch.nn.Parameter(torch.ones(2))], 0.5)
    assert opt.defaults["foreach"] is False and opt.defaults["momentum"] == 0.9
    src = (ROOT / "harness" / "parallel" / "apply.py").read_text()
    assert "momentum=0.9, foreach=False" in src.split("def zero1_optimizer")[1].split("def ")[0]
