"""Unpooled (``pooling: none``) features: padded rows and masks must equal
torch's nn.Embedding on the same rows plus a padding row, and per-id gradients
must equal the reference's (summed over positions, rows and features)."""

import numpy as np
import torch

from estuary.data.types import JaggedIds
from estuary.nn.embedding_collection import EmbeddingCollection

from .test_embedding_collection import DictStore


def reference(
    store: DictStore, bags: JaggedIds, max_length: int | None = None
) -> tuple[list[int], torch.nn.Embedding, torch.Tensor, torch.Tensor]:
    """nn.Embedding over the bag's unique ids (+ a zero padding row) and the padded
    index (B, L) and mask (B, L) of the first ``max_length`` ids of every bag."""
    rows = [
        bags.values[s:e][:max_length].tolist()
        for s, e in zip(bags.offsets[:-1], bags.offsets[1:], strict=True)
    ]
    uniq = sorted({i for row in rows for i in row})
    pad = len(uniq)
    weight = np.stack([store.row(i) for i in uniq] + [np.zeros(store.dim, np.float32)])
    emb = torch.nn.Embedding.from_pretrained(
        torch.from_numpy(weight), freeze=False, padding_idx=pad
    )
    length = max(1, max(map(len, rows)))
    index = torch.full((len(rows), length), pad)
    for b, row in enumerate(rows):
        index[b, : len(row)] = torch.tensor([uniq.index(i) for i in row], dtype=torch.long)
    return uniq, emb, index, index != pad


def test_padded_rows_and_per_id_gradients_match_nn_embedding_on_random_bags() -> None:
    # "hist" (unpooled) and "item" (one id, summed) share table "items"; "tags"
    # (unpooled) has its own table. Bags are 0-9 ids, some empty.
    rng = np.random.default_rng(0)
    n_rows, dim = 64, 5
    items, tags = DictStore(dim), DictStore(dim)
    coll = EmbeddingCollection(
        ["item", "hist", "tags"],
        {"items": items, "tags": tags},
        feature_tables={"item": "items", "hist": "items"},
        pooling={"hist": "none", "tags": "none"},
    )
    assert coll.sequence_features == ["hist", "tags"]

    def bags(vocab: int) -> JaggedIds:
        sizes = rng.integers(0, 10, n_rows)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return JaggedIds(rng.integers(0, vocab, int(offsets[-1])).astype(np.int64), offsets)

    sparse = {
        "item": JaggedIds.single(rng.integers(0, 40, n_rows).astype(np.int64)),
        "hist": bags(40),
        "tags": bags(15),
    }
    looked = coll.lookup(sparse, train=True)
    assert len(items.lookups) == 1  # item and hist ids deduplicated together
    pooled, sequences = coll.embed(looked)
    assert list(sequences) == ["hist", "tags"]
    torch.testing.assert_close(pooled[:, 1:], torch.zeros(n_rows, 2, dim))  # unpooled slots

    item_ids = sparse["item"].values.tolist()
    item_ref = torch.from_numpy(np.stack([items.row(i) for i in item_ids])).requires_grad_(True)
    torch.testing.assert_close(pooled[:, 0], item_ref.detach())
    refs = {}
    for name, store in (("hist", items), ("tags", tags)):
        uniq, emb, index, mask = reference(store, sparse[name])
        values = emb(index)  # (B, L, D)
        torch.testing.assert_close(sequences[name].values, values.detach(), rtol=0, atol=0)
        assert torch.equal(sequences[name].mask, mask)
        refs[name] = (uniq, emb, values)

    # Padded positions get weights too: their gradient must be dropped.
    w_pooled = torch.randn(n_rows, dim)
    loss = (pooled[:, 0] * w_pooled).sum()
    ref_loss = (item_ref * w_pooled).sum()
    for name in ("hist", "tags"):
        w = torch.randn(refs[name][2].shape)
        loss = loss + (sequences[name].values * w).pow(2).sum()
        ref_loss = ref_loss + (refs[name][2] * w).pow(2).sum()
    loss.backward()
    ref_loss.backward()

    grads = {g.table: dict(zip(g.ids.tolist(), g.grads, strict=True)) for g in coll.gradients()}
    expected: dict[str, dict[int, np.ndarray]] = {"items": {}, "tags": {}}
    for name, table in (("hist", "items"), ("tags", "tags")):
        uniq, emb, _ = refs[name]
        assert emb.weight.grad is not None
        for k, i in enumerate(uniq):
            expected[table][i] = emb.weight.grad[k].numpy().copy()
    assert item_ref.grad is not None
    for b, i in enumerate(item_ids):
        expected["items"][i] = expected["items"].get(i, np.zeros(dim)) + item_ref.grad[b].numpy()
    for table in ("items", "tags"):
        assert sorted(grads[table]) == sorted(expected[table])
        for i, grad in grads[table].items():
            np.testing.assert_allclose(grad, expected[table][i], rtol=1e-6, atol=1e-6)


