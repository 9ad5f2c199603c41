"""The scaling manager (``runtime.scaling``): a pure policy over live metrics
(``policy``), a controller that applies its decisions while the job runs
(``controller``), and the log of each decision with its trigger and measured
effect (``timeline``). Knobs: the Ray data executors, added and removed live
(``estuary.runtime.ray.executors.RayExecutorPool.resize``), their concurrent
reads, a PS shard's row cap (``tables``), and on Ray the PS shard count (a
shard added before one crosses its memory budget, two cold ones merged) and a
hot PS shard's slots moved to the coldest shard (``rebalance``,
``estuary.runtime.ray.scaling``). See docs/scaling.md.
"""

from estuary.runtime.scaling.controller import Actuator, Controller
from estuary.runtime.scaling.metrics import (
    BusyClock,
    ExecutorMemory,
    ShardMetrics,
    Snapshot,
    WaitClock,
)
from estuary.runtime.scaling.policy import (
    Bounds,
    Decision,
    DLRoverRules,
    EstuaryPolicy,
    Hysteresis,
    Policy,
)
from estuary.runtime.scaling.timeline import Timeline, reversed_actions

__all__ = [
    "Actuator",
    "Bounds",
    "BusyClock",
    "Controller",
    "DLRoverRules",
    "Decision",
    "EstuaryPolicy",
    "ExecutorMemory",
    "Hysteresis",
    "Policy",
    "ShardMetrics",
    "Snapshot",
    "Timeline",
    "WaitClock",
    "reversed_actions",
]
