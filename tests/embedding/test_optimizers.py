"""Sparse optimizers match torch.optim (or a reference formula) on the same rows.

Every row is its own torch Parameter so rows touched in different steps keep
separate state (Adam's step count differs per row, as in the shard).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from estuary.config.spec import InitializerSpec, SparseOptimizerSpec, TableSpec
from estuary.embedding import EmbeddingShard, SparseOptimizer, make_optimizer

DIM = 5
N_IDS = 8
STEPS = 7
IDS = np.arange(N_IDS, dtype=np.int64) * 7919 - 20


def _batches(seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """STEPS batches of unique row positions (row 0 in every one) with gradients."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        size = int(rng.integers(1, N_IDS))
        rest = rng.choice(np.arange(1, N_IDS), size=size, replace=False)
        pos = np.concatenate([[0], rest])
        out.append((pos, rng.normal(size=(pos.size, DIM)).astype(np.float32)))
    return out


def _shard(opt: SparseOptimizerSpec) -> EmbeddingShard:
    spec = TableSpec(dim=DIM, optimizer=opt, initializer=InitializerSpec("uniform", 0.5))
    return EmbeddingShard(spec, seed=3, name="t")


def _run_against_torch(
    opt: SparseOptimizerSpec,
    make_torch: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    after_step: Callable[[torch.nn.Parameter], object] | None = None,
) -> tuple[EmbeddingShard, list[torch.nn.Parameter], torch.optim.Optimizer]:
    shard = _shard(opt)
    init = shard.lookup(IDS, train=True)
    params = [torch.nn.Parameter(torch.tensor(row)) for row in init]
    torch_opt = make_torch(params)
    for pos, grads in _batches():
        shard.apply_gradients(IDS[pos], grads)
        torch_opt.zero_grad(set_to_none=True)
        for p, g in zip(pos, grads, strict=True):
            params[p].grad = torch.tensor(g)
        torch_opt.step()
        if after_step is not None:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:  # only touched rows, as in the shard
                        after_step(p)
    got = shard.lookup(IDS, train=False)
    want = np.stack([p.detach().numpy() for p in params])
    # 1e-6 relative; the 1e-7 absolute floor covers elements that pass near zero,
    # where a 1-ulp difference (torch's sqrt is not correctly rounded) is large
    # relative to the value.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(got, init)  # the test moved the rows
    return shard, params, torch_opt


def _state_of(shard: EmbeddingShard, key: str) -> np.ndarray:
    state = shard.state_dict()
    order = {int(i): n for n, i in enumerate(state["ids"])}
    return state[key][[order[int(i)] for i in IDS]]


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="torch fuses add-with-alpha into an FMA only on AVX2/AVX512 builds",
)
def test_sgd_matches_torch_bit_for_bit() -> None:
    shard, params, _ = _run_against_torch(
        SparseOptimizerSpec(name="sgd", lr=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
    )
    want = np.stack([p.detach().numpy() for p in params])
    np.testing.assert_array_equal(shard.lookup(IDS, train=False), want)


def test_sgd_matches_torch() -> None:
    _run_against_torch(
        SparseOptimizerSpec(name="sgd", lr=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
    )


def test_sgd_weight_decay_matches_torch_l2() -> None:
    # For plain SGD decoupled decay and L2-in-the-gradient are the same update.
    _run_against_torch(
        SparseOptimizerSpec(name="sgd", lr=0.1, weight_decay=0.3),
        lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.3, foreach=False),
    )


def test_adagrad_matches_torch() -> None:
    shard, params, opt = _run_against_torch(
        SparseOptimizerSpec(name="adagrad", lr=0.2, eps=1e-8, initial_accumulator=0.1),
        lambda ps: torch.optim.Adagrad(
            ps, lr=0.2, eps=1e-8, initial_accumulator_value=0.1, foreach=False
        ),
    )
    want = np.stack([opt.state[p]["sum"].numpy() for p in params])
    np.testing.assert_allclose(_state_of(shard, "opt.accum"), want, rtol=1e-6)


def test_adam_matches_torch_with_per_row_steps() -> None:
    shard, params, opt = _run_against_torch(
        SparseOptimizerSpec(name="adam", lr=0.05, beta1=0.8, beta2=0.95, eps=1e-7),
        lambda ps: torch.optim.Adam(ps, lr=0.05, betas=(0.8, 0.95), eps=1e-7, foreach=False),
    )
    steps = np.array([float(opt.state[p]["step"]) for p in params], np.float32)
    np.testing.assert_array_equal(_state_of(shard, "opt.step"), steps)
    assert steps[0] == STEPS and steps.min() < STEPS  # rows really differ in step count
    want_v = np.stack([opt.state[p]["exp_avg_sq"].numpy() for p in params])
    np.testing.assert_allclose(_state_of(shard, "opt.exp_avg_sq"), want_v, rtol=1e-6)


def test_adam_weight_decay_matches_adamw() -> None:
    _run_against_torch(
        SparseOptimizerSpec(name="adam", lr=0.05, weight_decay=0.5),
        lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.5, foreach=False),
    )


