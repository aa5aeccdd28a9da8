"""`harness ci-local`: what .github/workflows/ci.yml runs, on one machine (docs/ci.md).

The suites in N duration-balanced shards, each one ``harness run --backend cpu --shard I/N -n 2
--results OUT/results/shard-I`` exactly as a CI shard job runs it (one process per shard, at most
``--parallel`` at once), then one ``harness compare`` over every shard with ``--expect-shards N``
against the last run whose shards all passed (``OUT/baseline``, as CI keeps main's last successful
results) and a history of its own (``OUT/history.sqlite``), issues through the file sink
(``OUT/issues``: one markdown file per issue plus ``issues.json``), the merged report printed.

The command lines are built by :func:`shard_command` and :func:`compare_command`; tests/ci checks
that they are the ones in ci.yml, so the rehearsal cannot drift from CI.

Exit status: 1 when a shard failed (as the CI run would), else the comparison's.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.numbers import count

DEFAULT_OUT = ".harness/ci-local"


def register(sub) -> None:
    p = sub.add_parser("ci-local", help="rehearse ci.yml here: the shards, the merged comparison, file-sink issues",
                       description=__doc__.split("\n\n")[0] + " Every option defaults to what ci.yml does.")
    p.add_argument("suites", nargs="*", help="suite names or paths (default: every suite, as CI)")
    p.add_argument("--shards", type=count(1, 1024), default=4, metavar="N", help="shard jobs (default 4, as ci.yml)")
    p.add_argument("--parallel", type=count(1, 256), default=1, metavar="P",
                   help="shards run at once (default 1: one after the other; each also runs -n workers)")
    p.add_argument("--workers", "-n", default="2", help="pytest-xdist workers per shard (default 2, as ci.yml)")
    p.add_argument("--backend", "-b", default="cpu", help="backend (default cpu, as ci.yml)")
    p.add_argument("--scope", choices=("commit", "nightly"), default="commit")
    p.add_argument("--check", "-c", action="append", default=[], help="only this check (repeatable)")
    p.add_argument("--out", type=Path, default=Path(DEFAULT_OUT),
                   help=f"folder for results, history, baseline, issues and logs (default {DEFAULT_OUT})")
    p.add_argument("--close-after", type=count(1, 1000), default=2, help="clean runs before an issue closes (default 2)")
    p.add_argument("--base", default=None, metavar="REF",
                   help="rehearse a pull request: `harness select --base REF --sample 1` first, the shards run its "
                        "selection, the comparison reads copies of the history and quarantine and never makes the "
                        "baseline (default: every item, as main)")
    p.add_argument("--reenable-after", type=count(1, 1000), default=3,
                   help="clean runs before a quarantined item counts again (default 3, as ci.yml)")
    p.add_argument("--sink", default=None,
                   help="issue sink of the comparison (default file: OUT/issues, or with --base stdout, as "
                        "compare-pr; github with --compare-arg --repo/--api-url and GITHUB_TOKEN rehearses main's "
                        "compare job against a GitHub API)")
    p.add_argument("--compare-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the comparison (repeatable), e.g. --compare-arg=--repo=o/r")
    p.set_defaults(func=main)


CONFIRM = 2  # ci.yml's reruns of a failed item before it is reported (harness.run.confirm)
QUARANTINE = Path("harness-quarantine.json")  # ci.yml's quarantine file (a cache beside the history)
SELECTION = Path("harness-selection.json")  # ci.yml's selection (pull requests only; absent: every item)


def shard_command(k: int, n: int, results: Path, *, backend: str = "cpu", workers: str = "2",
                  scope: str = "commit", suites: list[str] = (), checks: list[str] = (),
                  quarantine: Path = QUARANTINE, selection: Path = SELECTION) -> list[str]:
    """The `harness run` arguments of shard k of n (ci.yml's models job, without `.venv/bin/harness`)."""
    cmd = ["run", *suites, "--backend", backend]
    if scope != "commit":
        cmd += ["--scope", scope]
    cmd += ["--shard", f"{k}/{n}", "-n", str(workers), "--confirm", str(CONFIRM), "--quarantine", str(quarantine),
            "--selection", str(selection), "--results", str(results)]
    return cmd + [a for c in checks for a in ("--check", c)]


def compare_command(results_glob: str, n: int, *, baseline: Path, history: Path, sink: str,
                    summary: Path, quarantine: Path = QUARANTINE, extra: list[str] = ()) -> list[str]:
    """The `harness compare` arguments of ci.yml's compare jobs (sink: stdout on pull requests, with
    the triage comment; github on main; file here)."""
    pr = ["--pr-comment", "auto"] if sink == "stdout" else []
    return ["compare", results_glob, "--baseline", f"{baseline}/", "--history", str(history),
            "--expect-shards", str(n), "--sink", sink, "--summary", str(summary), "--quarantine", str(quarantine),
            *pr, *extra]


def _git_head() -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def _last_line(log: Path) -> str:
    """The run's closing count line ('3 passed, 1 failed, ... -> results/...'), for the shard table."""
    try:
        lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines()]
    except OSError:
        return ""
    for ln in reversed(lines):
        if " passed, " in ln:
            return ln
    return next((ln for ln in reversed(lines) if ln), "")


