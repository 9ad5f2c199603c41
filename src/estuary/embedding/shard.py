"""One embedding shard: hash index + row storage + optimizer + admission.

Shapes: ``N`` ids in a call, ``D`` the table's dim, ``W`` floats per storage row,
``R`` rows held.

Calls on one shard are serialised by a lock inside the shard (uncontended cost
~50 ns); the numba kernels release the GIL, so other threads (torch compute,
another shard) run while a shard works.
"""

from __future__ import annotations

import threading

import numpy as np

from estuary.config.spec import TableSpec
from estuary.embedding.admission import AdmissionFilter
from estuary.embedding.hash_index import HashIndex
from estuary.embedding.hashing import as_ids, table_seed
from estuary.embedding.initializers import make_initializer
from estuary.embedding.optimizers import make_optimizer
from estuary.embedding.storage import UNKNOWN_ROW, RowStorage
from estuary.embedding.types import Float32Array, Int64Array, TableStats

# Keys of ``state_dict``. ``unknown.*`` arrays have a leading axis of 1 per shard.
IDS = "ids"
WEIGHTS = "weights"
OPT_PREFIX = "opt."
UNKNOWN_PREFIX = "unknown."
PENDING_IDS = "admission.ids"
PENDING_COUNTS = "admission.counts"

_UNKNOWN_ROWS = np.array([UNKNOWN_ROW], np.int64)


