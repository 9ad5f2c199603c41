"""``RemoteTable`` runs the ``EmbeddingStore`` conformance suite
(tests/embedding/test_store_conformance.py) against a real in-process server."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from estuary.config.spec import TableSpec
from estuary.ps import HostedTable, PSClient, RemoteTable, ServerConfig, serving

_SUITE_PATH = Path(__file__).parents[1] / "embedding" / "test_store_conformance.py"
_spec = importlib.util.spec_from_file_location("_store_conformance", _SUITE_PATH)
assert _spec is not None and _spec.loader is not None
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)

# The suite's tests of the shared EmbeddingStore + state_dict/delta/remove API; each
# takes the ``make`` fixture below.
test_eval_lookup_never_inserts_and_reads_the_unknown_row = (
    _suite.test_eval_lookup_never_inserts_and_reads_the_unknown_row
)
test_lookup_returns_fresh_float32_arrays = _suite.test_lookup_returns_fresh_float32_arrays
test_rows_survive_storage_growth = _suite.test_rows_survive_storage_growth
test_apply_gradients_moves_only_the_given_rows = (
    _suite.test_apply_gradients_moves_only_the_given_rows
)
test_removed_ids_read_the_unknown_row_and_count_as_evictions = (
    _suite.test_removed_ids_read_the_unknown_row_and_count_as_evictions
)
test_state_dict_round_trip_through_safetensors = (
    _suite.test_state_dict_round_trip_through_safetensors
)
test_snapshot_and_delta_restore_the_same_store = (
    _suite.test_snapshot_and_delta_restore_the_same_store
)


@pytest.fixture(params=[1, 4], ids=["remote1", "remote4"])
def make(request: pytest.FixtureRequest) -> Iterator[Callable[[TableSpec], RemoteTable]]:
    """Each call: a fresh server hosting one table ``t`` of 1 or 4 shards (world 1,
    no staleness bound: the suite looks up several times between updates)."""
    with contextlib.ExitStack() as stack:

        def factory(spec: TableSpec) -> RemoteTable:
            hosted = HostedTable(replace(spec, shards=request.param), seed=5)
            config = ServerConfig({"t": hosted}, world_size=1, staleness=None)
            server = stack.enter_context(serving(config))
            client = PSClient(server.address, server.authkey, timeout_s=30)
            stack.callback(client.close)
            return client.table("t")

        yield factory