def main(args) -> int:
    if args.shards < 1 or args.parallel < 1:
        print("harness ci-local: --shards and --parallel must be at least 1", file=sys.stderr)
        return 2
    out: Path = args.out
    results_root, logs = out / "results", out / "logs"
    # this run's shards replace the last run's (a shard that does not finish must not leave an old
    # junit.xml behind for the comparison to read as if it had run)
    shutil.rmtree(results_root, ignore_errors=True)
    results_root.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    n = args.shards
    selection = out / "selection.json"
    selection.unlink(missing_ok=True)  # a pull request's selection never outlives its rehearsal
    if args.base:
        from harness.cli import main as cli_main

        argv = ["select", "--base", args.base, "--sample", "1", "--json", str(selection)]
        print(f"select: harness {' '.join(argv)}", flush=True)
        if cli_main(argv) != 0:
            return 2
    failed = _run_shards(args, n, results_root, logs)
    code = _compare(args, n, out, results_root)
    # ci.yml keeps main's last successful results as the baseline of the next comparison (a pull
    # request's never)
    if not failed and not args.base:
        baseline = out / "baseline"
        shutil.rmtree(baseline, ignore_errors=True)
        shutil.copytree(results_root, baseline)
    print(f"\nci-local: {n - len(failed)}/{n} shard(s) passed"
          + (f" (failed: {', '.join(map(str, failed))})" if failed else "")
          + f"; issues in {out / 'issues'}, summary in {out / 'summary.md'}")
    return 1 if failed else code


def _run_shards(args, n: int, results_root: Path, logs: Path) -> list[int]:
    """Every shard, at most ``--parallel`` at once, a table line each; the shards that failed."""
    env = os.environ.copy()
    env.setdefault("HF_HUB_OFFLINE", "1")  # as ci.yml's workflow env
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")

    out = results_root.parent

    def shard(k: int) -> tuple[int, int, float]:
        argv = shard_command(k, n, results_root / f"shard-{k}", backend=args.backend, workers=args.workers,
                             scope=args.scope, suites=args.suites, checks=args.check,
                             quarantine=out / "quarantine.json", selection=out / "selection.json")
        print(f"shard {k}/{n}: harness {' '.join(argv)}", flush=True)
        t0 = time.monotonic()
        with open(logs / f"shard-{k}.log", "w", encoding="utf-8") as log:
            # a process per shard, as a CI job per shard: nothing is shared between them but the disk
            rc = subprocess.call([sys.executable, "-m", "harness", *argv], stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env)
        return k, rc, time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=min(args.parallel, n)) as pool:
        done = list(pool.map(shard, range(1, n + 1)))
    for k, rc, took in done:
        status = "passed" if rc == 0 else f"FAILED (exit {rc})"
        print(f"shard {k}/{n}: {status} in {took:.0f} s  {_last_line(logs / f'shard-{k}.log')}  "
              f"[log: {logs / f'shard-{k}.log'}]", flush=True)
    return [k for k, rc, _ in done if rc != 0]


def _compare(args, n: int, out: Path, results_root: Path) -> int:
    """One `harness compare` over every shard, as ci.yml's compare job (issues through the file sink)."""
    from harness.cli import main as cli_main

    baseline, history, quarantine = out / "baseline", out / "history.sqlite", out / "quarantine.json"
    sink = args.sink or ("stdout" if args.base else "file")
    if args.base:
        # compare-pr restores main's history and quarantine and never saves them: copies, thrown away
        pr = out / "pull-request"
        shutil.rmtree(pr, ignore_errors=True)
        pr.mkdir(parents=True)
        for src in (history, quarantine):
            if src.exists():
                shutil.copy2(src, pr / src.name)
        history, quarantine = pr / history.name, pr / quarantine.name
    run_id = f"ci-local-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S.%fZ}"
    argv = compare_command(f"{results_root}/*/junit.xml", n, baseline=baseline, history=history, sink=sink,
                           summary=out / "summary.md", quarantine=quarantine,
                           extra=["--out-dir", str(out / "issues"), "--run-id", run_id,
                                  "--close-after", str(args.close_after), "--reenable-after", str(args.reenable_after),
                                  "--commit", _git_head(), *args.compare_arg])
    print(f"\ncompare: harness {' '.join(argv)}\n", flush=True)
    return cli_main(argv)
