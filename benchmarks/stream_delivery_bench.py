"""Host cost of handing one engine step's outputs to the server's asyncio loop, on CPU.

The engine thread hands each step's outputs to the event loop (worker/engine/async_engine.py). Every
`loop.call_soon_threadsafe` writes a byte to the loop's self-pipe and wakes it. This prints the
engine thread's and the loop thread's CPU time per step in two modes: one call per stream (the old
way) and one call per step (`_deliver_step`). 64 streams, a 0.5 ms sleep standing in for the GPU step.
Usage: python benchmarks/stream_delivery_bench.py [streams] [steps]
"""

import asyncio
import sys
import threading
import time


def _put_all(puts):
    for q, item in puts:
        q.put_nowait(item)


def run(streams: int, steps: int, batched: bool) -> tuple[float, float]:
    """-> (engine thread, loop thread) CPU µs per step."""
    loop = asyncio.new_event_loop()
    queues: list[asyncio.Queue] = []
    ready = threading.Event()
    loop_cpu = [0.0]

    async def consume(q):
        while await q.get() is not None:
            pass

    async def main():
        queues.extend(asyncio.Queue() for _ in range(streams))
        tasks = [asyncio.create_task(consume(q)) for q in queues]
        ready.set()
        start = time.thread_time()
        await asyncio.gather(*tasks)
        loop_cpu[0] = time.thread_time() - start

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()))
    thread.start()
    ready.wait()
    start = time.thread_time()
    for step in range(steps):
        item = None if step == steps - 1 else step
        if batched:
            loop.call_soon_threadsafe(_put_all, [(q, item) for q in queues])
        else:
            for q in queues:
                loop.call_soon_threadsafe(q.put_nowait, item)
        time.sleep(0.0005)
    engine_cpu = time.thread_time() - start
    thread.join()
    loop.close()
    return engine_cpu / steps * 1e6, loop_cpu[0] / steps * 1e6


def main() -> None:
    streams = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    for turn in range(2):
        for batched in (False, True):
            engine_us, loop_us = run(streams, steps, batched)
            mode = "one call a step  " if batched else "one call a stream"
            print(f"turn {turn + 1}, {streams} streams, {mode}: engine thread {engine_us:6.1f} us/step, "
                  f"loop thread {loop_us:6.1f} us/step", flush=True)


if __name__ == "__main__":
    main()