def test_adagrad_decoupled_weight_decay_and_clip() -> None:
    lr, wd, clip = 0.3, 0.2, 0.25

    class DecayedAdagrad(torch.optim.Adagrad):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.mul_(1 - lr * wd)
            return super().step(closure)

    _run_against_torch(
        SparseOptimizerSpec(name="adagrad", lr=lr, weight_decay=wd, clip=clip),
        lambda ps: DecayedAdagrad(ps, lr=lr, foreach=False),
        after_step=lambda p: p.clamp_(-clip, clip),
    )


def test_clip_bounds_every_touched_row() -> None:
    shard = _shard(SparseOptimizerSpec(name="sgd", lr=10.0, clip=0.01))
    shard.lookup(IDS, train=True)
    shard.apply_gradients(IDS, np.ones((N_IDS, DIM), np.float32))
    rows = shard.lookup(IDS, train=False)
    np.testing.assert_array_equal(rows, np.full_like(rows, -0.01))


def _ftrl_reference(
    w: np.ndarray, batches: list[tuple[np.ndarray, np.ndarray]], spec: SparseOptimizerSpec
) -> np.ndarray:
    """TensorFlow ApplyFtrl, float64 math, float32 state between steps."""
    w = w.astype(np.float32).copy()
    n = np.full_like(w, spec.initial_accumulator)
    z = np.zeros_like(w)
    p = -spec.lr_power
    for pos, g32 in batches:
        g = g32.astype(np.float64)
        n_old = n[pos].astype(np.float64)
        n_new = n_old + g * g
        sigma = (n_new**p - n_old**p) / spec.lr
        z_new = z[pos].astype(np.float64) + g - sigma * w[pos].astype(np.float64)
        quad = n_new**p / spec.lr + 2 * spec.l2
        w_new = np.where(np.abs(z_new) > spec.l1, (np.sign(z_new) * spec.l1 - z_new) / quad, 0.0)
        n[pos], z[pos], w[pos] = n_new, z_new, w_new
    return w


@pytest.mark.parametrize("lr_power", [-0.5, -0.7])
def test_ftrl_matches_reference_formula(lr_power: float) -> None:
    spec = SparseOptimizerSpec(
        name="ftrl", lr=0.1, l1=0.3, l2=0.05, lr_power=lr_power, initial_accumulator=0.1
    )
    shard = _shard(spec)
    init = shard.lookup(IDS, train=True)
    batches = _batches()
    for pos, grads in batches:
        shard.apply_gradients(IDS[pos], grads)
    got = shard.lookup(IDS, train=False)
    want = _ftrl_reference(init, batches, spec)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert (got == 0).any() and (got != 0).any()  # l1 zeroed some weights, not all


def test_unknown_optimizer_name_lists_registered() -> None:
    spec = SparseOptimizerSpec.__new__(SparseOptimizerSpec)
    object.__setattr__(spec, "name", "lamb")
    with pytest.raises(
        ValueError,
        match="adagrad, adam, ftrl, rowwise_adagrad, rowwise_adagrad_elem, rowwise_adam, sgd",
    ):
        make_optimizer(spec, DIM)


def test_a_subclass_gets_the_scaled_learning_rate_and_decay_from_the_base_class() -> None:
    # A plugin optimizer implements ``update(..., lr, decay)``; ``step(lr_scale=)``
    # hands it lr * scale and 1 - lr * scale * weight_decay, the plain values at 1.
    seen: list[tuple[float, float]] = []

    class Recording(SparseOptimizer):
        def update(
            self, storage: np.ndarray, rows: np.ndarray, grads: np.ndarray, lr: float, decay: float
        ) -> None:
            seen.append((lr, decay))

    opt = Recording(SparseOptimizerSpec(name="recording", lr=0.2, weight_decay=0.5), DIM)
    storage, rows = np.zeros((2, DIM), np.float32), np.zeros(1, np.int64)
    grads = np.zeros((1, DIM), np.float32)
    opt.step(storage, rows, grads)
    opt.step(storage, rows, grads, lr_scale=0.25)
    assert seen == [(0.2, 1.0 - 0.2 * 0.5), (0.2 * 0.25, 1.0 - 0.2 * 0.25 * 0.5)]


