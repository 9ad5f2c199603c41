"""Row-wise sparse optimizers, registered by name, as numba kernels.

Storage layout (one float32 array per shard, shape (R, W), row-major)::

    row r:  [ weights (D) | state slot 1 (D) | ... | state slot k (D) | scalars (s) ]
            W = D * (1 + k) + s

    sgd                   k=0 s=0   W = D
    adagrad               k=1 s=0   W = 2D    accum
    adam                  k=2 s=1   W = 3D+1  exp_avg, exp_avg_sq | step
    ftrl                  k=2 s=0   W = 3D    accum (n), linear (z)
    rowwise_adagrad       k=0 s=1   W = D+1   | accum (of the row's mean g^2)
    rowwise_adagrad_elem  k=0 s=1   W = D+1   | accum (the same)
    rowwise_adam          k=1 s=2   W = 2D+2  exp_avg | exp_avg_sq (row mean), step

The state sits beside its row so one update touches one contiguous W-float span
(one or a few cache lines) instead of k+1 scattered ones. ``step`` is a per-row
float32 count (exact up to 2**24 updates of one row) so Adam's bias correction
follows each row's own history, as torch would for a parameter per row.

Every optimizer applies, per touched row and in this order:
1. decoupled weight decay ``w *= 1 - lr * weight_decay`` (as torch.optim.AdamW),
2. its update,
3. ``clip``: ``w = clamp(w, -clip, clip)``.

``lr`` there is the step's learning rate: the configured one times the step's
``lr_scale`` (``SparseOptimizer.step``; an update plan's per-table scale), so a
scaled step is exactly the step of the optimizer configured with ``lr * scale``.

Sgd, adagrad and adam compute in float32 in torch's operation order, with fused
multiply-adds where torch's CPU kernels fuse (add with alpha, addcmul, lerp).
SGD reproduces torch.optim bit for bit; adagrad and adam differ by ~1 ulp
because torch's CPU sqrt (MKL VML) is not correctly rounded. FTRL computes
each element in float64 and stores float32 (the sqrt-difference term is
cancellation-prone).

Kernels use numpy's error model (no ZeroDivisionError check, every denominator
here is > 0), which lets LLVM vectorise the per-element loop, and prefetch the
row a few ids ahead (``estuary.embedding.prefetch``); neither changes results.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Self

import numpy as np
from numba import njit

from estuary.config.build import build_dataclass
from estuary.config.spec import SparseOptimizerSpec
from estuary.embedding.prefetch import ROWS_AHEAD, prefetch_span
from estuary.embedding.types import Float32Array, Int64Array
from estuary.plugins import OPTIMIZERS


@njit(cache=True, nogil=True, inline="always")
def _clamp(w: np.float32, clip: np.float32) -> np.float32:
    if w > clip:
        return clip
    if w < -clip:
        return -clip
    return w


@njit(cache=True, nogil=True, inline="always")
def _fma32(x: np.float32, y: np.float32, z: np.float32) -> np.float32:
    # float32 fused multiply-add: x*y is exact in float64, then one rounding (a
    # second, to float32, changes the result only in vanishingly rare ties).
    # torch's vectorised CPU kernels (add with alpha, addcmul, lerp) are fused.
    return np.float32(np.float64(x) * np.float64(y) + np.float64(z))


@njit(cache=True, nogil=True, error_model="numpy")
def _sgd_kernel(
    storage: Float32Array,
    rows: Int64Array,
    grads: Float32Array,
    dim: int,
    lr: float,
    decay: float,
    clip: float,
) -> None:
    neg_lr = np.float32(-lr)
    decay32 = np.float32(decay)
    clip32 = np.float32(clip)
    width = storage.shape[1]
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width, width)
        r = rows[n]
        for j in range(dim):
            w = storage[r, j] * decay32
            w = _fma32(neg_lr, grads[n, j], w)  # param.add_(grad, alpha=-lr)
            storage[r, j] = _clamp(w, clip32)


@njit(cache=True, nogil=True, error_model="numpy")
def _adagrad_kernel(
    storage: Float32Array,
    rows: Int64Array,
    grads: Float32Array,
    dim: int,
    lr: float,
    eps: float,
    decay: float,
    clip: float,
) -> None:
    neg_lr = np.float32(-lr)
    eps32 = np.float32(eps)
    decay32 = np.float32(decay)
    clip32 = np.float32(clip)
    width = storage.shape[1]
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width, width)
        r = rows[n]
        for j in range(dim):
            g = grads[n, j]
            acc = _fma32(g, g, storage[r, dim + j])  # state_sum.addcmul_(grad, grad)
            storage[r, dim + j] = acc
            std = np.sqrt(acc) + eps32  # state_sum.sqrt().add_(eps)
            w = storage[r, j] * decay32
            w = w + neg_lr * g / std  # param.addcdiv_(grad, std, value=-lr): not fused
            storage[r, j] = _clamp(w, clip32)


@njit(cache=True, nogil=True, error_model="numpy")
def _adam_kernel(
    storage: Float32Array,
    rows: Int64Array,
    grads: Float32Array,
    dim: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    decay: float,
    clip: float,
) -> None:
    one_minus_b1 = np.float32(1.0 - beta1)
    b2 = np.float32(beta2)
    one_minus_b2 = np.float32(1.0 - beta2)
    eps32 = np.float32(eps)
    decay32 = np.float32(decay)
    clip32 = np.float32(clip)
    m0, v0, step_col = dim, 2 * dim, 3 * dim
    width = storage.shape[1]
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width, width)
        r = rows[n]
        step = storage[r, step_col] + np.float32(1.0)
        storage[r, step_col] = step
        # Bias corrections in float64 as torch computes them in Python floats.
        step_size = np.float32(-(lr / (1.0 - beta1 ** np.float64(step))))
        bc2_sqrt = np.float32(math.sqrt(1.0 - beta2 ** np.float64(step)))
        for j in range(dim):
            g = grads[n, j]
            m = storage[r, m0 + j]
            # exp_avg.lerp_(grad, 1 - beta1), torch's two-sided lerp formula.
            if one_minus_b1 < 0.5:
                m = _fma32(one_minus_b1, g - m, m)
            else:
                m = _fma32(one_minus_b1 - np.float32(1.0), g - m, g)
            # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            v = _fma32(one_minus_b2 * g, g, storage[r, v0 + j] * b2)
            storage[r, m0 + j] = m
            storage[r, v0 + j] = v
            denom = np.sqrt(v) / bc2_sqrt + eps32
            w = storage[r, j] * decay32
            w = w + step_size * m / denom
            storage[r, j] = _clamp(w, clip32)


@njit(cache=True, nogil=True, error_model="numpy")
def _ftrl_kernel(
    storage: Float32Array,
    rows: Int64Array,
    grads: Float32Array,
    dim: int,
    lr: float,
    l1: float,
    l2: float,
    lr_power: float,
    decay: float,
    clip: float,
) -> None:
    # FTRL-Proximal (McMahan et al. 2013) in TensorFlow's ApplyFtrl form.
    clip32 = np.float32(clip)
    decay32 = np.float32(decay)
    n0, z0 = dim, 2 * dim
    p = -lr_power
    width = storage.shape[1]
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width, width)
        r = rows[n]
        for j in range(dim):
            g = np.float64(grads[n, j])
            w = np.float64(storage[r, j] * decay32)
            acc = np.float64(storage[r, n0 + j])
            acc_new = acc + g * g
            if p == 0.5:
                root_new = math.sqrt(acc_new)
                sigma = (root_new - math.sqrt(acc)) / lr
            else:
                root_new = acc_new**p
                sigma = (root_new - acc**p) / lr
            z = np.float64(storage[r, z0 + j]) + g - sigma * w
            # Closed-form argmin of the proximal objective; |z| <= l1 gives exact 0.
            quadratic = root_new / lr + 2.0 * l2
            w_new = (math.copysign(l1, z) - z) / quadratic if abs(z) > l1 else 0.0
            storage[r, n0 + j] = np.float32(acc_new)
            storage[r, z0 + j] = np.float32(z)
            storage[r, j] = _clamp(np.float32(w_new), clip32)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _row_mean_square(grads: Float32Array, n: int) -> np.float32:
    """``mean_j(g_j^2)`` of gradient row ``n`` (D,), in float32.

    Summed in 8 interleaved partial sums (element j into sum j % 8, the sums
    added pairwise, the D % 8 tail into the first): a fixed order, so results
    are deterministic, that LLVM turns into one 8-lane vector accumulator. One
    serial sum (D dependent adds) took ~30% of the fused bf16 row-wise update at
    D=64 (fbgemm's GPU kernels reduce in a tree too).
    """
    dim = grads.shape[1]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    j = 0
    while j + 8 <= dim:
        g0, g1, g2, g3 = grads[n, j], grads[n, j + 1], grads[n, j + 2], grads[n, j + 3]
        g4, g5, g6, g7 = grads[n, j + 4], grads[n, j + 5], grads[n, j + 6], grads[n, j + 7]
        s0 += g0 * g0
        s1 += g1 * g1
        s2 += g2 * g2
        s3 += g3 * g3
        s4 += g4 * g4
        s5 += g5 * g5
        s6 += g6 * g6
        s7 += g7 * g7
        j += 8
    while j < dim:
        g = grads[n, j]
        s0 += g * g
        j += 1
    return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) / np.float32(dim)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _rowwise_adagrad_rate(
    storage: Float32Array,
    r: int,
    column: int,
    grads: Float32Array,
    n: int,
    lr: float,
    eps32: np.float32,
) -> np.float32:
    """Row-wise Adagrad's accumulator update for row ``r`` (its float32 word
    ``column``) by gradient row ``n`` (D,); returns the row's step size."""
    acc = storage[r, column] + _row_mean_square(grads, n)
    storage[r, column] = acc
    return np.float32(lr) / (np.sqrt(acc) + eps32)


