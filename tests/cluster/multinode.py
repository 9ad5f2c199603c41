"""Run as a script: a Ray cluster of two nodes on this machine (two raylets, two
object stores), for ``test_multinode.py``. Prints the cluster's
address and its Ray Client port, then holds the cluster until stdin closes.

    python tests/cluster/multinode.py CPUS_PER_NODE CLIENT_PORT
"""

from __future__ import annotations

import sys

from ray.cluster_utils import Cluster


def main() -> None:
    cpus, client_port = int(sys.argv[1]), int(sys.argv[2])
    # At this machine's own address, as a local Ray instance is (a driver process
    # that joins reaches the cluster there).
    head = {"num_cpus": cpus, "ray_client_server_port": client_port}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    print(cluster.address, flush=True)
    sys.stdin.read()  # Blocking wait: the test closes stdin when it is done
    cluster.shutdown()


if __name__ == "__main__":
    main()
