"""A real one-host Slurm for the tests: Debian's munged, slurmctld and slurmd (22.05), started as root
from a temporary folder (slurm.conf, a fresh munge key, state, spool, logs) on free ports, so it shares
nothing with a Slurm the machine may already run. One node, named after this host, with 2 CPUs;
proctrack/linuxproc (a job's processes are found by their parent links: no cgroup setup needed), no
accounting. ``SLURM_CONF`` points the client commands at it while it runs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")


def unavailable() -> str | None:
    """Why a one-host Slurm cannot start here (one line), or None."""
    missing = [c for c in (*DAEMONS, *CLIENTS) if shutil.which(c) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd "
                "slurm-client munge (.ci/run installs them)")
    if os.geteuid() != 0:
        return "the one-host Slurm's daemons start as root, and this is not root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONF = """\
ClusterName=harnesstest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/run/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# SIGTERM to SIGKILL at a job's end (30 s by default): a cancelled job is gone within seconds
KillWait=5
SlurmctldDebug=info
SlurmdDebug=info
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    host: str
    conf: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def log_tail(self, lines: int = 5) -> str:
        out = []
        for name in ("munge/munged.log", "log/slurmctld.log", "log/slurmd.log"):
            p = self.root / name
            if p.exists():
                out.append(f"{name}: " + " / ".join(p.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    def node_state(self) -> str:
        r = self.run("sinfo", "--noheader", "--nodes", self.host, "--format", "%t")
        return r.stdout.strip() or r.stderr.strip()


def start(root: Path) -> SlurmCluster:
    """Write the configuration, start the three daemons, and wait until the node is idle."""
    import psutil

    root.chmod(0o755)  # munged refuses a socket folder that others cannot traverse
    for d in ("run", "state", "spool", "log"):
        (root / d).mkdir(mode=0o755)
    (root / "munge").mkdir(mode=0o700)  # ... and a key anyone could read
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "plugstack.conf").write_text("")  # not /etc/slurm's
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(host=host, root=root, ctld_port=_free_port(), slurmd_port=_free_port(),
                                cpus=min(2, os.cpu_count() or 1),
                                memory_mb=min(1024, psutil.virtual_memory().total // 2**20)))
    os.environ["SLURM_CONF"] = str(conf)
    c = SlurmCluster(root, host, conf)
    subprocess.run(["munged", f"--key-file={key}", f"--socket={root}/run/munge.sock",
                    f"--pid-file={root}/run/munged.pid", f"--log-file={root}/munge/munged.log",
                    f"--seed-file={root}/munge/munged.seed"], check=True, capture_output=True, timeout=30)
    for cmd in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):  # foreground: ours to stop
        c.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True))
        time.sleep(0.5)
    deadline = time.monotonic() + 60
    while (state := c.node_state()) != "idle":
        dead = [p.args[0] for p in c.procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            stop(c)
            raise RuntimeError(f"the one-host Slurm did not come up (node state {state!r}"
                               f"{', ' + ' and '.join(dead) + ' exited' if dead else ''}):\n{c.log_tail()}")
        time.sleep(0.5)
    return c


def stop(c: SlurmCluster) -> None:
    """Cancel what is left of the tests' jobs, stop slurmd, slurmctld and munged."""
    r = c.run("squeue", "--noheader", "--format", "%i")
    jobs = r.stdout.split() if r.returncode == 0 else []
    if jobs:
        c.run("scancel", *jobs)
        deadline = time.monotonic() + 30
        while c.run("squeue", "--noheader", "--format", "%i").stdout.split() and time.monotonic() < deadline:
            time.sleep(0.5)
    for p in reversed(c.procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    subprocess.run(["munged", "--stop", f"--socket={c.root}/run/munge.sock"], capture_output=True, timeout=30)
