"""A run's items over its xdist workers (``harness run -n N``): the longest expected first, the N
longest started at once on N workers.

pytest-xdist's ``load`` scheduler hands each worker a contiguous chunk of the collection first (3
of 24 items each for 2 workers), then more from the front as workers free up. Two long items next to
each other in the collection - the compile check's float32 and bfloat16 items of one suite - can
go to one worker and run one after the other while the other idles. Measured on a new config
(DeepSeek-V3.2, 2 workers, 24 items, compile items of 27 and 29 s, the rest 4 s): 67.5 s where about
35 s was possible.

This is xdist's ``load`` scheduler with two changes: the pending items are in longest-expected-first
order (``harness.run.shard.expected``: the recorded duration, else the check's scale), and each
worker's first two items are dealt round-robin (a worker needs the item after the one it runs
before it runs it). Later items go, as before, from the front of the queue to whichever worker has
fewest left: longest processing time first, the rule the shards use across machines. A session
that collected no suite item (harness's plugin is installed for every pytest in the environment)
keeps xdist's own scheduling.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from itertools import cycle

from xdist.scheduler.load import LoadScheduling


def check_of(nodeid: str) -> str:
    """'suites/dsv4.toml::compile[cpu-float32-frontend]' -> 'compile'; an id of another shape: ''."""
    _, sep, name = nodeid.partition("::")
    return name.split("[", 1)[0] if sep else ""


def expected_of(nodeids: list[str], recorded: dict[str, float]) -> dict[str, float]:
    """Expected seconds per item id: the record, else the check's scale (no suite is loaded here,
    the controller has only ids; the size factor is 1)."""
    from harness.run import shard

    return shard.expected(((i, check_of(i), 1.0) for i in nodeids), recorded)


class LongestFirst(LoadScheduling):
    def __init__(self, config, log, expected: Callable[[list[str]], dict[str, float]]):
        super().__init__(config, log)
        self._expected = expected

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None or not self.node2collection:
            return super().schedule()
        if not any(".toml::" in i for i in next(iter(self.node2collection.values()))):
            return super().schedule()  # no suite item (a plain test session with harness installed): xdist's own
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")  # xdist's own words
            return None
        self.collection = next(iter(self.node2collection.values()))
        if not self.collection:
            return None
        if self.maxschedchunk is None:
            self.maxschedchunk = len(self.collection)
        seconds = self._expected(list(self.collection))
        self.pending[:] = sorted(range(len(self.collection)),
                                 key=lambda i: (-seconds.get(self.collection[i], 0.0), i))
        nodes = cycle(self.nodes)
        # two rounds of one item per worker (xdist's own loop for fewer than 2 per worker: one each in turn)
        for _ in range(min(len(self.pending), 2 * len(self.nodes))):
            self._send_tests(next(nodes), 1)
        if not self.pending:
            for node in self.nodes:
                node.shutdown()
        return None


# `harness run` without -n: a second process pays ~3-5 s of interpreter start and imports, so it is
# worth starting only when the recorded work of the chosen suites is well above that. The README's
# first command (the bundled suites: ~250 s of recorded work on one core) runs on every core of the
# machine; a test's or a new suite's short run (nothing recorded) stays in one process.
PARALLEL_FROM_S = 60.0
MAX_DEFAULT_WORKERS = 4  # each worker and its isolated child hold torch and a model: ~1-2 GiB


def default_workers(suites: list, backends: list[str], recorded: dict[str, float],
                    checks: list[str] | None = None) -> int | None:
    """Workers for a run that named none: one per usable core (at most MAX_DEFAULT_WORKERS) when the
    recorded durations of these suites' items of these checks on these backends (none named: any) add up to
    PARALLEL_FROM_S or more; None (one process) otherwise, or on a single core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if cores < 2:
        return None
    names = {getattr(p, "name", str(p)) for p in suites}
    tags = tuple(f"[{b}-" for b in backends) or ("[",)  # no --backend: every backend's record counts
    work = sum(s for item, s in recorded.items()
               if item.partition("::")[0].rsplit("/", 1)[-1] in names and any(t in item for t in tags)
               and (not checks or check_of(item) in checks))
    return min(cores, MAX_DEFAULT_WORKERS) if work >= PARALLEL_FROM_S else None