@njit(cache=True, nogil=True, error_model="numpy")
def _rowwise_adagrad_kernel(
    storage: Float32Array,
    rows: Int64Array,
    grads: Float32Array,
    dim: int,
    lr: float,
    eps: float,
    decay: float,
    clip: float,
) -> None:
    # fbgemm's exact row-wise Adagrad: one accumulator per row, of the mean g^2.
    eps32 = np.float32(eps)
    decay32 = np.float32(decay)
    clip32 = np.float32(clip)
    width = storage.shape[1]
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width, width)
        r = rows[n]
        step = _rowwise_adagrad_rate(storage, r, dim, grads, n, lr, eps32)
        for j in range(dim):
            w = storage[r, j] * decay32 - step * grads[n, j]
            storage[r, j] = _clamp(w, clip32)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _elementwise_current_step(
    past: np.float32, g: np.float32, lr32: np.float32, eps32: np.float32
) -> np.float32:
    """``rowwise_adagrad_elem``'s step of one element: ``lr g / (sqrt(past + g^2)
    + eps)``, ``past`` the row's accumulator before this update."""
    return lr32 * g / (np.sqrt(past + g * g) + eps32)


@njit(cache=True, nogil=True, error_model="numpy")
def _rowwise_adagrad_elem_kernel(
    storage: Float32Array,
    rows: Int64Array,
    grads: Float32Array,
    dim: int,
    lr: float,
    eps: float,
    decay: float,
    clip: float,
) -> None:
    # Row-wise Adagrad's accumulator (the row's summed mean g^2) stands in for
    # each element's past; the element's own g^2 is this step's term.
    lr32 = np.float32(lr)
    eps32 = np.float32(eps)
    decay32 = np.float32(decay)
    clip32 = np.float32(clip)
    width = storage.shape[1]
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width, width)
        r = rows[n]
        past = storage[r, dim]
        for j in range(dim):
            w = storage[r, j] * decay32 - _elementwise_current_step(past, grads[n, j], lr32, eps32)
            storage[r, j] = _clamp(w, clip32)
        storage[r, dim] = past + _row_mean_square(grads, n)