def _reference_rowwise(
    name: str, lr: float, decay: float, clip: float, **params: float
) -> tuple[np.ndarray, EmbeddingShard]:
    """The row-wise optimizers against a float64 reference of fbgemm's formulas,
    with per-row state (rows touched in different steps keep their own)."""
    opt = SparseOptimizerSpec(name=name, lr=lr, weight_decay=decay, clip=clip, **params)
    shard = _shard(opt)
    w = shard.lookup(IDS, train=True).astype(np.float64)
    accum = np.full(N_IDS, params.get("initial_accumulator", 0.0))
    m = np.zeros((N_IDS, DIM))
    v = np.zeros(N_IDS)
    t = np.zeros(N_IDS)
    b1, b2, eps = params.get("beta1", 0.9), params.get("beta2", 0.999), params.get("eps", 1e-8)
    for pos, grads in _batches():
        shard.apply_gradients(IDS[pos], grads)
        g = grads.astype(np.float64)
        w[pos] *= 1 - lr * decay
        if name == "rowwise_adagrad":
            accum[pos] += (g * g).mean(axis=1)
            w[pos] -= lr * g / (np.sqrt(accum[pos]) + eps)[:, None]
        elif name == "rowwise_adagrad_elem":
            # The row's past accumulator plus each element's own square of this step.
            w[pos] -= lr * g / (np.sqrt(accum[pos][:, None] + g * g) + eps)
            accum[pos] += (g * g).mean(axis=1)
        else:
            t[pos] += 1
            m[pos] = b1 * m[pos] + (1 - b1) * g
            v[pos] = b2 * v[pos] + (1 - b2) * (g * g).mean(axis=1)
            m_hat = m[pos] / (1 - b1 ** t[pos])[:, None]
            v_hat = v[pos] / (1 - b2 ** t[pos])
            w[pos] -= lr * m_hat / (np.sqrt(v_hat) + eps)[:, None]
        w[pos] = np.clip(w[pos], -clip, clip)
    return w, shard


@pytest.mark.parametrize("name", ["rowwise_adagrad", "rowwise_adagrad_elem", "rowwise_adam"])
@pytest.mark.parametrize(("decay", "clip"), [(0.0, 1e9), (0.05, 0.4)])
def test_rowwise_optimizers_match_the_reference(name: str, decay: float, clip: float) -> None:
    adagrad = name.startswith("rowwise_adagrad")
    params = {"initial_accumulator": 0.1} if adagrad else {"beta1": 0.8}
    want, shard = _reference_rowwise(name, 0.3, decay, clip, **params)
    got = shard.lookup(IDS, train=False)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert np.abs(got - shard.lookup(IDS, train=False)).max() == 0  # reads change nothing


@pytest.mark.parametrize(
    ("name", "width"),
    [
        ("rowwise_adagrad", DIM + 1),
        ("rowwise_adagrad_elem", DIM + 1),
        ("rowwise_adam", 2 * DIM + 2),
    ],
)
def test_rowwise_optimizers_keep_one_state_float_per_row(name: str, width: int) -> None:
    """The point of them: Adagrad's D accumulators become 1, Adam's D second
    moments 1; the state dict says so (its per-row scalars are (R,))."""
    optimizer = make_optimizer(SparseOptimizerSpec(name=name), DIM)
    assert optimizer.width == width
    shard = _shard(SparseOptimizerSpec(name=name))
    shard.lookup(IDS, train=True)
    shard.apply_gradients(IDS, np.ones((N_IDS, DIM), np.float32))
    state = shard.state_dict()
    scalars = {
        "rowwise_adagrad": ["opt.accum"],
        "rowwise_adagrad_elem": ["opt.accum"],
        "rowwise_adam": ["opt.exp_avg_sq", "opt.step"],
    }
    for key in scalars[name]:
        assert state[key].shape == (N_IDS,), key
    if name == "rowwise_adam":
        assert state["opt.exp_avg"].shape == (N_IDS, DIM)
        np.testing.assert_array_equal(state["opt.step"], np.ones(N_IDS, np.float32))


def test_rowwise_adagrad_elem_takes_full_adagrads_first_step() -> None:
    """A fresh row (accumulator 0) moves as under full Adagrad, ``lr g_j / |g_j|``
    per element, not ``rowwise_adagrad``'s ``lr g_j / rms(g)``; its one state
    float then holds the row's mean g^2."""
    grads = np.random.default_rng(5).normal(size=(N_IDS, DIM)).astype(np.float32)
    moved = {}
    for name in ("adagrad", "rowwise_adagrad_elem", "rowwise_adagrad"):
        shard = _shard(SparseOptimizerSpec(name=name, lr=0.1))
        before = shard.lookup(IDS, train=True)
        shard.apply_gradients(IDS, grads)
        moved[name] = shard.lookup(IDS, train=False) - before
        if name == "rowwise_adagrad_elem":
            state = shard.state_dict()
            accum = dict(zip(state["ids"].tolist(), state["opt.accum"].tolist(), strict=True))
            want = (grads * grads).mean(axis=1)
            np.testing.assert_allclose([accum[i] for i in IDS.tolist()], want, rtol=1e-6)
    np.testing.assert_allclose(moved["rowwise_adagrad_elem"], moved["adagrad"], atol=1e-6)
    assert np.abs(moved["rowwise_adagrad"] - moved["adagrad"]).max() > 0.01
