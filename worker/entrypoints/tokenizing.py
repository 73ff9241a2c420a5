"""Prompt tokenization off the event loop: the texts of requests that arrive together, encoded as one batch on
one thread.

Encoding a 564-word prompt holds the event loop for milliseconds, and in a closed loop the requests of a wave arrive
together: the serving trace at concurrency 64 (docs/benchmarks.md, the served FP8 run) showed new prompts reaching
the scheduler over ~50 ms while the last streams of the wave before were still being written. Here the loop only
queues a text; a single worker thread takes every text queued so far and encodes them in one call (the fast
tokenizer's batch encode runs without the GIL, across cores), then wakes each waiter. One thread, as vLLM's
micro-batching tokenizer has: a fast tokenizer's call may reset its truncation and padding settings, which fails
("Already borrowed") while another thread encodes with it.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor


class AsyncTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagefleet-tokenize")
        self._lock = threading.Lock()
        self._queued: list[tuple[str, bool, asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._running = False
        self.batches = 0  # encode calls made (tests read it: concurrent texts share calls)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._queued.append((text, bool(add_special_tokens), future, loop))
            start, self._running = not self._running, True
        if start:
            self._pool.submit(self._drain)
        return await future

    def _drain(self) -> None:
        """On the worker thread: encode what is queued, batch after batch, until nothing is."""
        while True:
            with self._lock:
                batch, self._queued = self._queued, []
                if not batch:
                    self._running = False
                    return
            for flag in (True, False):  # one call per add_special_tokens value
                group = [item for item in batch if item[1] is flag]
                if group:
                    try:
                        self._encode(group, flag)
                    except Exception as e:  # a fault of ours: its waiters fail, later texts still get a thread
                        for _, _, future, loop in group:
                            _wake(loop, future, None, e)

    def _encode(self, group: list, add_special_tokens: bool) -> None:
        self.batches += 1
        try:
            ids = self.tokenizer([text for text, *_ in group], add_special_tokens=add_special_tokens)["input_ids"]
        except Exception as e:  # a text that fails is tried again alone, so that only its own request fails
            if len(group) > 1:
                for item in group:
                    self._encode([item], add_special_tokens)
                return
            _, _, future, loop = group[0]
            _wake(loop, future, None, e)
            return
        for (_, _, future, loop), one in zip(group, ids, strict=True):
            _wake(loop, future, one, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


def _wake(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result, error) -> None:
    try:
        loop.call_soon_threadsafe(_set, future, result, error)
    except RuntimeError:  # its event loop is closed: nobody waits for this text, and the thread goes on
        pass


def _set(future: asyncio.Future, result, error) -> None:
    if future.cancelled():  # the request went away while its text was encoded
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
