"""Submit mode on an existing Slurm (issue #45 item 3): the sbatch script of a run, its submission, and
waiting for it - through Slurm's own commands (``sbatch``, ``squeue``, ``scontrol``, ``sacct``,
``scancel``), never a scheduler of our own.

* ``sbatch_script(...)``: one task per node (``--ntasks-per-node=1``), whose body is ``harness run ...
  --nodes $SLURM_NNODES --launcher srun``: the batch host coordinates and ``srun`` starts one torchrun
  agent per node for every parallel item (``--launcher srun``, harness/launch/nodes.py);
* ``submit(path)``: ``sbatch --parsable``, the job id;
* ``wait(job_id, timeout_s)``: polls ``squeue`` for the state, reads the exit code from ``scontrol``
  (``sacct`` once the controller forgot the job: only with accounting), and at the time limit
  ``scancel``s the job and waits until ``squeue`` no longer lists it (Slurm holds a job in COMPLETING
  until its node daemons killed every process of it);
* ``SlurmError``: one line - a command that is not installed, a controller that does not answer, a
  job nobody knows.

Standard library only: this runs on a login node that may have nothing else.
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Slurm's job states that end a job (squeue --states, "JOB STATE CODES").
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                      "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})
_SAFE = re.compile(r"[^\s'\"\\#]+")  # what an #SBATCH value may hold: sbatch parses those lines itself, not a shell


class SlurmError(Exception):
    """One line: what failed and why (the Slurm command's own last error line)."""


def _exe(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SlurmError(f"{name} not found on PATH: submitting to Slurm needs its client commands "
                         "(Debian: apt-get install slurm-client; on a cluster: a login node, or `module load slurm`)")
    return path


def _run(args: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """A Slurm command; its failure as a SlurmError with the command's own last error line. (The
    client commands retry an unreachable controller for ~10 s themselves, so no retry here.)"""
    cmd = [_exe(args[0]), *args[1:]]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{args[0]}: no answer within {timeout_s:.0f} s (is slurmctld reachable?)") from None
    if r.returncode != 0:
        raise SlurmError(f"{args[0]}: {_last_line(r.stderr or r.stdout) or f'exit code {r.returncode}'}")
    return r


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # "sbatch: error: Batch job submission failed: ..." -> the part after the command's prefix
    return re.sub(r"^\w+: (error|fatal): ", "", lines[-1]) if lines else ""


def time_limit(seconds: float) -> str:
    """``--time``'s D-HH:MM:SS, rounded up to a whole second (Slurm itself rounds up to a minute)."""
    if not seconds > 0:
        raise ValueError(f"a job time limit must be > 0 seconds, got {seconds!r}")
    s = math.ceil(seconds)
    return f"{s // 86400}-{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _directive(name: str, value: object) -> str:
    text = str(value)
    if not _SAFE.fullmatch(text):
        raise ValueError(f"--{name} {text!r}: an #SBATCH value cannot hold spaces, quotes or '#' "
                         "(sbatch reads those lines itself, no shell quoting)")
    return f"#SBATCH --{name}={text}"


def sbatch_script(selection_args: list[str], nodes: int, procs_per_node: int, results_dir, time_limit_s: float,
                  job_name: str, partition: str | None = None, *, harness: list[str] | None = None,
                  chdir=None, gpus_per_node: int | None = None, cpus_per_task: int | None = None) -> str:
    """The sbatch script of ``harness run SELECTION --nodes $SLURM_NNODES --launcher srun --results
    RESULTS`` on ``nodes`` nodes: one task per node (the torchrun agent ``srun`` starts there runs
    ``procs_per_node`` ranks, so the task gets that many CPUs unless ``cpus_per_task`` says more),
    Slurm's time limit, the job's output next to the results. ``harness``: the command (default: this
    interpreter's ``-m harness``, the same install on a shared filesystem); ``chdir``: where the run
    starts (default: here, where suites/ and golden/ are)."""
    for what, v in (("nodes", nodes), ("procs_per_node", procs_per_node)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    results = Path(results_dir).resolve()
    out = [
        "#!/bin/bash",
        "# Written by harness (harness/launch/slurm.py). The batch host runs `harness run`; every parallel",
        "# item starts one torchrun agent per node through srun (docs/parallel.md, \"Multi-node under Slurm or",
        "# Kubernetes: a checklist\"). --output is in the results folder: it must exist before sbatch.",
        _directive("job-name", job_name),
        _directive("nodes", nodes),
        _directive("ntasks-per-node", 1),
        _directive("cpus-per-task", cpus_per_task or procs_per_node),
        _directive("time", time_limit(time_limit_s)),
        _directive("output", results / "slurm-%j.out"),
        _directive("chdir", Path(chdir or Path.cwd()).resolve()),
    ]
    if partition:
        out.append(_directive("partition", partition))
    if gpus_per_node:
        out.append(_directive("gpus-per-node", gpus_per_node))
    cmd = [*(harness or [sys.executable, "-m", "harness"]), "run", *selection_args]
    # exec: the job's exit code is harness's; $SLURM_NNODES stays unquoted-expandable, the rest is quoted
    out += ["", "exec " + shlex.join(cmd) + ' --nodes "$SLURM_NNODES" --launcher srun --results '
            + shlex.quote(str(results)), ""]
    return "\n".join(out)


def submit(script_path, extra_args: list[str] | tuple[str, ...] = ()) -> str:
    """``sbatch --parsable SCRIPT``: the job id (a cluster name after ';' dropped)."""
    r = _run(["sbatch", "--parsable", *extra_args, str(script_path)])
    job = r.stdout.strip().split(";")[0]
    if not job.isdigit():
        raise SlurmError(f"sbatch: no job id in its answer {r.stdout.strip()!r}")
    return job


@dataclass
class JobEnd:
    """How a job ended: Slurm's ``state``, the batch script's ``exit_code`` and the ``signal`` that
    ended it (``ExitCode=code:signal``), ``cancelled`` when ``wait`` cancelled it at its time limit."""

    job_id: str
    state: str
    exit_code: int
    signal: int = 0
    cancelled: bool = False
    wall_s: float = 0.0

    @property
    def code(self) -> int:
        """The exit status a caller returns: the script's own, else 128 + the signal, else 1 for a job
        Slurm ended (cancelled, timed out, node failure) without either."""
        if self.state == "COMPLETED" or self.exit_code:
            return self.exit_code
        return 128 + self.signal if self.signal else 1

    def describe(self) -> str:
        how = f"exit code {self.exit_code}" + (f", signal {self.signal}" if self.signal else "")
        why = f" (cancelled by harness at its time limit after {self.wall_s:.0f} s)" if self.cancelled else ""
        return f"Slurm job {self.job_id}: {self.state}, {how}{why}"


def job_state(job_id: str) -> str | None:
    """The job's state as squeue says it (every state, finished ones too while the controller keeps
    them); None when squeue no longer knows it."""
    try:
        r = _run(["squeue", "--noheader", "--jobs", job_id, "--states", "all", "--format", "%T"])
    except SlurmError as e:
        if "Invalid job id" in str(e):
            return None
        raise
    states = r.stdout.split()
    return states[0] if states else None


def listed(job_id: str) -> str | None:
    """The state while squeue lists the job as live (pending, running, completing), else None."""
    try:
        r = _run(["squeue", "--noheader", "--jobs", job_id, "--format", "%T"])
    except SlurmError as e:
        if "Invalid job id" in str(e):
            return None
        raise
    return r.stdout.split()[0] if r.stdout.split() else None


def job_end(job_id: str) -> tuple[str, int, int]:
    """(state, exit code, signal) from scontrol, else from sacct (accounting) once the controller forgot it."""
    try:
        text = _run(["scontrol", "--oneliner", "show", "job", job_id]).stdout
        state = re.search(r"\bJobState=(\S+)", text)
        code = re.search(r"\bExitCode=(\d+):(\d+)", text)
        if state and code:
            return state.group(1), int(code.group(1)), int(code.group(2))
    except SlurmError as e:
        if "Invalid job id" not in str(e):
            raise
    try:
        rows = _run(["sacct", "--jobs", job_id, "--allocations", "--noheader", "--parsable2",
                     "--format", "State,ExitCode"]).stdout.split()
    except SlurmError as e:
        raise SlurmError(f"job {job_id}: neither squeue, scontrol nor sacct knows how it ended ({e})") from None
    if not rows:
        raise SlurmError(f"job {job_id}: sacct has no record of it")
    state, exit_code = rows[0].split("|")
    code, sig = (exit_code.split(":") + ["0"])[:2]
    return state.split()[0], int(code), int(sig)


def cancel(job_id: str, gone_s: float = 120.0, poll_s: float = 0.5) -> float:
    """``scancel`` the job and wait until squeue no longer lists it (not even COMPLETING: its nodes'
    slurmd killed every process of it). The seconds that took; SlurmError when it is still listed."""
    t0 = time.monotonic()
    _run(["scancel", job_id])
    while (state := listed(job_id)) is not None:
        if time.monotonic() - t0 > gone_s:
            raise SlurmError(f"job {job_id}: still {state} in squeue {gone_s:.0f} s after scancel")
        time.sleep(poll_s)
    return time.monotonic() - t0


def wait(job_id: str, timeout_s: float, poll_s: float = 1.0, gone_s: float = 120.0) -> JobEnd:
    """Wait for the job to end; at ``timeout_s`` (from now, the queue included) cancel it and wait
    until it is gone. The job's state and exit code."""
    t0 = time.monotonic()
    cancelled = False
    while True:
        state = job_state(job_id)
        if state is None or state in TERMINAL:
            break
        if time.monotonic() - t0 > timeout_s:
            cancel(job_id, gone_s)
            cancelled = True
            break
        time.sleep(poll_s)
    state, code, sig = job_end(job_id)
    return JobEnd(job_id, state, code, sig, cancelled, time.monotonic() - t0)
