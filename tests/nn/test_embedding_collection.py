"""The autograd bridge: pooled values and per-id summed gradients must equal
torch's own EmbeddingBag on the same rows."""

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from estuary.data.types import JaggedIds
from estuary.embedding.types import TableStats
from estuary.nn.embedding_collection import EmbeddingCollection, SparseGradients


class DictStore:
    """Reference store: a dict of rows, deterministic per id, records calls."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.rows: dict[int, np.ndarray] = {}
        self.lookups: list[np.ndarray] = []
        self.applied: list[tuple[np.ndarray, np.ndarray]] = []

    def row(self, i: int) -> np.ndarray:
        rng = np.random.default_rng(abs(i) % (2**32))
        return rng.standard_normal(self.dim).astype(np.float32)

    def lookup(self, ids: np.ndarray, *, train: bool, out: np.ndarray | None = None) -> np.ndarray:
        self.lookups.append(ids.copy())
        rows = (
            np.stack([self.row(int(i)) for i in ids])
            if len(ids)
            else np.zeros((0, self.dim), np.float32)
        )
        if out is None:
            return rows
        out[:] = rows
        return out

    def apply_gradients(self, ids: np.ndarray, grads: np.ndarray, *, lr_scale: float = 1.0) -> None:
        self.applied.append((ids.copy(), grads.copy()))

    def stats(self) -> TableStats:
        return TableStats()


def test_single_valued_features_match_embedding_lookup_and_sum_gradients_per_id() -> None:
    store_a, store_b = DictStore(4), DictStore(4)
    coll = EmbeddingCollection(["a", "b"], {"a": store_a, "b": store_b})
    ids_a = np.array([5, -3, 5, 2**63 - 1], dtype=np.int64)
    ids_b = np.array([0, 0, 0, 1], dtype=np.int64)
    looked = coll.lookup({"a": JaggedIds.single(ids_a), "b": JaggedIds.single(ids_b)}, train=True)
    # each id gathered once
    assert sorted(store_a.lookups[0].tolist()) == sorted(set(ids_a.tolist()))
    out = coll(looked)  # (B, F, D)
    assert out.shape == (4, 2, 4)
    expected_a = torch.from_numpy(np.stack([store_a.row(int(i)) for i in ids_a]))
    torch.testing.assert_close(out[:, 0], expected_a)
    weights = torch.arange(4 * 2 * 4, dtype=torch.float32).reshape(4, 2, 4)
    (out * weights).sum().backward()
    grads = {g.table: g for g in coll.gradients()}
    g_a = grads["a"]
    for uid, grad in zip(g_a.ids, g_a.grads, strict=True):
        rows = np.nonzero(ids_a == uid)[0]
        np.testing.assert_allclose(grad, weights[rows, 0].sum(0).numpy())
    g_b = grads["b"]
    np.testing.assert_allclose(g_b.grads[g_b.ids.tolist().index(0)], weights[:3, 1].sum(0).numpy())


def test_multi_valued_bags_pool_like_torch_embedding_bag() -> None:
    store = DictStore(3)
    # rows: [7, 8] [7] [] [9, 9, 7]
    ids = JaggedIds(values=np.array([7, 8, 7, 9, 9, 7]), offsets=np.array([0, 2, 3, 3, 6]))
    for mode in ("sum", "mean"):
        coll = EmbeddingCollection(["s"], {"s": store}, pooling={"s": mode})
        looked = coll.lookup({"s": ids}, train=True)
        out = coll(looked)[:, 0]
        table = torch.from_numpy(np.stack([store.row(i) for i in (7, 8, 9)])).requires_grad_(True)
        ref = torch.nn.functional.embedding_bag(
            torch.tensor([0, 1, 0, 2, 2, 0]), table, torch.tensor([0, 2, 3, 3]), mode=mode
        )
        torch.testing.assert_close(out, ref)
        out.pow(2).sum().backward()
        ref.pow(2).sum().backward()
        (grad,) = coll.gradients()
        assert grad.ids.tolist() == [7, 8, 9]
        assert table.grad is not None
        np.testing.assert_allclose(grad.grads, table.grad.numpy(), rtol=1e-6)
        table.grad = None


def test_shared_table_deduplicates_across_features() -> None:
    store = DictStore(2)
    coll = EmbeddingCollection(["u", "v"], {"ids": store}, feature_tables={"u": "ids", "v": "ids"})
    looked = coll.lookup(
        {"u": JaggedIds.single(np.array([1, 2])), "v": JaggedIds.single(np.array([2, 3]))},
        train=True,
    )
    assert store.lookups[0].tolist() == [1, 2, 3]
    coll(looked).sum().backward()
    (grad,) = coll.gradients()
    np.testing.assert_allclose(grad.grads[1], [2.0, 2.0])  # id 2 used by both features


def test_eval_mode_keeps_no_gradient_leaves() -> None:
    store = DictStore(2)
    coll = EmbeddingCollection(["a"], {"a": store}).eval()
    out = coll(coll.lookup({"a": JaggedIds.single(np.array([1, 2]))}, train=False))
    assert not out.requires_grad
    assert coll.gradients() == []


def test_mixed_pooling_and_shared_tables_match_per_feature_embedding_bag() -> None:
    # u, v share table "ids"; w has its own. v means, u and w sum.
    #   row:   r0       r1     r2
    #   u:    [1, 2]   [ ]    [2]
    #   v:    [2]      [3, 3] [1, 4, 2]
    #   w:    [9]      [9]    [8]
    shared, own = DictStore(3), DictStore(3)
    coll = EmbeddingCollection(
        ["u", "v", "w"],
        {"ids": shared, "w": own},
        feature_tables={"u": "ids", "v": "ids"},
        pooling={"v": "mean"},
    )
    sparse = {
        "u": JaggedIds(values=np.array([1, 2, 2]), offsets=np.array([0, 2, 2, 3])),
        "v": JaggedIds(values=np.array([2, 3, 3, 1, 4, 2]), offsets=np.array([0, 1, 3, 6])),
        "w": JaggedIds.single(np.array([9, 9, 8])),
    }
    looked = coll.lookup(sparse, train=True)
    assert [s.tolist() for s in shared.lookups] == [[1, 2, 3, 4]]  # one lookup, each id once
    out = coll(looked)  # (B, F, D)

    refs, leaves = [], {}
    for feature, store in (("u", shared), ("v", shared), ("w", own)):
        bag = sparse[feature]
        uniq, inverse = np.unique(bag.values, return_inverse=True)
        leaf = torch.from_numpy(np.stack([store.row(int(i)) for i in uniq])).requires_grad_(True)
        leaves[feature] = (uniq, leaf)
        mode = coll.pooling[feature]
        refs.append(
            torch.nn.functional.embedding_bag(
                torch.from_numpy(inverse), leaf, torch.from_numpy(bag.offsets[:-1]), mode=mode
            )
        )
    ref = torch.stack(refs, dim=1)
    torch.testing.assert_close(out, ref)

    weights = torch.randn(3, 3, 3)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    grads = {g.table: dict(zip(g.ids.tolist(), g.grads, strict=True)) for g in coll.gradients()}
    expected: dict[str, dict[int, np.ndarray]] = {"ids": {}, "w": {}}
    for feature, (uniq, leaf) in leaves.items():
        table = "w" if feature == "w" else "ids"
        assert leaf.grad is not None
        for i, g in zip(uniq.tolist(), leaf.grad.numpy(), strict=True):
            expected[table][i] = expected[table].get(i, 0) + g
    for table, by_id in expected.items():
        assert sorted(grads[table]) == sorted(by_id)
        for i, g in by_id.items():
            np.testing.assert_allclose(grads[table][i], g, rtol=1e-5, atol=1e-6)


def test_malformed_batches_name_the_feature() -> None:
    coll = EmbeddingCollection(["a", "b"], {"a": DictStore(2), "b": DictStore(2)})
    good = JaggedIds.single(np.array([1, 2]))
    with pytest.raises(ValueError, match="'b' has 3 rows, expected 2"):
        coll.lookup({"a": good, "b": JaggedIds.single(np.array([1, 2, 3]))}, train=True)
    broken = JaggedIds(values=np.array([1, 2]), offsets=np.array([0, 1, 3]))  # past its ids
    with pytest.raises(ValueError, match="'b': offsets are not a CSR"):
        coll.lookup({"a": good, "b": broken}, train=True)


def test_gradients_resolve_once_on_any_thread_and_zero_when_unused() -> None:
    store = DictStore(2)
    coll = EmbeddingCollection(["a"], {"a": store})
    out = coll(coll.lookup({"a": JaggedIds.single(np.array([4, 4, 6]))}, train=True))
    out.sum().backward()
    pending = coll.gradients()  # nothing computed yet
    resolved: list[SparseGradients] = []
    thread = threading.Thread(target=lambda: resolved.extend(pending))  # as the update thread
    thread.start()
    thread.join()
    (grad,) = resolved
    assert grad.ids.tolist() == [4, 6]
    np.testing.assert_allclose(grad.grads, [[2.0, 2.0], [1.0, 1.0]])
    assert pending[0] is grad  # computed once

    coll(coll.lookup({"a": JaggedIds.single(np.array([7]))}, train=True))  # output unused
    (unused,) = coll.gradients()
    np.testing.assert_array_equal(unused.grads, np.zeros((1, 2), np.float32))
    assert coll.gradients() == []  # handed out once


class Batcher:
    """A ``MultiTableStore`` over DictStores: records its calls, then delegates."""

    def __init__(self) -> None:
        self.calls: list[int] = []  # tables per lookup_many

    def lookup_many(
        self,
        stores: Sequence[Any],
        ids: Sequence[np.ndarray],
        *,
        train: bool,
        out: Sequence[np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        self.calls.append(len(stores))
        outs = out if out is not None else [None] * len(stores)
        return [s.lookup(i, train=train, out=o) for s, i, o in zip(stores, ids, outs, strict=True)]

    def apply_gradients_many(
        self, stores: Any, ids: Any, grads: Any, lr_scales: Any = None
    ) -> None:
        raise AssertionError("not used by the collection")


class BatchedDictStore(DictStore):
    def __init__(self, dim: int, multi_store: Batcher) -> None:
        super().__init__(dim)
        self.multi_store = multi_store
        self.outs: list[np.ndarray | None] = []

    def lookup(self, ids: np.ndarray, *, train: bool, out: np.ndarray | None = None) -> np.ndarray:
        self.outs.append(out)
        return super().lookup(ids, train=train, out=out)


def test_tables_behind_one_multi_store_are_looked_up_in_one_call_into_one_block() -> None:
    shared, other = Batcher(), Batcher()
    stores = {"a": BatchedDictStore(3, shared), "b": BatchedDictStore(3, shared)}
    bags = {
        "a": JaggedIds.single(np.array([5, 1, 5], np.int64)),
        "b": JaggedIds(np.array([2, 9, 9, 4], np.int64), np.array([0, 1, 1, 4], np.int64)),
    }
    coll = EmbeddingCollection(["a", "b"], stores)
    looked = coll.lookup(bags, train=True)
    assert shared.calls == [2]  # one call for both tables
    # Each table wrote into its slice of one (U, D) block: a then b, back to back.
    out_a, out_b = stores["a"].outs[0], stores["b"].outs[0]
    assert out_a is not None and out_b is not None and out_a.base is out_b.base
    assert out_a.shape == (2, 3) and out_b.shape == (3, 3)
    # The same as fresh per-table lookups (no multi store in common).
    plain = {"a": BatchedDictStore(3, shared), "b": BatchedDictStore(3, other)}
    reference = EmbeddingCollection(["a", "b"], plain).lookup(bags, train=True)
    assert shared.calls == [2] and other.calls == []  # called one by one
    np.testing.assert_array_equal(looked.pooled, reference.pooled)
    np.testing.assert_array_equal(
        looked.pooled[:, 0], np.stack([stores["a"].row(i) for i in (5, 1, 5)])
    )
