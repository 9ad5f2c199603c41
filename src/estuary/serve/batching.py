"""``MicroBatcher``: concurrent requests share one forward pass.

Requests queue their parsed rows; one worker task takes every request queued
(up to ``max_rows`` rows, waiting at most ``max_wait_s`` for more once the queue
is empty), concatenates them into one batch, runs the model on a single worker
thread (so the event loop keeps accepting requests meanwhile) and hands each
request its slice::

    requests:   r0 (1 row)  r1 (3 rows)  r2 (1 row)      queued while the last batch ran
    batch:      [r0 | r1 r1 r1 | r2]                      B = 5, one forward
    replies:    p[0:1]  p[1:4]  p[4:5]                    same version for all

Under load the batches grow by themselves (everything that arrived during the
previous forward); with one client at a time a request waits at most
``max_wait_s``. A request whose rows exceed ``max_rows`` runs alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from estuary.data.types import Batch
from estuary.serve.model import Prediction

__all__ = ["MicroBatcher"]

_Pending = tuple[Batch, "asyncio.Future[Prediction]"]


class MicroBatcher:
    """Batches concurrent ``submit`` calls into one ``predict`` call.

    Args:
        predict: B rows -> their ``Prediction`` (blocking; runs on a worker thread).
        max_rows: the most rows in one batch (a larger request runs alone).
        max_wait_s: how long a batch waits for more requests once none are queued.
        on_batch: called with each forward pass's row count (e.g. a histogram).
    """

    def __init__(
        self,
        predict: Callable[[Batch], Prediction],
        *,
        max_rows: int = 1024,
        max_wait_s: float = 0.001,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self.predict = predict
        self.on_batch = on_batch
        self.max_rows = max_rows
        self.max_wait_s = max_wait_s
        self.batches = 0  # forward passes run
        self.rows = 0  # rows predicted
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="estuary-predict")

    async def submit(self, batch: Batch) -> Prediction:
        """The prediction of ``batch``'s rows; waits for a batch that holds them."""
        loop = asyncio.get_running_loop()
        if self._queue is None or self._worker is None or self._worker.done():
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._run(self._queue))
        future: asyncio.Future[Prediction] = loop.create_future()
        await self._queue.put((batch, future))
        return await future  # resolved by the worker task

    async def close(self) -> None:
        """Stop the worker task (requests queued get an error) and the thread."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        if self._queue is not None:
            while not self._queue.empty():
                _, future = self._queue.get_nowait()
                future.set_exception(RuntimeError("the server is shutting down"))
        self._pool.shutdown(wait=True)  # Blocking wait: the batch in flight ends

    async def _run(self, queue: asyncio.Queue[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        carry: _Pending | None = None  # a request that did not fit the last batch
        while True:
            first = carry if carry is not None else await queue.get()
            carry = None
            pending, rows = [first], first[0].num_rows
            while rows < self.max_rows:
                try:
                    if queue.empty():
                        item = await asyncio.wait_for(queue.get(), self.max_wait_s)
                    else:
                        item = queue.get_nowait()
                except TimeoutError:
                    break
                if rows + item[0].num_rows > self.max_rows:
                    carry = item  # first of the next batch
                    break
                pending.append(item)
                rows += item[0].num_rows
            await self._predict(loop, pending)

    async def _predict(self, loop: asyncio.AbstractEventLoop, pending: list[_Pending]) -> None:
        live = [(b, f) for b, f in pending if not f.done()]  # a client may have gone
        if not live:
            return
        batch = Batch.concatenate([b for b, _ in live]) if len(live) > 1 else live[0][0]
        try:
            # Blocking wait (off the event loop): the forward pass on the worker thread.
            result = await loop.run_in_executor(self._pool, self.predict, batch)
        except Exception as exc:  # every request of the batch gets the error
            for _, future in live:
                if not future.done():
                    future.set_exception(exc)
            return
        self.batches += 1
        self.rows += batch.num_rows
        if self.on_batch is not None:
            self.on_batch(batch.num_rows)
        ends = np.cumsum([b.num_rows for b, _ in live])
        for (b, future), end in zip(live, ends, strict=True):
            if not future.done():
                part = result.probabilities[end - b.num_rows : end]
                future.set_result(Prediction(part, result.version))
