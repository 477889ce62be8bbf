"""Runs a command as a Horovod job on this machine posing as several nodes:

    python tests/nodes.py --nodes 2 --per-node 2 -- python -m pytest tests/parallel/x.py

Horovod's Gloo mode takes each rank's rank, local rank and cross rank from its environment
(what horovodrun would set for a job on real hosts), so ranks 0-1 believe they share node0 and
ranks 2-3 node1; they meet through a rendezvous server started here, all on loopback. Exit
status: the first failing rank's, or 124 when the job outlives --timeout.
"""
import argparse
import os
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command to run")

    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer
    size = args.nodes * args.per_node
    hosts = ",".join(f"node{c}:{args.per_node}" for c in range(args.nodes))
    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(parse_hosts(hosts), size))
    procs = []
    try:
        for rank in range(size):
            cross, local = divmod(rank, args.per_node)
            env = {**os.environ, "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                   "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_CONTROLLER": "gloo",
                   "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "lo",
                   "HOROVOD_HOSTNAME": f"node{cross}", "HOROVOD_RANK": str(rank),
                   "HOROVOD_SIZE": str(size), "HOROVOD_LOCAL_RANK": str(local),
                   "HOROVOD_LOCAL_SIZE": str(args.per_node), "HOROVOD_CROSS_RANK": str(cross),
                   "HOROVOD_CROSS_SIZE": str(args.nodes)}
            procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + args.timeout
        status = 0
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"nodes.py: the job outlived {args.timeout:g} s", file=sys.stderr)
                return 124
            status = status or p.returncode
        return status
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
