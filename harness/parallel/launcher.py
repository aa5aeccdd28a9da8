"""Launch every layout of one world size through torchrun, once, under a time limit.

Why torchrun (``python -m torch.distributed.run``) rather than ``torch.multiprocessing.spawn``: it
is what a vendor runs on a cluster, and the same launch reaches several nodes for the nightly runs
by swapping ``--standalone`` for a c10d rendezvous (``HARNESS_TORCHRUN_ARGS``, docs/parallel.md);
spawn only forks one host's processes. The launch goes through the launch layer
(``harness.launch.group.torchrun``): each rank runs under its wrapper, which records the exit status
or signal as a file.

The launch layer's guarantees, per rank: the launch gets its own session, every process dies with its
parent (PR_SET_PDEATHSIG), a kill takes the whole tree (the ranks torchrun put in sessions of their
own included), and each rank keeps a status file (layout, step, collective, module) that is
read after a kill. Layouts run one after another; a layout that makes no progress within
``timeout_s`` is a hang: the group is killed and the ranks' statuses name who was computing and who
waited in which collective. After a hang, a crash or an error, the layouts not yet run are launched
again, so one broken layout does not hide the others - unless two launches in a row failed the same
way on two layouts (``same_failure``: a rank stopped at the same step and module, every rank inside a
collective, or a rank crashed with the same signal): then the launch itself is broken (a rank, a
device, a link), and the layouts left are ``not_run`` naming it instead of each waiting out the time
limit.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import settings
from harness.launch.group import Rendezvous
from harness.launch.nodes import launched
from harness.launch.status import read_exits, status_path
from harness.parallel.layouts import Layout, layout_dir
from harness.parallel.status import RankStatus, read_status


@dataclass
class LayoutOutcome:
    layout: Layout
    status: str  # ok | error (a rank raised) | hung | crashed | not_run
    message: str = ""
    dir: Path | None = None
    warnings: list[str] = field(default_factory=list)
    launch_wall_s: float = 0.0
    ranks: list[RankStatus] = field(default_factory=list)
    placement: dict = field(default_factory=dict)  # rank -> "node <i> (<host>)" of a multi-node launch


class LaunchCancelled(Exception):
    """``BackgroundLaunch.cancel``: nobody waits for the layouts left."""


@dataclass
class LaunchReport:
    outcomes: dict[str, LayoutOutcome]
    launches: int
    wall_s: float


def _done(run_dir: Path, lay: Layout, world: int) -> bool:
    return all((layout_dir(run_dir, lay) / f"rank{r}.json").exists() for r in range(world))


def _errors(run_dir: Path, lay: Layout, world: int) -> dict[int, dict]:
    out = {}
    for r in range(world):
        p = layout_dir(run_dir, lay) / f"rank{r}.error.json"
        if p.exists():
            out[r] = json.loads(p.read_text())
    return out


def _statuses(run_dir: Path, world: int) -> list[RankStatus]:
    return [read_status(status_path(run_dir, r), r) for r in range(world)]


def _one_launch(spec: dict, layouts: list[Layout], world: int, run_dir: Path, timeout_s: float,
                startup_s: float, on_done=None, stop=None) -> tuple[str, list[RankStatus], dict[int, dict], float, str]:
    """Returns ('exited' | 'hung', statuses at the end, exit records, wall seconds, what went wrong with
    the nodes of a multi-node launch: '' when nothing). ``on_done(layout,
    wall, placement)`` is called as soon as every rank wrote a layout's results (in layout order)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, layouts=[lay.to_dict() for lay in layouts])
    spec_path = run_dir / "spec.json"
    from harness.files import atomic

    atomic.write_json(spec_path, spec, indent=None, newline=False)
    with launched("harness.parallel.worker", spec_path, world,
                  rdzv=Rendezvous.from_text(settings.env("HARNESS_TORCHRUN_ARGS"))) as group:
        return _wait(group, layouts, world, run_dir, timeout_s, startup_s, on_done, stop)


def _wait(group, layouts: list[Layout], world: int, run_dir: Path, timeout_s: float, startup_s: float, on_done,
          stop) -> tuple[str, list[RankStatus], dict[int, dict], float, str]:
    published = 0

    def progress():
        # Progress: the last rank entered another layout, or every rank finished one. Until every rank
        # entered its first layout (None), start-up's own limit applies.
        nonlocal published
        if stop is not None and stop.is_set():
            raise LaunchCancelled("the launch was cancelled")
        idx = min(s.index for s in _statuses(run_dir, world))
        while on_done is not None and published < len(layouts) and _done(run_dir, layouts[published], world):
            on_done(layouts[published], time.monotonic() - group.t0,
                    group.placement() if hasattr(group, "placement") else {})
            published += 1
        return None if idx < 0 else (idx, sum(_done(run_dir, lay, world) for lay in layouts))

    end = group.wait(stall_s=timeout_s, startup_s=startup_s, progress=progress)
    # (a multi-node launch has mirrored every node's files into run_dir by now)
    how = "exited" if end.how == "exited" else "hung"
    infra = group.infrastructure() if hasattr(group, "infrastructure") else ""
    placement = group.placement() if hasattr(group, "placement") else {}
    return how, _statuses(run_dir, world), read_exits(run_dir, world), end.wall_s, infra, placement


