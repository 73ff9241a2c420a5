"""Beam search (engine/beam_search.py) as vLLM runs it: the pruning and ranking rules on made-up logprobs, then
LLM.beam_search on a tiny random Llama against greedy decoding and against the model's own scores, and the
server's use_beam_search (entrypoints/beam_api.py) through ASGI, with its refusals."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from asgi_app import post, worker_app
from pagefleet.worker import LLM, BeamSearchParams, SamplingParams
from pagefleet.worker.engine.beam_search import BeamSearch, beam_score

EOS = 9


def test_each_step_keeps_the_best_extensions_and_sets_finished_beams_aside():
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3), [EOS], max_model_len=100)
    search.advance([[(5, -0.1), (EOS, -0.2), (6, -1.0), (7, -2.0)]])
    assert [b.tokens for b in search.live] == [[1, 2, 5], [1, 2, 6]]  # eos set aside, not a live beam
    assert [b.tokens for b in search.completed] == [[1, 2, EOS]] and search.completed[0].finish_reason == "stop"
    search.advance([[(3, -0.5), (4, -0.6)], [(3, -0.05), (4, -3.0)]])
    assert [(b.tokens[2:], round(b.cum_logprob, 2)) for b in search.live] == [([5, 3], -0.6), ([5, 4], -0.7)]
    search.advance([[(EOS, -0.1)], [(8, -0.1)]])
    assert search.done  # max_tokens steps
    best = search.results()
    # ranked by logprob / length ** 1.0, the prompt counted and a final eos not: -0.2 / 2, then the live
    # -0.8 / 5, ahead of the finished -0.7 / 4
    assert [b.tokens for b in best] == [[1, 2, EOS], [1, 2, 5, 4, 8]]
    assert [b.finish_reason for b in best] == ["stop", "length"]
    assert beam_score(search.completed[1], {EOS}, 1.0) == pytest.approx(-0.7 / 4)
    assert beam_score(best[1], {EOS}, 1.0) == pytest.approx(-0.8 / 5)
    wide = BeamSearch([1, 2], BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=0.0), [EOS], 100)
    wide.advance([[(EOS, -0.3), (5, -0.2)]])
    wide.advance([[(6, -0.2)]])
    assert [b.tokens for b in wide.results()] == [[1, 2, EOS]]  # no length penalty: the summed logprob decides


def test_a_beams_text_leaves_out_its_final_eos():
    search = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=2), [EOS], max_model_len=100)
    search.advance([[(5, -0.1), (EOS, -0.2)]])
    search.advance([[(EOS, -0.1), (6, -0.3)]])
    texts = {tuple(b.output_token_ids): b.text for b in search.results(lambda ids: ",".join(map(str, ids)))}
    # a beam that stopped at its eos is written without it (as vLLM does, whatever skip_special_tokens says); one
    # cut by max_tokens keeps all its tokens
    assert texts == {(5, EOS): "5", (5, 6): "5,6"}


def test_a_beam_stops_at_max_model_len_and_bad_params_are_refused():
    search = BeamSearch([1, 2, 3], BeamSearchParams(beam_width=1, max_tokens=10), [EOS], max_model_len=4)
    search.advance([[(5, -0.1)]])
    assert search.done and search.results()[0].finish_reason == "length"
    for bad in (dict(beam_width=0, max_tokens=4), dict(beam_width=11, max_tokens=4), dict(beam_width=2, max_tokens=0)):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), max_model_len=256, device="cpu")  # fp32: logprobs to 1e-4


PROMPT = list(range(300, 320))


def test_width_one_is_greedy(llm):
    (out,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
    (beam,) = out.sequences
    assert beam.output_token_ids == greedy[0].outputs[0].token_ids and beam.tokens[:20] == PROMPT
    assert beam.cum_logprob == pytest.approx(sum(e.logprob for e in greedy[0].outputs[0].logprobs), abs=1e-4)


def test_wider_beams_score_as_the_model_does_and_beat_greedy(llm):
    (out,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))
    assert len(out.sequences) == 4 and len({tuple(b.tokens) for b in out.sequences}) == 4
    cums = [b.cum_logprob for b in out.sequences]
    assert cums == sorted(cums, reverse=True)  # one length: ranked by logprob
    for beam in out.sequences:  # each beam's logprob is the model's for its tokens, scored as a prompt
        (scored,) = llm.generate([beam.tokens], SamplingParams(max_tokens=1, prompt_logprobs=0))
        model = sum(e.logprob for e in scored.prompt_logprobs[len(PROMPT):])
        assert beam.cum_logprob == pytest.approx(model, abs=1e-3)
        assert beam.text == llm.tokenizer.decode(beam.output_token_ids, skip_special_tokens=True)
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0))
    assert cums[0] >= sum(e.logprob for e in greedy[0].outputs[0].logprobs[:6]) - 1e-4


@pytest.fixture(scope="module")
def app(tiny_models):
    with worker_app(tiny_models["llama"], dict(max_model_len=256, device="cpu"),
                    chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}") as app:
        yield app


async def test_use_beam_search_answers_the_beams_best_first(app, llm):
    (want,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    r = await post(app, "/v1/completions", model="smol", prompt=PROMPT, n=3, max_tokens=5, use_beam_search=True,
                   ignore_eos=True, temperature=0.7, top_p=0.9)  # a draw's settings: beams do not draw
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in body["choices"]] == [b.text for b in want.sequences]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2] and body["usage"]["completion_tokens"] == 15
    chat = await post(app, "/v1/chat/completions", model="smol", messages=[{"role": "user", "content": "hello"}],
                      n=2, max_tokens=4, use_beam_search=True, length_penalty=0.5)
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 2 and all(c["message"]["role"] == "assistant"
                                                    for c in chat.json()["choices"])


@pytest.mark.parametrize("fields,param", [
    ({"stream": True}, "stream"), ({"logprobs": 1}, "logprobs"), ({"stop": ["x"]}, "stop"), ({"n": 11}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"echo": True}, "echo"),
    ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
    ({"skip_special_tokens": False, "spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
])
async def test_what_beam_search_cannot_honour_is_a_400(app, fields, param):
    r = await post(app, "/v1/completions", **{"model": "smol", "prompt": PROMPT, "n": 2, "max_tokens": 3,
                                               "use_beam_search": True, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_a_client_that_leaves_cancels_the_search(app):
    """A non-streamed answer has no other way to notice its client: the search stops, its beams' engine
    requests are aborted and the slot is given back, instead of the search running to max_tokens."""
    body = json.dumps({"model": "smol", "prompt": PROMPT, "n": 4, "max_tokens": 200, "use_beam_search": True,
                       "ignore_eos": True}).encode()
    sent, messages = [], []

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(0.5)  # a few search steps, then the client is gone
        return {"type": "http.disconnect"}

    async def send(message):
        messages.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"pagefleet")],
             "client": ("127.0.0.1", 1), "server": ("pagefleet", 80)}
    started = time.monotonic()
    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    assert messages[0]["status"] == 499 and time.monotonic() - started < 10
    engine = app.state.server.engine
    for _ in range(100):  # the aborts reach the loop thread at its next step
        if not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.05)
    assert not engine.engine.has_unfinished_requests() and app.state.server.num_in_flight == 0
