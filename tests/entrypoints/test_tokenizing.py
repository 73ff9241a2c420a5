"""AsyncTokenizer: prompts encoded off the event loop give tokenizer.encode's ids, requests that arrive together share
an encode call, the loop runs on while one is encoded, and a text that fails fails only its own request."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagefleet.worker.entrypoints.tokenizing import AsyncTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pagefleet.worker.models.loader import bundled_model_path

    return AutoTokenizer.from_pretrained(bundled_model_path())


class SlowTokenizer:
    """A tokenizer whose calls take `seconds` without the GIL (as a fast tokenizer's batch encode does) and record
    their batches; a text "bad" raises."""

    def __init__(self, seconds: float):
        self.seconds, self.calls = seconds, []

    def __call__(self, texts, add_special_tokens=True):
        self.calls.append(list(texts))
        time.sleep(self.seconds)
        if "bad" in texts:
            raise ValueError("cannot encode bad")
        return {"input_ids": [[len(t), int(add_special_tokens)] for t in texts]}


def test_concurrent_prompts_are_encoded_as_tokenizer_encode_does(tokenizer):
    texts = [f"Prompt number {i}: " + "words " * (i * 7) for i in range(24)]
    fast = AsyncTokenizer(tokenizer)

    async def run():
        plain = asyncio.gather(*(fast.encode(t) for t in texts))
        bare = asyncio.gather(*(fast.encode(t, add_special_tokens=False) for t in texts))
        return await plain, await bare

    plain, bare = asyncio.run(run())
    assert plain == [tokenizer.encode(t) for t in texts]
    assert bare == [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert fast.batches < 2 * len(texts)  # texts queued while a batch ran went together


def test_the_loop_runs_while_prompts_are_encoded():
    slow = SlowTokenizer(0.2)
    tokens = AsyncTokenizer(slow)

    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        ids = await asyncio.gather(*(tokens.encode("x" * i) for i in range(1, 9)))
        tick.cancel()
        return ids, ticks

    ids, ticks = asyncio.run(run())
    assert ids == [[i, 1] for i in range(1, 9)]
    assert ticks >= 5  # the loop went on through the 0.2-0.4 s of encoding
    # the first text may go alone (the thread took it before the others queued); the rest go together
    assert len(slow.calls) <= 2 and sorted(t for call in slow.calls for t in call) == ["x" * i for i in range(1, 9)]


def test_a_text_that_fails_fails_only_its_request():
    tokens = AsyncTokenizer(SlowTokenizer(0.05))

    async def run():
        first = asyncio.create_task(tokens.encode("first"))  # keeps the thread busy while the others queue
        await asyncio.sleep(0.01)
        return await asyncio.gather(first, tokens.encode("ok"), tokens.encode("bad"), tokens.encode("fine"),
                                    return_exceptions=True)

    first, ok, bad, fine = asyncio.run(run())
    assert (first, ok, fine) == ([5, 1], [2, 1], [4, 1])
    assert isinstance(bad, ValueError) and "bad" in str(bad)


def test_a_request_that_leaves_does_not_stop_the_others():
    tokens = AsyncTokenizer(SlowTokenizer(0.05))

    async def run():
        gone = asyncio.create_task(tokens.encode("gone"))
        await asyncio.sleep(0.01)
        gone.cancel()
        return await tokens.encode("stays")

    assert asyncio.run(run()) == [5, 1]


def test_an_event_loop_that_closed_does_not_stop_the_thread():
    tokens = AsyncTokenizer(SlowTokenizer(0.1))

    async def leave():
        asyncio.get_running_loop().create_task(tokens.encode("left behind"))
        await asyncio.sleep(0.01)  # queued and taken; the loop ends before its text is encoded

    asyncio.run(leave())
    time.sleep(0.2)  # the thread wakes a closed loop
    assert asyncio.run(asyncio.wait_for(tokens.encode("next"), 5)) == [4, 1]  # a dead thread would leave it waiting
