"""``harness run ... --launcher slurm`` (submit mode, issue #45 item 3): not a subcommand of its own but
``harness run``'s path when it is to run as a Slurm job. It lives here, not in harness/launch/slurm.py,
because turning ``harness run``'s options back into arguments needs their table (harness/run/options.py),
which the launch layer sits below.

``run_via_slurm(args)``: the sbatch script (``harness.launch.slurm.sbatch_script``) of the same selection
with ``--launcher srun``, written into the results folder, submitted, waited for (cancelled at its time
limit), and the job's exit code; the job's ``harness run`` writes junit.xml and the summaries into that
same folder (a shared filesystem), so ``harness compare`` reads them as after a local run.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from harness.files import atomic

# harness run's options that say how this run is launched, not what it runs: never passed on to the job
LAUNCH_OPTIONS = {"results", "launcher", "nodes", "procs_per_node"}
DEFAULT_TIME_LIMIT_S = 3600.0
DEFAULT_PENDING_S = 3600.0  # how long the job may wait in the queue before it runs, on top of its limit


def selection_args(args) -> list[str]:
    """``harness run``'s arguments for the same selection: suites, then every option set to something
    other than its default, in the table's own spelling, then ``-- PYTEST_ARGS``."""
    from harness.run.options import OPTIONS

    out = [str(s) for s in args.suites]
    for o in OPTIONS:
        if not o.flags or o.name in LAUNCH_OPTIONS or o.name.startswith("slurm_"):
            continue
        v = getattr(args, o.name, None)
        if o.switch is not None:
            out += [o.flags[0]] if v == o.switch else []
        elif o.repeat:
            out += [a for x in v or [] for a in (o.flags[0], str(x))]
        elif v is not None and v != o.default:
            out += [o.flags[0], str(v)]
    return out + (["--", *args.passthrough] if getattr(args, "passthrough", None) else [])


def run_via_slurm(args) -> int:
    """Submit the run as a Slurm job, wait for it, and return its exit code (2: refused, one line)."""
    from harness.launch import slurm
    from harness.run.results import FILES
    from harness.settings import load_settings

    results = Path(args.results or load_settings().results_dir).resolve()
    nodes = getattr(args, "nodes", None) or 1
    ppn = getattr(args, "procs_per_node", None) or 1
    limit = float(getattr(args, "slurm_time", None) or DEFAULT_TIME_LIMIT_S)
    name = "harness-" + re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(Path(str(s)).stem for s in args.suites) or "all")
    try:
        script = slurm.sbatch_script(selection_args(args), nodes, ppn, results, limit, name[:64],
                                     getattr(args, "slurm_partition", None))
        results.mkdir(parents=True, exist_ok=True)  # sbatch's --output is there
        for f in FILES:  # the previous run's results must not pass for this job's when it never starts
            (results / f).unlink(missing_ok=True)
        path = results / "slurm-job.sh"
        atomic.write_text(path, script)
        job = slurm.submit(path)
        print(f"harness run: submitted Slurm job {job} ({nodes} node(s)); script {path}, output "
              f"{results}/slurm-{job}.out", flush=True)
        # Slurm kills the job at --time itself; ours is the backstop for a job that never gets a node.
        end = slurm.wait(job, limit + DEFAULT_PENDING_S)
    except (slurm.SlurmError, ValueError, OSError) as e:
        print(f"harness run: {e}", file=sys.stderr)
        return 2
    out = results / f"slurm-{job}.out"
    if out.exists():  # the job's own table and progress lines, as a local run prints them
        sys.stdout.write(out.read_text(errors="replace"))
    print(end.describe(), flush=True)
    return end.code