def _hang_message(lay: Layout, sts: list[RankStatus], timeout_s: float) -> str:
    here = [s for s in sts if s.layout == lay.label] or sts
    computing = [s for s in here if not s.collective]
    waiting = [s for s in here if s.collective]
    if not waiting:
        # No rank in a collective the status sees (DTensor's all-reduce inside a tp module is not one):
        # the hung rank is the one its peers went past - they entered a module inside its last one.
        behind = [s for s in here if s.module and all(
            o is s or (o.step == s.step and o.module.startswith(s.module + ".")) for o in here)]
        if behind and len(behind) < len(here):
            computing, waiting = behind, [s for s in here if s not in behind]
    limit = f"no progress within the {timeout_s:g} s time limit; the launch was killed with its process group"
    if computing and waiting:  # the lead: who stopped, then who waits for it, then the time limit
        return (f"layout {lay.label}: hung rank(s) " + "; ".join(s.describe() for s in computing)
                + ". Waiting for it: " + "; ".join(s.describe() for s in waiting) + f". {limit}")
    return f"layout {lay.label}: {limit}. " + "; ".join(s.describe() for s in here)


def _crash_message(lay: Layout, sts: list[RankStatus], exits: dict[int, dict], errors: dict[int, dict]) -> str:
    by_rank = {s.rank: s for s in sts}
    first = []
    # A rank killed by a signal first: its peers' errors (gloo "connection reset by peer") follow from it.
    for r, x in sorted(exits.items()):
        if x.get("signal") and not x.get("stopped_by_launcher") and r not in errors:
            s = by_rank.get(r)
            first.append(f"rank {r} crashed with {x['signal']}" + (f" ({s.describe()})" if s else ""))
    for r, e in sorted(errors.items()):
        where = f"step {e['step']}" + (f", inside collective {e['collective']}" if e.get("collective") else "")
        first.append(f"rank {r} raised {e['error'].splitlines()[0][:300]} ({where})")
    if not first:
        codes = {r: x.get("code") for r, x in exits.items()}
        first.append(f"ranks exited before reporting (exit codes {codes or 'unknown'}); see the torchrun log")
    stopped = [r for r, x in exits.items() if x.get("stopped_by_launcher")]
    tail = f"; torchrun stopped rank(s) {', '.join(map(str, sorted(stopped)))} afterwards" if stopped else ""
    return f"layout {lay.label}: " + "; ".join(first) + tail


@dataclass
class _Ended:
    """How one torchrun launch ended (``_one_launch``'s answer, with its folder)."""

    run_dir: Path
    how: str  # exited | hung
    sts: list[RankStatus]
    exits: dict[int, dict]
    wall: float
    infra: str = ""  # a node's failure (harness.launch.nodes): the launch's, not the layout's
    placement: dict = field(default_factory=dict)  # rank -> "node <i> (<host>)" of a multi-node launch


