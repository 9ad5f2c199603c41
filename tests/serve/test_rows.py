"""An export's rows are served in their stored encoding (``FrozenTable``): memory
shrinks with the encoding, and predictions equal those of the same quantized rows
decoded whole into the training tables (the offline path)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from estuary.config.tables import TableSpec
from estuary.embedding import EmbeddingTable
from estuary.embedding.delta import IDS, UNKNOWN_PREFIX, WEIGHTS
from estuary.serve.export import export_checkpoint, load_export
from estuary.serve.frozen_table import SCALE, FrozenTable, decode_rows
from estuary.serve.model import ServingModel

from .conftest import TinyRun, instances

STORED = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int8": np.int8}


@pytest.fixture(scope="module")
def exports(tiny_run: TinyRun, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("rows")
    return {
        rows: export_checkpoint(tiny_run.run_dir, folder / rows, rows=rows).path
        for rows in ("float16", "bfloat16", "int8")
    } | {"float32": tiny_run.export_dir}


@pytest.mark.parametrize("rows", ["float16", "bfloat16", "int8"])
def test_rows_stay_in_their_encoding_and_take_less_memory(
    exports: dict[str, Path], rows: str
) -> None:
    full, small = load_export(exports["float32"]), load_export(exports[rows])
    for name, table in small.tables.items():
        assert isinstance(table, FrozenTable)
        reference = full.tables[name]
        assert isinstance(reference, FrozenTable)
        assert table.weights.dtype == STORED[rows]
        assert table.weights.shape == reference.weights.shape
        # The rows: half the bytes (16-bit), a quarter plus a float32 scale a row (int8).
        if rows == "int8":
            assert table.weights.nbytes * 4 == reference.weights.nbytes
            assert table.scale is not None and table.scale.nbytes == 4 * table.ids.size
        else:
            assert table.weights.nbytes * 2 == reference.weights.nbytes
            assert table.scale is None
    assert small.table_bytes < full.table_bytes


@pytest.mark.parametrize("rows", ["float32", "float16", "bfloat16", "int8"])
def test_predictions_equal_the_same_rows_decoded_whole(
    tiny_run: TinyRun, exports: dict[str, Path], rows: str
) -> None:
    served = load_export(exports[rows])
    # Offline: the same stored rows decoded at once into the training tables.
    offline = ServingModel(served.job, served.pipeline, served.version, served.dense_model)
    states = {}
    for name, table in served.tables.items():
        assert isinstance(table, FrozenTable)
        states[name] = table.state_dict()
    offline.load_tables(states)
    unseen = [{**row, "C1": "zzz-never-seen", "C2": "also-new"} for row in tiny_run.eval_rows[:50]]
    batch = served.pipeline.parse(instances(tiny_run.eval_rows) + instances(unseen))
    online = served.predict(batch).probabilities
    np.testing.assert_allclose(online, offline.predict(batch).probabilities, rtol=0, atol=1e-6)


def test_unknown_ids_read_their_shards_unknown_row_as_the_training_table_does() -> None:
    rng = np.random.default_rng(0)
    spec = TableSpec(dim=4, shards=3)
    ids = np.arange(0, 200, 2, dtype=np.int64)
    state = {
        IDS: ids,
        WEIGHTS: rng.normal(size=(ids.size, 4)).astype(np.float32),
        UNKNOWN_PREFIX + WEIGHTS: rng.normal(size=(3, 4)).astype(np.float32),
    }
    table = EmbeddingTable(spec, seed=0, name="t")
    table.load_state_dict(state)
    frozen = FrozenTable("t", state, shards=3)
    queries = np.array([5, 0, 7, 198, 199, 10_001, -3, 4], np.int64)  # odd ids: no row
    np.testing.assert_array_equal(
        frozen.lookup(queries, train=False), table.lookup(queries, train=False)
    )
    out = np.empty((queries.size, 4), np.float32)
    assert frozen.lookup(queries, train=False, out=out) is out


def test_int8_rows_decode_with_their_scale_and_the_table_is_read_only() -> None:
    weights = np.array([[127, -64], [1, 0]], np.int8)
    scale = np.array([0.5, 2.0], np.float32)
    np.testing.assert_array_equal(decode_rows(weights, scale), [[63.5, -32.0], [2.0, 0.0]])
    state = {
        IDS: np.array([9, 3]),
        WEIGHTS: weights,
        SCALE: scale,
        UNKNOWN_PREFIX + WEIGHTS: np.zeros((1, 2), np.float32),
    }
    table = FrozenTable("C7", state, shards=1)
    np.testing.assert_array_equal(table.lookup(np.array([3, 9, 4]), train=False)[0], [2.0, 0.0])
    with pytest.raises(TypeError, match=r"'C7'.*read-only"):
        table.apply_delta({})
    with pytest.raises(ValueError, match="int8 rows need"):
        FrozenTable("C7", {k: v for k, v in state.items() if k != SCALE}, shards=1)