@njit(cache=True, nogil=True, error_model="numpy")
def _rowwise_adam_kernel(
    storage: Float32Array,
    rows: Int64Array,
    grads: Float32Array,
    dim: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    decay: float,
    clip: float,
) -> None:
    # fbgemm's partial row-wise Adam: the first moment per element, the second
    # (of the mean g^2) and the step count per row.
    b1 = np.float32(beta1)
    b2 = np.float32(beta2)
    eps32 = np.float32(eps)
    decay32 = np.float32(decay)
    clip32 = np.float32(clip)
    one = np.float32(1.0)
    m0, v_col, t_col = dim, 2 * dim, 2 * dim + 1
    width = storage.shape[1]
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width, width)
        r = rows[n]
        t = storage[r, t_col] + one
        storage[r, t_col] = t
        v = b2 * storage[r, v_col] + (one - b2) * _row_mean_square(grads, n)
        storage[r, v_col] = v
        correction1 = one - b1 ** np.float64(t)
        denom = np.sqrt(v / np.float32(one - b2 ** np.float64(t))) + eps32
        step = np.float32(lr / correction1) / denom
        for j in range(dim):
            m = b1 * storage[r, m0 + j] + (one - b1) * grads[n, j]
            storage[r, m0 + j] = m
            w = storage[r, j] * decay32 - step * m
            storage[r, j] = _clamp(w, clip32)