def launch(spec: dict, layouts: list[Layout], world: int, run_root: Path, timeout_s: float = 120.0,
           startup_s: float | None = None, on_outcome=None, stop=None) -> LaunchReport:
    """Run ``layouts`` (all of world size ``world``) in as few launches as faults allow.
    ``on_outcome(outcome)`` is called with each layout's outcome as soon as it is known: an ``ok``
    one while the launch goes on (its teardown warnings, if any, are appended to the same object
    when the launch ends), a failed one when its launch ended."""
    outcomes: dict[str, LayoutOutcome] = {}
    remaining = list(layouts)
    n = 0
    last: LayoutOutcome | None = None  # the layout the previous launch failed in
    t_all = time.monotonic()
    publish = on_outcome or (lambda _o: None)
    while remaining:
        run_dir = run_root / f"w{world}-launch{n}"
        n += 1

        def done(lay: Layout, wall: float, placement: dict, run_dir=run_dir) -> None:
            outcomes[lay.label] = LayoutOutcome(lay, "ok", dir=layout_dir(run_dir, lay), launch_wall_s=wall,
                                                placement=placement)
            publish(outcomes[lay.label])

        end = _Ended(run_dir, *_one_launch(spec, remaining, world, run_dir, timeout_s, startup_s or timeout_s,
                                           on_done=done, stop=stop))
        finished = _finished(remaining, run_dir, world, outcomes, lambda lay, e=end: done(lay, e.wall, e.placement))
        rest = remaining[len(finished):]
        if not rest:
            _warn_teardown([outcomes[lay.label] for lay in finished], end)
            if end.infra:  # every layout reported, yet a node or the launch store did not end well
                for lay in finished:
                    outcomes[lay.label].warnings.append(f"every layout reported, results kept; the launch's "
                                                        f"nodes: {end.infra}")
            break
        if end.infra:
            # A node failed (lost, late, or running other packages): no layout left has a verdict on
            # this launch, and launching again would meet the same nodes.
            _not_run(outcomes, publish, rest, end, f"not run, a failure of the launch's nodes (the "
                     f"infrastructure's, not the model's): {end.infra}")
            break
        # The layout the launch stopped at failed; the ones after it run in the next launch (unless
        # nothing started at all: then every layout left failed with it).
        failed = _failed(rest, end, world, timeout_s, started=bool(finished))
        for out in failed:
            outcomes[out.layout.label] = out
            publish(out)
        remaining = rest[len(failed):]
        now = failed[0] if len(failed) == 1 and failed[0].dir is not None else None
        same = same_failure(last, now) if last is not None and now is not None else None
        if remaining and same:
            # One broken thing is one finding: two launches in a row failed the same way on two
            # different layouts - a rank, a device or a link of this launch, not a layout. Every
            # further launch would wait out the same time limit (measured: 12 launches, 41 minutes of
            # a nightly job for one rank hung in its first collective).
            why = (f"not run: the launches of layouts {last.layout.label} and {now.layout.label} failed the same "
                   f"way ({same}) - a failure of this {world}-rank launch, not of this layout; not launched again")
            _not_run(outcomes, publish, remaining, end, why)
            remaining = []
        last = now
    return LaunchReport(outcomes, n, time.monotonic() - t_all)


def _finished(remaining: list[Layout], run_dir: Path, world: int, outcomes: dict, done) -> list[Layout]:
    """The layouts, in order, whose every rank wrote its results; ``done`` for those the launch's
    polling did not publish yet (written in its last interval)."""
    finished = []
    for lay in remaining:
        if not _done(run_dir, lay, world):
            break
        finished.append(lay)
        if lay.label not in outcomes:
            done(lay)
    return finished


def _not_run(outcomes: dict, publish, lays: list[Layout], end: _Ended, why: str) -> None:
    for lay in lays:
        outcomes[lay.label] = LayoutOutcome(lay, "not_run", why, launch_wall_s=end.wall, ranks=end.sts)
        publish(outcomes[lay.label])


def same_failure(a: LayoutOutcome, b: LayoutOutcome) -> str:
    """How two failed launches of different layouts failed alike ('' if not): the same rank crashed
    with the same signal; or both hung with the same rank stopped at the same place (step, last module
    entered, inside a collective or not: a broken rank stops where it is whatever the layout, while
    its peers wait wherever the layout's next collective is); or both hung with every rank inside a
    collective (a link or the collective library, not a rank: which collective differs by layout).
    A crash counts whether or not a peer raised after it (a gloo peer sees "connection reset")."""
    if {a.status, b.status} <= {"crashed", "error"}:
        # "error" too: a rank's abort leaves its peer raising inside the next collective (the launch's
        # status is then error), and the dead rank is the same finding in both launches.
        sa = set(re.findall(r"rank (\d+) crashed with (SIG\w+)", a.message))
        common = sorted(sa & set(re.findall(r"rank (\d+) crashed with (SIG\w+)", b.message)))
        return "; ".join(f"rank {r} crashed with {sig}" for r, sig in common)
    if a.status == b.status == "hung" and a.ranks and b.ranks:
        def where(s: RankStatus) -> tuple:
            return s.step, s.module, bool(s.collective)

        here = {s.rank: where(s) for s in b.ranks}
        common = [s for s in a.ranks if here.get(s.rank) == where(s) and (s.step or s.module)]
        if common:
            return "; ".join(f"rank {s.rank} hung at step {s.step or '?'}"
                             + (f", last module entered {s.module}" if s.module else "")
                             + (", inside a collective" if s.collective else "") for s in common)
        if all(s.collective for s in a.ranks) and all(s.collective for s in b.ranks):
            return "every rank hung inside a collective"
    return ""


