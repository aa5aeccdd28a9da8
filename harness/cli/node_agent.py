"""`harness node-agent --coordinator HOST[:PORT] [--node K]`: one node's agent of a multi-node run whose
coordinator cannot start processes on it (a Kubernetes pod, a plain VM: harness/launch/agents.py).

It joins the agents store that `harness run --nodes N --launcher agents` serves on node 0 (retrying
until --connect-timeout: a pod may start before node 0's name resolves), runs its node's share of every
launch, and exits 0 when the run ends; 1 when the coordinator was never reachable, 3 when its store
went away mid-run (the run was killed: whatever the agent ran is killed first), 2 on bad arguments.
"""

from __future__ import annotations

import sys

from harness.numbers import amount, count


def register(sub) -> None:
    p = sub.add_parser("node-agent", help="one node's agent of a multi-node run (harness run --launcher agents)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", required=True, metavar="HOST[:PORT]",
                   help="node 0, where `harness run --launcher agents` runs (a JobSet: the leader pod's DNS name)")
    p.add_argument("--node", type=count(0, 4095), default=None, metavar="K",
                   help="this node's index, 1..N-1 (default: JOB_COMPLETION_INDEX, a JobSet pod's index)")
    p.add_argument("--agents-port", type=count(1, 65535), default=None, metavar="PORT",
                   help="the agents store's port when --coordinator names none (default: HARNESS_AGENTS_PORT, 29600)")
    p.add_argument("--connect-timeout", type=amount(0, 7 * 86400, low_open=True), default=600.0, metavar="SECONDS",
                   help="how long to keep trying to reach the coordinator (default 600)")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness import settings
    from harness.launch import agents

    try:
        port = args.agents_port or settings.env("HARNESS_AGENTS_PORT")
        host, port = agents.split_endpoint(args.coordinator, port)
        node = agents.node_index(args.node)
    except agents.AgentError as e:
        print(f"harness node-agent: --coordinator/--node: {e}", file=sys.stderr)
        return 2
    return agents.Agent(host, port, node, connect_timeout_s=args.connect_timeout).run()