@njit(cache=True, nogil=True)
def _fill_columns(
    storage: Float32Array, rows: Int64Array, start: int, stop: int, value: float
) -> None:
    v = np.float32(value)
    width = storage.shape[1]
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width + start, stop - start)
        for c in range(start, stop):
            storage[rows[n], c] = v


_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(SparseOptimizerSpec)) - {"extra"}


@dataclass(frozen=True)
class SGDParams:
    """The parameters of ``sgd``, which every optimizer reads.

    An optimizer declares its parameters as one of these dataclasses
    (``SparseOptimizer.params_type``); the config loader refuses any other
    parameter of the ``optimizer`` section set for it, naming the field
    (``...optimizer.beta1: not a parameter of optimizer 'adagrad' (its
    parameters: lr, weight_decay, clip, eps, initial_accumulator)``). The values
    of ``SparseOptimizerSpec``'s fields are checked there. A plugin optimizer
    may subclass one of these with parameters of its own, typed and with
    defaults, and an optional ``validate(path)`` raising ``ConfigError``::

        @dataclass(frozen=True)
        class LionParams(SGDParams):
            beta: float = 0.99

            def validate(self, path: str) -> None:
                if not 0.0 <= self.beta < 1.0:
                    raise ConfigError(f"{path}.beta", "must be in [0, 1)")

    A job then sets them as keys of its ``optimizer`` section
    (``{name: lion, lr: 0.01, beta: 0.9}``); they are checked at load like any
    field and read from ``self.params``.

    Args:
        lr: learning rate.
        weight_decay: decoupled L2 decay applied to touched rows, per step.
        clip: row values are clipped to ``[-clip, clip]`` after each update.
    """

    lr: float
    weight_decay: float
    clip: float | None

    @classmethod
    def from_spec(cls, spec: SparseOptimizerSpec, where: str = "optimizer") -> Self:
        """This optimizer's parameters out of the job's ``optimizer`` section (at
        field path ``where``), typed and checked as the loader checks a section.

        Raises:
            ConfigError: a parameter of its own with a wrong type or value, or
                required and not set.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        values = {name: spec.extra[name] for name in names if name in spec.extra}
        values.update({name: getattr(spec, name) for name in names if name in _SPEC_FIELDS})
        return build_dataclass(cls, values, where)


@dataclass(frozen=True)
class AdagradParams(SGDParams):
    """``adagrad``: ``eps`` (denominator floor), ``initial_accumulator``."""

    eps: float
    initial_accumulator: float


@dataclass(frozen=True)
class AdamParams(SGDParams):
    """``adam``: ``beta1``, ``beta2`` (moment decays), ``eps``."""

    beta1: float
    beta2: float
    eps: float


@dataclass(frozen=True)
class FTRLParams(SGDParams):
    """``ftrl``: ``initial_accumulator``, ``l1``, ``l2``, ``lr_power``."""

    initial_accumulator: float
    l1: float
    l2: float
    lr_power: float


class SparseOptimizer(ABC):
    """A row-wise optimizer over a (R, W) float32 storage (layout: module docstring).

    Args:
        spec: the table's optimizer section.
        dim: embedding width D.

    Subclasses name their D-wide state slots in ``state_names`` and their per-row
    scalars in ``scalar_names``, give initial values in ``initial_values``, and
    declare their parameters in ``params_type`` (read from ``self.params``).
    """

    state_names: ClassVar[tuple[str, ...]] = ()
    scalar_names: ClassVar[tuple[str, ...]] = ()
    params_type: ClassVar[type[SGDParams]] = SGDParams

    def __init__(self, spec: SparseOptimizerSpec, dim: int) -> None:
        self.spec = spec
        self.params = self.params_type.from_spec(spec)
        self.dim = dim
        self.decay = 1.0 - spec.lr * spec.weight_decay
        self.clip = float(spec.clip) if spec.clip is not None else math.inf

    @classmethod
    def parameters(cls) -> tuple[str, ...]:
        """The ``optimizer`` section's parameters this optimizer reads."""
        return tuple(f.name for f in dataclasses.fields(cls.params_type))

    @property
    def width(self) -> int:
        """Floats per storage row, W."""
        return self.dim * (1 + len(self.state_names)) + len(self.scalar_names)

    def initial_values(self) -> dict[str, float]:
        """Value each state slot / scalar starts at (default 0)."""
        return {}

    def columns(self, name: str) -> slice:
        """Storage columns of state slot or scalar ``name``."""
        if name in self.state_names:
            start = self.dim * (1 + self.state_names.index(name))
            return slice(start, start + self.dim)
        if name in self.scalar_names:
            start = self.dim * (1 + len(self.state_names)) + self.scalar_names.index(name)
            return slice(start, start + 1)
        raise KeyError(f"{type(self).__name__} has no state {name!r}")

    def initial_state_row(self) -> Float32Array:
        """Initial values of a row's state columns (all after the weights), float32 (W - D,)."""
        row = np.zeros(self.width - self.dim, np.float32)
        initial = self.initial_values()
        for name in self.state_names + self.scalar_names:
            cols = self.columns(name)
            row[cols.start - self.dim : cols.stop - self.dim] = initial.get(name, 0.0)
        return row

    def init_state(self, storage: Float32Array, rows: Int64Array) -> None:
        """Reset the state columns (everything after the weights) of ``rows`` (N,)."""
        initial = self.initial_values()
        for name in self.state_names + self.scalar_names:
            cols = self.columns(name)
            _fill_columns(storage, rows, cols.start, cols.stop, initial.get(name, 0.0))

    def step(
        self,
        storage: Float32Array,
        rows: Int64Array,
        grads: Float32Array,
        *,
        lr_scale: float = 1.0,
    ) -> None:
        """One update of ``rows`` int64 (N,) (unique) with ``grads`` float32 (N, D),
        at learning rate ``lr * lr_scale``: exactly the step this optimizer built
        with that learning rate would take (weight decay included). ``lr_scale``
        1 is the configured step, bit for bit."""
        self.update(storage, rows, grads, *self.rates(lr_scale))

    def rates(self, lr_scale: float = 1.0) -> tuple[float, float]:
        """``(lr, decay)`` of a step at ``lr_scale``: the learning rate and the
        weight-decay factor ``1 - lr * weight_decay`` (``update``'s arguments)."""
        lr = self.params.lr * lr_scale
        decay = self.decay if lr_scale == 1.0 else 1.0 - lr * self.params.weight_decay
        return lr, decay

    @abstractmethod
    def update(
        self, storage: Float32Array, rows: Int64Array, grads: Float32Array, lr: float, decay: float
    ) -> None:
        """One update of ``rows`` int64 (N,) (unique) with ``grads`` float32 (N, D)
        at learning rate ``lr``, rows first multiplied by ``decay`` (``1 - lr *
        weight_decay``); ``step`` passes this step's values."""


