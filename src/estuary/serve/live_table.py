"""``LiveTable``: a table whose rows are replaced whole, by reference.

A server that follows a run in a separate preparing process
(``estuary.serve.process_follow``) receives every version's tables whole, as
``SlotTable``s over a mapped slot file. The prediction engine is built once,
over ``LiveTable``s (first over ``FrozenTable``s of the checkpoint served); an
update points each one at its new table
(``ServingModel.serve_tables``, inside the model's lock), so no engine is
rebuilt and no row is written in the serving process.
"""

from __future__ import annotations

import numpy as np

from estuary.embedding.types import Float32Array, Int64Array, TableStats
from estuary.serve.frozen_table import FrozenTable, ReadOnlyStore
from estuary.serve.slot_table import SlotTable

__all__ = ["LiveTable"]

State = dict[str, np.ndarray]


class LiveTable(ReadOnlyStore):
    """Reads go to ``current``, a ``FrozenTable`` or ``SlotTable`` replaced by
    each update."""

    def __init__(self, current: FrozenTable | SlotTable) -> None:
        self.current = current
        self.name = current.name

    @property
    def dim(self) -> int:
        return self.current.dim

    def lookup(
        self, ids: Int64Array, *, train: bool, out: Float32Array | None = None
    ) -> Float32Array:
        return self.current.lookup(ids, train=train, out=out)

    def state_dict(self) -> State:
        return self.current.state_dict()

    def stats(self) -> TableStats:
        return self.current.stats()