def _warn_teardown(finished: list[LayoutOutcome], end: _Ended) -> None:
    """Every layout reported; the ranks then failed to end (the DTensor teardown abort): a warning
    on each, the results kept."""
    bad_exit = {r: x for r, x in end.exits.items() if x.get("code")}
    if end.how != "hung" and not bad_exit:
        return
    what = ", ".join(f"rank {r} {x.get('signal') or 'exit ' + str(x.get('code'))}"
                     for r, x in sorted(bad_exit.items())) or "did not exit in time"
    for out in finished:
        out.warnings.append(f"after every rank wrote its results, the launch ended badly in teardown ({what}); "
                            "results kept (a teardown abort is a warning, not a failure)")


def _failed(rest: list[Layout], end: _Ended, world: int, timeout_s: float, started: bool) -> list[LayoutOutcome]:
    """The outcome of ``rest[0]``, the layout the launch ended in; of every layout in ``rest`` when
    no rank got to its first layout (a rank could not even set up): the first carries the failure,
    the others are ``not_run`` naming it - the launch's failure, not theirs, and one finding."""
    lay, sts, wall = rest[0], end.sts, end.wall
    errors = _errors(end.run_dir, lay, world)
    if not started and min((s.index for s in sts), default=-1) < 0 and not errors:
        log = (end.run_dir / "torchrun.log").read_text(errors="replace").strip().splitlines()[-3:]
        msg = ("hung before the first layout started" if end.how == "hung" else
               _crash_message(lay, sts, end.exits, errors)) + (" | " + " / ".join(log) if log else "")
        why = (f"not run: the {world}-rank launch failed before any rank reached its first layout (reported on "
               f"layout {lay.label}: {msg}) - a failure of this launch, not of this layout; not launched again")
        return [LayoutOutcome(lay, "crashed" if end.how != "hung" else "hung", msg, launch_wall_s=wall, ranks=sts)] + [
            LayoutOutcome(x, "not_run", why, launch_wall_s=wall, ranks=sts) for x in rest[1:]]
    if end.how == "hung":
        return [LayoutOutcome(lay, "hung", _hang_message(lay, sts, timeout_s), layout_dir(end.run_dir, lay),
                              launch_wall_s=wall, ranks=sts)]
    status = "error" if errors else "crashed"
    return [LayoutOutcome(lay, status, _crash_message(lay, sts, end.exits, errors), layout_dir(end.run_dir, lay),
                          launch_wall_s=wall, ranks=sts)]


class BackgroundLaunch:
    """``launch`` in a thread of this process, so that the item of a layout waits for *that* layout
    only: the first item of a world size pays the start-up and its own layout, not the whole launch
    (an item's time limit is derived from its own recorded duration, and under ``pytest -n`` any of
    a world size's items may come first). The last layout's item waits for the launch to end (a
    teardown abort after every result is written is a note on it).

    The torchrun process is started by the thread and dies with it (PR_SET_PDEATHSIG is per
    thread): the thread lives until the launch has ended, and as a daemon it ends with the process
    - an item killed for its time limit takes its launch with it."""

    def __init__(self, spec: dict, layouts: list[Layout], world: int, run_root: Path, timeout_s: float,
                 startup_s: float | None = None):
        import threading

        self.labels = [lay.label for lay in layouts]
        self.outcomes: dict[str, LayoutOutcome] = {}
        self.report: LaunchReport | None = None
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(spec, layouts, world, run_root, timeout_s, startup_s),
                                        name=f"parallel-launch-w{world}", daemon=True)
        self._thread.start()

    def _run(self, *args) -> None:
        try:
            rep = launch(*args, on_outcome=self._publish, stop=self._stop)
        except BaseException as e:  # reported to the waiting item
            with self._cond:
                self.error = e
                self._cond.notify_all()
            return
        with self._cond:
            self.report = rep
            self._cond.notify_all()

    def _publish(self, out: LayoutOutcome) -> None:
        with self._cond:
            self.outcomes[out.layout.label] = out
            self._cond.notify_all()

    @property
    def finished(self) -> bool:
        return self.report is not None or self.error is not None

    def wait(self, label: str) -> LayoutOutcome:
        """The outcome of ``label`` once known (for the launch's last layout: once the launch ended)."""
        last = label == self.labels[-1]
        with self._cond:
            self._cond.wait_for(lambda: self.finished or (label in self.outcomes and not last))
            if self.error is not None:
                raise self.error
            return (self.report.outcomes if self.report is not None else self.outcomes)[label]

    def cancel(self) -> None:
        """Kill the launch if it still runs (its process group) and wait for the thread."""
        self._stop.set()
        self._thread.join(timeout=30)

    def result(self) -> LaunchReport:
        """The whole launch's report (waits for it)."""
        with self._cond:
            self._cond.wait_for(lambda: self.finished)
        if self.error is not None:
            raise self.error
        return self.report