def register_optimizer(name: str) -> Callable[[type[SparseOptimizer]], type[SparseOptimizer]]:
    """Class decorator: make an optimizer available as ``optimizer.name``
    (in ``estuary.plugins.OPTIMIZERS``)."""

    def wrap(cls: type[SparseOptimizer]) -> type[SparseOptimizer]:
        OPTIMIZERS.register(name, cls)
        return cls

    return wrap


def make_optimizer(
    spec: SparseOptimizerSpec, dim: int, where: str = "optimizer"
) -> SparseOptimizer:
    """The registered optimizer named ``spec.name``, built for width ``dim``.

    Raises:
        ConfigError: (a ``ValueError``) an unknown name, at ``{where}.name``.
    """
    cls: type[SparseOptimizer] = OPTIMIZERS.get(spec.name, f"{where}.name")
    return cls(spec, dim)


@register_optimizer("sgd")
class SGD(SparseOptimizer):
    """``w -= lr * g`` (matches torch.optim.SGD without momentum)."""

    def update(
        self, storage: Float32Array, rows: Int64Array, grads: Float32Array, lr: float, decay: float
    ) -> None:
        _sgd_kernel(storage, rows, grads, self.dim, lr, decay, self.clip)


@register_optimizer("adagrad")
class Adagrad(SparseOptimizer):
    """``accum += g^2; w -= lr * g / (sqrt(accum) + eps)`` (torch.optim.Adagrad)."""

    state_names = ("accum",)
    params_type = AdagradParams
    params: AdagradParams

    def initial_values(self) -> dict[str, float]:
        return {"accum": self.params.initial_accumulator}

    def update(
        self, storage: Float32Array, rows: Int64Array, grads: Float32Array, lr: float, decay: float
    ) -> None:
        _adagrad_kernel(storage, rows, grads, self.dim, lr, self.params.eps, decay, self.clip)