def test_masks_mark_real_ids_and_empty_bags_are_all_false() -> None:
    #   row:   r0        r1    r2    r3
    #   h:    [7 8 7]   [ ]   [9]   [ ]
    #   values (B, L=3, D)    mask
    #   [ 7  8  7 ]           [T T T]
    #   [ 0  0  0 ]           [F F F]
    #   [ 9  0  0 ]           [T F F]
    #   [ 0  0  0 ]           [F F F]
    store = DictStore(2)
    coll = EmbeddingCollection(["h"], {"h": store}, pooling={"h": "none"})
    bags = JaggedIds(np.array([7, 8, 7, 9]), np.array([0, 3, 3, 4, 4]))
    _, sequences = coll.embed(coll.lookup({"h": bags}, train=True))
    mask = sequences["h"].mask
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[True] * 3, [False] * 3, [True, False, False], [False] * 3]
    values = sequences["h"].values
    torch.testing.assert_close(values[0, 2], torch.from_numpy(store.row(7)))
    torch.testing.assert_close(values[~mask], torch.zeros(8, 2))


def test_a_batch_of_only_empty_bags_gives_one_masked_position() -> None:
    store = DictStore(3)
    coll = EmbeddingCollection(["q", "h"], {"h": store}, {"q": "h"}, pooling={"h": "none"})
    sparse = {
        "q": JaggedIds.single(np.array([4, 5])),
        "h": JaggedIds(np.zeros(0, np.int64), np.zeros(3, np.int64)),
    }
    pooled, sequences = coll.embed(coll.lookup(sparse, train=True))
    assert sequences["h"].values.shape == (2, 1, 3)  # L >= 1: no zero-size blocks
    assert not sequences["h"].mask.any()
    (pooled.sum() + sequences["h"].values.sum()).backward()
    (grad,) = coll.gradients()
    assert grad.ids.tolist() == [4, 5]
    np.testing.assert_allclose(grad.grads, np.ones((2, 3)))


def test_max_length_keeps_the_first_ids_and_never_looks_up_the_rest() -> None:
    # h: [1 2 3] [4] [5 6 7 8] with max length 2 -> [1 2] [4] [5 6]
    store = DictStore(2)
    coll = EmbeddingCollection(["h"], {"h": store}, pooling={"h": "none"}, max_lengths={"h": 2})
    bags = JaggedIds(np.array([1, 2, 3, 4, 5, 6, 7, 8]), np.array([0, 3, 4, 8]))
    looked = coll.lookup({"h": bags}, train=True)
    assert store.lookups[0].tolist() == [1, 2, 4, 5, 6]
    _, sequences = coll.embed(looked)
    uniq, emb, index, mask = reference(store, bags, max_length=2)
    assert uniq == [1, 2, 4, 5, 6]
    torch.testing.assert_close(sequences["h"].values, emb(index).detach())
    assert torch.equal(sequences["h"].mask, mask)
    sequences["h"].values.sum().backward()
    (grad,) = coll.gradients()
    assert grad.ids.tolist() == [1, 2, 4, 5, 6]
    np.testing.assert_allclose(grad.grads, np.ones((5, 2)))


def test_max_length_also_caps_pooled_bags() -> None:
    store = DictStore(2)
    coll = EmbeddingCollection(["s"], {"s": store}, max_lengths={"s": 1}).eval()
    bags = JaggedIds(np.array([1, 2, 3]), np.array([0, 2, 2, 3]))
    out = coll(coll.lookup({"s": bags}, train=False))[:, 0]
    expected = np.stack([store.row(1), np.zeros(2, np.float32), store.row(3)])
    np.testing.assert_allclose(out.numpy(), expected)


def test_forward_keeps_zeros_in_unpooled_slots_and_eval_needs_no_grad() -> None:
    store = DictStore(2)
    coll = EmbeddingCollection(["h"], {"h": store}, pooling={"h": "none"}).eval()
    looked = coll.lookup({"h": JaggedIds(np.array([1, 2]), np.array([0, 2]))}, train=False)
    pooled, sequences = coll.embed(looked)
    assert not pooled.requires_grad and not sequences["h"].values.requires_grad
    assert coll.gradients() == []
    assert torch.equal(coll(looked), torch.zeros(1, 1, 2))


def test_unpooled_feature_without_gradient_sends_zeros() -> None:
    store = DictStore(2)
    coll = EmbeddingCollection(["q", "h"], {"q": store, "h": store}, pooling={"h": "none"})
    sparse = {"q": JaggedIds.single(np.array([1])), "h": JaggedIds(np.array([2]), np.array([0, 1]))}
    pooled, _ = coll.embed(coll.lookup(sparse, train=True))
    pooled.sum().backward()  # the sequence is unused
    grads = {g.table: g for g in coll.gradients()}
    np.testing.assert_allclose(grads["h"].grads, np.zeros((1, 2)))
    np.testing.assert_allclose(grads["q"].grads, np.ones((1, 2)))
