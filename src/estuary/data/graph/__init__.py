"""The task graph: ``data.dataset`` (streams of time-partitioned sources) read in
time order, exactly once per ``Progress``.

    Timer       plans every source's windows in order (time, then priority) and
                waits until each window's partitions are ready
    Source      window -> splits (one per file, or Parquet row ranges) -> raw rows;
                StreamSource: a broker stream, splits = offset ranges
    Joiner      labels one source's rows from another's later events (files or
                streams on either side; join_events.StreamEvents for a right stream)
    Sink        BatchSink -> Batches for a trainer; materialize -> Parquet
    Driver      dispatcher + executors (threads or processes) with bounded
                queues, retries, task states; yields Batches
    Progress    rows trained per task/split (JSON, stored in the checkpoint)

::

    driver = Driver(job.data, job.base_dir, batch_size=1024, seed=0, progress=progress)
    for batch in driver.batches():      # Batch.row_ids = (split code << 32) | row
        train(batch)
        driver.progress.record(batch.row_ids)
    checkpoint(model, driver.progress.to_json())

See docs/data.md, "Datasets, streams and the task graph".
"""

from estuary.data.graph.driver import Driver
from estuary.data.graph.executors import RetryDecision, RetryPolicy, TaskFailedError
from estuary.data.graph.joiner import Joiner, label_within
from estuary.data.graph.operators import build_operators, register_source_type
from estuary.data.graph.progress import Progress, RowIdentity
from estuary.data.graph.sinks import BatchSink, MaterializeReport, materialize
from estuary.data.graph.sources import FileSource
from estuary.data.graph.streams import StreamSource
from estuary.data.graph.timer import PartitionNotReadyError, Timer, WaitOutcome, plan_tasks
from estuary.data.graph.types import Readiness, SourceOperator, Split, Task, TaskState

__all__ = [
    "BatchSink",
    "Driver",
    "FileSource",
    "Joiner",
    "MaterializeReport",
    "PartitionNotReadyError",
    "Progress",
    "Readiness",
    "RetryDecision",
    "RetryPolicy",
    "RowIdentity",
    "SourceOperator",
    "Split",
    "StreamSource",
    "Task",
    "TaskFailedError",
    "TaskState",
    "Timer",
    "WaitOutcome",
    "build_operators",
    "label_within",
    "materialize",
    "plan_tasks",
    "register_source_type",
]