@register_optimizer("adam")
class Adam(SparseOptimizer):
    """Adam with per-row step counts (torch.optim.Adam; AdamW with weight decay)."""

    state_names = ("exp_avg", "exp_avg_sq")
    scalar_names = ("step",)
    params_type = AdamParams
    params: AdamParams

    def update(
        self, storage: Float32Array, rows: Int64Array, grads: Float32Array, lr: float, decay: float
    ) -> None:
        s = self.params
        _adam_kernel(storage, rows, grads, self.dim, lr, s.beta1, s.beta2, s.eps, decay, self.clip)


@register_optimizer("ftrl")
class FTRL(SparseOptimizer):
    """FTRL-Proximal with ``l1``, ``l2``, ``lr_power`` (TensorFlow ApplyFtrl).

    ``accum`` starts at ``initial_accumulator`` (TF's default is 0.1; keep it > 0
    when ``lr_power`` is not -0.5 or 0).
    """

    state_names = ("accum", "linear")
    params_type = FTRLParams
    params: FTRLParams

    def initial_values(self) -> dict[str, float]:
        return {"accum": self.params.initial_accumulator}

    def update(
        self, storage: Float32Array, rows: Int64Array, grads: Float32Array, lr: float, decay: float
    ) -> None:
        s = self.params
        _ftrl_kernel(storage, rows, grads, self.dim, lr, s.l1, s.l2, s.lr_power, decay, self.clip)


@register_optimizer("rowwise_adagrad")
class RowwiseAdagrad(SparseOptimizer):
    """Row-wise Adagrad (fbgemm's exact row-wise Adagrad, TorchRec's default): one
    accumulator per row, ``accum += mean_j(g_j^2); w -= lr * g / (sqrt(accum) +
    eps)``. State: 1 float per row instead of D."""

    scalar_names = ("accum",)
    params_type = AdagradParams
    params: AdagradParams

    def initial_values(self) -> dict[str, float]:
        return {"accum": self.params.initial_accumulator}

    def update(
        self, storage: Float32Array, rows: Int64Array, grads: Float32Array, lr: float, decay: float
    ) -> None:
        s = self.params
        _rowwise_adagrad_kernel(storage, rows, grads, self.dim, lr, s.eps, decay, self.clip)


@register_optimizer("rowwise_adagrad_elem")
class RowwiseAdagradElem(SparseOptimizer):
    """Row-wise Adagrad with each element's own current square: one accumulator
    per row, as ``rowwise_adagrad``, standing in for each element's past
    squares, plus the element's own ``g_j^2`` of this step::

        w_j -= lr * g_j / (sqrt(accum + g_j^2) + eps);  then accum += mean_j(g_j^2)

    Adagrad's per-element accumulator after the step is its past plus ``g_j^2``;
    ``rowwise_adagrad`` replaces both by row means, this only the past (the
    sparse path of SM3, Anil et al. 2019, keeps the same sum with the row's
    max instead of its mean). A fresh row's first step is Adagrad's own
    (``lr * g_j / |g_j|``), later ones tend to row-wise Adagrad's as the
    accumulator outgrows one step's squares. State: 1 float per row (D + 1
    floats per row in all), as ``rowwise_adagrad``."""

    scalar_names = ("accum",)
    params_type = AdagradParams
    params: AdagradParams

    def initial_values(self) -> dict[str, float]:
        return {"accum": self.params.initial_accumulator}

    def update(
        self, storage: Float32Array, rows: Int64Array, grads: Float32Array, lr: float, decay: float
    ) -> None:
        s = self.params
        _rowwise_adagrad_elem_kernel(storage, rows, grads, self.dim, lr, s.eps, decay, self.clip)


@register_optimizer("rowwise_adam")
class RowwiseAdam(SparseOptimizer):
    """Partial row-wise Adam (fbgemm's ``PARTIAL_ROWWISE_ADAM``): the first moment
    per element, the second moment of ``mean_j(g_j^2)`` and the step count per
    row, with Adam's bias corrections. State: D + 2 floats per row instead of
    2D + 1."""

    state_names = ("exp_avg",)
    scalar_names = ("exp_avg_sq", "step")
    params_type = AdamParams
    params: AdamParams

    def update(
        self, storage: Float32Array, rows: Int64Array, grads: Float32Array, lr: float, decay: float
    ) -> None:
        s = self.params
        _rowwise_adam_kernel(
            storage, rows, grads, self.dim, lr, s.beta1, s.beta2, s.eps, decay, self.clip
        )
