"""The embedding parameter server: tables in their own process, shared by trainers.

    server = ServerProcess(ServerConfig({"C1": HostedTable(spec, seed)}, world_size=2))
    client = PSClient(server.address, server.authkey)
    tables = client.tables(rank=0, grad_scale=0.5)   # name -> RemoteTable
    rows = tables["C1"].lookup(ids, train=True)        # step 1 (may wait: staleness)
    tables["C1"].apply_gradients(ids, grads)           # push of step 1, rank 0
    # Every table of a step in one request (what the trainer does):
    rows_c1, rows_c2 = client.lookup_many([tables["C1"], tables["C2"]], [ids1, ids2], train=True)
    client.apply_gradients_many([tables["C1"], tables["C2"]], [ids1, ids2], [grads1, grads2])

Each step's pushes from all ``world_size`` ranks are summed per id and applied
as one optimizer step, exactly once (``StepAggregator``). Several servers can
split every table by id (``ShardedPSClient``, ``connect_servers``:
``runtime.ps_shards``). See docs/distributed.md.
"""

from estuary.ps.aggregation import StepAggregator, sum_by_id
from estuary.ps.client import PSClient, RemoteTable
from estuary.ps.process import ServerProcess
from estuary.ps.server import ParameterServer, serving
from estuary.ps.sharded import ShardedPSClient, ShardedTable, connect_servers, server_share
from estuary.ps.types import (
    HostedTable,
    ProtocolError,
    PSConnectionError,
    PSError,
    PSTimeoutError,
    ServerConfig,
)

__all__ = [
    "HostedTable",
    "PSClient",
    "PSConnectionError",
    "PSError",
    "PSTimeoutError",
    "ParameterServer",
    "ProtocolError",
    "RemoteTable",
    "ServerConfig",
    "ServerProcess",
    "ShardedPSClient",
    "ShardedTable",
    "StepAggregator",
    "connect_servers",
    "server_share",
    "serving",
    "sum_by_id",
]
