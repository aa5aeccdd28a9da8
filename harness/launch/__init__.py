"""The launch layer: every group of processes harness starts and must be able to end (docs/parallel.md,
"The launch layer").

* ``group``  - ``LaunchSpec`` (nodes x processes per node, rendezvous, what each rank runs) and
  ``ProcessGroup``: its own session, death with its parent, a time limit and a no-progress limit,
  the group kill; ``torchrun(spec)`` starts torchrun with every rank under the ``rank`` wrapper;
* ``rank``   - the per-rank wrapper torchrun starts: the rank's log, its exit status or signal as a file;
* ``status`` - per-rank files: fixed-size status records rewritten in place, exit records, log tails;
* ``tree``   - the whole-tree kill: the session, every descendant, and whatever carries the launch's marker;
* ``ready``  - readiness of a server: a TCP port on 127.0.0.1 accepts, or a ready-line in its log;
* ``nodes``  - a launch over several nodes: one agent per node (``netns`` rehearsal, ``srun``), a c10d
  rendezvous, the interface and address each node announces, nodes lost, late or running other packages;
* ``noderun``- what each node runs for its share: its own run folder in its temp folder, made, named to
  torchrun and the ranks (``@tmp/NAME``), removed after (orphans of a killed one swept by the next);
* ``channel``- the coordinator's store: a multi-node launch's files published by the rank wrapper and
  mirrored into the coordinator's run folder (no shared folder);
* ``agents`` - the pull model (Kubernetes, VMs): ``harness node-agent`` on each node takes its share of
  every launch from the coordinator's agents store; ``RemoteGroup``, a ``ProcessGroup`` over that store;
* ``slurm``  - submit mode on an existing Slurm: the sbatch script, ``sbatch``/``squeue``/``scancel``;
* ``k8s``    - a JobSet manifest, validated offline against the JobSet CRD's schema (``schemas/``).

Standard library and psutil only (no torch), except where a multi-node launch needs torch's TCPStore
(``channel`` and ``agents``, imported there only): a rank wrapper of a one-host launch starts in milliseconds.
"""
