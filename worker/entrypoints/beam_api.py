"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the beam search of engine/beam_search.py
over the server's engine, one engine request a live beam a step, answered whole (not streamed).

`n` is the beam width and the number of choices, best first; `length_penalty` ranks the finished beams. Beam search
follows the model's logprobs, so the fields that only shape a draw (temperature, top_p, top_k, min_p, seed) do not
apply; the fields that would change which tokens win and that it does not implement are a 400 naming them.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from pagefleet.worker.engine.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams, BeamSearchSequence
from pagefleet.worker.entrypoints.protocol import APIError, usage
from pagefleet.worker.entrypoints.streaming import client_left


def _unset(value) -> bool:
    return value is None or value == [] or value == {}


# (SamplingParams field, the request's name for it, whether a value asks for nothing)
REFUSED_WITH_BEAMS = (
    ("stop", "stop", _unset), ("stop_token_ids", "stop_token_ids", _unset), ("logprobs", "logprobs", _unset),
    ("prompt_logprobs", "prompt_logprobs", _unset), ("logit_bias", "logit_bias", _unset),
    ("allowed_token_ids", "allowed_token_ids", _unset), ("bad_words", "bad_words", _unset),
    ("structured", "response_format", _unset), ("min_tokens", "min_tokens", lambda v: v == 0),
    ("presence_penalty", "presence_penalty", lambda v: v == 0.0),
    ("frequency_penalty", "frequency_penalty", lambda v: v == 0.0),
    ("repetition_penalty", "repetition_penalty", lambda v: v == 1.0),
    ("spaces_between_special_tokens", "spaces_between_special_tokens", lambda v: v),  # a beam's text: one decode
    ("cache_salt", "cache_salt", _unset),  # the beams' engine requests share the prompt's blocks unsalted
)


def beam_search_params(body, params, prompt_len: int, max_model_len: int, stream: bool) -> BeamSearchParams:
    """The request's beam search (params: its SamplingParams, as the route built them); APIError for what it
    cannot honour."""
    if stream:
        raise APIError(400, "use_beam_search does not stream; set stream to false.", param="stream")
    if not 1 <= params.n <= MAX_BEAM_WIDTH:
        raise APIError(400, f"n is the beam width with use_beam_search and must be in [1, {MAX_BEAM_WIDTH}].",
                       param="n")
    for name, param, asks_nothing in REFUSED_WITH_BEAMS:
        if not asks_nothing(getattr(params, name)):
            raise APIError(400, f"{param} is not supported with use_beam_search.", param=param)
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - prompt_len
    return BeamSearchParams(beam_width=params.n, max_tokens=max_tokens, ignore_eos=params.ignore_eos,
                            length_penalty=body.length_penalty, skip_special_tokens=params.skip_special_tokens)


def check_length_penalty(body) -> None:
    """length_penalty ranks beams: without use_beam_search it would change nothing, so anything else is a 400."""
    if body.length_penalty != 1.0:
        raise APIError(400, "length_penalty applies only with use_beam_search.", param="length_penalty")


async def run_beam_search(state, prompt_ids: list[int], params: BeamSearchParams,
                          lora_name: str | None) -> list[BeamSearchSequence]:
    """One prompt's search over the server's engine: the beams of a step run as concurrent engine requests."""
    engine = state.engine
    search = BeamSearch(prompt_ids, params, engine.eos_token_ids, state.max_model_len)
    step = params.step_params()
    tag = uuid.uuid4().hex

    async def one(tokens: list[int], k: int):
        last = None
        async for out in engine.generate(tokens, step, f"beam-{tag}-{search.steps}-{k}", lora_name):
            last = out
        return last.outputs[0].logprobs[0].top

    while not search.done:
        tops = await asyncio.gather(*(one(tokens, k) for k, tokens in enumerate(search.requests())))
        search.advance(list(tops))
    return search.results(lambda ids: state.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens))


async def beam_search_response(state, request, chat: bool, model: str, prompts: list[list[int]],
                               params: BeamSearchParams, lora_name: str | None, output=None,
                               token_ids: bool = False) -> dict | None:
    """The whole answer: each prompt's beams as choices, best first (chat: through `output`, a ChatOutput), with
    vLLM's token ids where `token_ids` (return_token_ids). None when the client left first: the search is
    cancelled, which aborts its beams' engine requests."""
    state.admit()
    state.num_in_flight += 1
    search = asyncio.ensure_future(asyncio.gather(*(run_beam_search(state, ids, params, lora_name)
                                                    for ids in prompts)))
    watcher = asyncio.ensure_future(client_left(request))
    try:
        await asyncio.wait((search, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not search.done():
            return None
        try:
            results = search.result()
        except ValueError as e:
            raise APIError(400, str(e)) from None
    finally:
        for task in (search, watcher):
            task.cancel()
        await asyncio.gather(search, watcher, return_exceptions=True)  # the beams' aborts run before we answer
        state.num_in_flight -= 1
    choices, completion_tokens = [], 0
    for i, beams in enumerate(results):
        for j, beam in enumerate(beams):
            completion_tokens += len(beam.output_token_ids)
            c = {"index": i * params.beam_width + j, "logprobs": None, "finish_reason": beam.finish_reason,
                 "stop_reason": None}
            if chat:
                c["message"], c["finish_reason"] = output.message(beam.text, beam.finish_reason)
            else:
                c["text"] = beam.text
                if token_ids:
                    c["prompt_token_ids"] = prompts[i]
            if token_ids:
                c["token_ids"] = beam.output_token_ids
            choices.append(c)
    prompt_tokens = sum(len(ids) for ids in prompts)
    answer = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
              "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
              "model": model, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}
    if chat and token_ids:
        answer["prompt_token_ids"] = prompts[0]
    return answer