class EmbeddingShard:
    """Hash-keyed embedding rows of one shard, with their optimizer state.

    Implements ``EmbeddingStore``.

    Args:
        spec: table settings (dim, initializer, optimizer, admission, capacity).
        seed: job seed; with ``name`` it fixes every id's initial row.
        name: the table's name (all shards of a table share it, so an id's
            initial row does not depend on the shard count).
        max_pending_ids: bound on ids counted by the admission filter.
    """

    def __init__(
        self, spec: TableSpec, seed: int, name: str, *, max_pending_ids: int = 1 << 20
    ) -> None:
        self.spec = spec
        self.name = name
        self._seed = table_seed(seed, name)
        self._optimizer = make_optimizer(spec.optimizer, spec.dim)
        self._initializer = make_initializer(spec.initializer, spec.dim)
        # Separate coin stream for admission (the init stream uses the table seed).
        self._admission = AdmissionFilter(
            spec.admission, table_seed(seed, name + "/admission"), max_pending_ids=max_pending_ids
        )
        self._lock = threading.Lock()
        self._reset_rows(spec.initial_capacity_rows)
        self._lookups = self._hits = self._admissions = self._unknown_grads = 0
        self._evictions = 0

    def _reset_rows(self, capacity_rows: int) -> None:
        # Slot 0 is the unknown row: zeros and fresh optimizer state.
        self._index = HashIndex(capacity_rows, first_slot=UNKNOWN_ROW + 1)
        self._storage = RowStorage(self._optimizer.width, capacity_rows + 1)
        self._storage.array[UNKNOWN_ROW, : self.dim] = 0.0
        self._optimizer.init_state(self._storage.array, _UNKNOWN_ROWS)

    @property
    def dim(self) -> int:
        """Embedding width D."""
        return self.spec.dim

    def __len__(self) -> int:
        """Ids holding their own row."""
        return len(self._index)

    # -- lookups and updates -------------------------------------------------

    def lookup(self, ids: Int64Array, *, train: bool) -> Float32Array:
        """Rows of ``ids`` int64 (N,) -> fresh float32 (N, D).

        ``train=True`` inserts new ids that pass admission (initialised by the
        table's initializer); ids that do not pass read the unknown row.
        ``train=False`` never inserts.
        """
        ids = as_ids(ids)
        with self._lock:
            if train and self._admission.admits_all:
                rows, is_new = self._index.get_or_insert_mask(ids)
                n_new = int(np.count_nonzero(is_new))
                if n_new:
                    self._init_rows(rows[is_new], ids[is_new])
                hits = ids.size - n_new
            else:
                rows = self._index.lookup(ids)
                missing = rows < 0
                n_missing = int(np.count_nonzero(missing))
                hits = ids.size - n_missing
                if train and n_missing:
                    self._admit(ids, rows, missing)
            self._lookups += ids.size
            self._hits += hits
            return self._storage.gather(rows, self.dim)  # rows < 0 read UNKNOWN_ROW

    def _admit(self, ids: Int64Array, rows: Int64Array, missing: np.ndarray) -> None:
        # Policy decides, then the shard inserts; every occurrence of an admitted id
        # in this batch gets the new row (the slots are re-resolved).
        candidates = ids[missing]
        admitted = self._admission.observe(candidates)
        if admitted.size:
            new_rows = self._index.get_or_insert(admitted)
            self._init_rows(new_rows, admitted)
            rows[missing] = self._index.lookup(candidates)

    def _init_rows(self, rows: Int64Array, ids: Int64Array) -> None:
        self._storage.ensure_rows(self._index.slot_end)
        self._initializer.fill(self._storage.array, rows, ids, self._seed)
        self._optimizer.init_state(self._storage.array, rows)
        self._admissions += rows.size

    def apply_gradients(self, ids: Int64Array, grads: Float32Array) -> None:
        """One optimizer step for ``ids`` int64 (N,), unique, with ``grads`` float32 (N, D).

        Slots are re-resolved by id, so this is safe after later lookups inserted
        or moved rows. Ids without a row (not admitted, evicted, or only seen in
        eval) have their gradients summed into one step of the unknown row.
        """
        ids = as_ids(ids)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        if grads.shape != (ids.size, self.dim):
            raise ValueError(f"grads must have shape ({ids.size}, {self.dim}), got {grads.shape}")
        with self._lock:
            rows = self._index.lookup(ids)
            missing = rows < 0
            n_missing = int(np.count_nonzero(missing))
            storage = self._storage.array
            if n_missing == 0:
                self._optimizer.step(storage, rows, grads)
                return
            known = ~missing
            if n_missing < ids.size:
                self._optimizer.step(storage, rows[known], np.ascontiguousarray(grads[known]))
            unknown_grad = grads[missing].sum(axis=0, dtype=np.float32, keepdims=True)
            self._optimizer.step(storage, _UNKNOWN_ROWS, unknown_grad)
            self._unknown_grads += n_missing

    def remove(self, ids: Int64Array) -> int:
        """Drop the rows of ``ids`` int64 (N,) (eviction); returns how many existed.

        Their slots are reused by later admissions, which re-initialise them.
        """
        ids = as_ids(ids)
        with self._lock:
            removed = int(np.count_nonzero(self._index.remove(ids) >= 0))
            self._evictions += removed
            return removed

    def stats(self) -> TableStats:
        """Counters since construction (``load_state_dict`` keeps them)."""
        with self._lock:
            return TableStats(
                rows=len(self._index),
                bytes=self._index.nbytes + self._storage.nbytes + self._admission.nbytes,
                lookups=self._lookups,
                hits=self._hits,
                admissions=self._admissions,
                pending_ids=len(self._admission),
                unknown_grads=self._unknown_grads,
                evictions=self._evictions,
            )

    # -- snapshots -------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Flat numpy arrays for safetensors (R rows, P pending ids)::

            ids                 int64 (R,)
            weights             float32 (R, D)
            opt.<slot>          float32 (R, D) per optimizer slot, (R,) per scalar
            unknown.weights     float32 (1, D)
            unknown.opt.<slot>  float32 (1, D) or (1,)
            admission.ids       int64 (P,)   pending (not yet admitted) ids
            admission.counts    int64 (P,)   their sightings

        Rows come in hash-table order. Arrays are copies.
        """
        with self._lock:
            ids, rows = self._index.items()
            state = self._rows_state(rows, "")
            state[IDS] = ids
            state.update(self._rows_state(_UNKNOWN_ROWS, UNKNOWN_PREFIX))
            pending = self._admission.state_dict()
            state[PENDING_IDS] = pending["ids"]
            state[PENDING_COUNTS] = pending["counts"]
            return state

    def _rows_state(self, rows: Int64Array, prefix: str) -> dict[str, np.ndarray]:
        arr = self._storage.array
        opt = self._optimizer
        state: dict[str, np.ndarray] = {prefix + WEIGHTS: arr[rows, : self.dim]}
        for name in opt.state_names:
            state[f"{prefix}{OPT_PREFIX}{name}"] = arr[rows, opt.columns(name)]
        for name in opt.scalar_names:
            state[f"{prefix}{OPT_PREFIX}{name}"] = arr[rows, opt.columns(name).start]
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Replace all rows with ``state`` (as from ``state_dict``).

        ``ids`` and ``weights`` are required. Optimizer slots missing from
        ``state`` (e.g. a checkpoint from another optimizer) start fresh; extra
        ones are ignored. Stats counters are kept.
        """
        ids = as_ids(state[IDS])
        weights = np.asarray(state[WEIGHTS], np.float32)
        if weights.shape != (ids.size, self.dim):
            raise ValueError(
                f"{self.name}: weights shape {weights.shape} != ({ids.size}, {self.dim})"
            )
        with self._lock:
            self._reset_rows(max(ids.size, self.spec.initial_capacity_rows))
            rows, is_new = self._index.get_or_insert_mask(ids)
            if not is_new.all():
                raise ValueError(f"{self.name}: state has duplicate ids")
            self._storage.ensure_rows(self._index.slot_end)
            self._optimizer.init_state(self._storage.array, rows)
            self._load_rows(rows, state, "", ids.size)
            self._load_rows(_UNKNOWN_ROWS, state, UNKNOWN_PREFIX, 1)
            if PENDING_IDS in state:
                self._admission.load_state_dict(
                    {"ids": state[PENDING_IDS], "counts": state[PENDING_COUNTS]}
                )

    def _load_rows(
        self, rows: Int64Array, state: dict[str, np.ndarray], prefix: str, n: int
    ) -> None:
        arr = self._storage.array
        opt = self._optimizer
        if prefix + WEIGHTS in state:
            weights = np.asarray(state[prefix + WEIGHTS], np.float32)
            arr[rows, : self.dim] = weights.reshape(n, self.dim)
        for name in opt.state_names + opt.scalar_names:
            key = f"{prefix}{OPT_PREFIX}{name}"
            if key in state:
                cols = opt.columns(name)
                value = np.asarray(state[key], np.float32).reshape(n, cols.stop - cols.start)
                arr[rows, cols] = value
