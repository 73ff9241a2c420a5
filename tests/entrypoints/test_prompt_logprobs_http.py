"""vLLM's prompt_logprobs and the completions API's echo over HTTP: the app in this process (httpx and the real
`openai` client through an ASGI transport) on a tiny random Llama, its values against the offline LLM's
RequestOutput.prompt_logprobs; echo as lm-eval-harness's local-completions model sends it; the 400s; and the
same values through an engine in a child process (--engine-process).

A random model's prompt tokens are unlikely ones (ranks in the thousands); a prompt that goes on with the
model's own greedy tokens has tokens of rank 1 too, so both sides of the top-k are checked.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.entrypoints.api_server import build_app

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
ENGINE = dict(max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def model(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def llm(model):
    from pagefleet.worker import LLM

    return LLM(model, **ENGINE)


@pytest.fixture(scope="module")
def app(model):
    from pagefleet.worker.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(EngineConfig(model=model, **ENGINE))
    yield build_app(engine, "smol")
    engine.shutdown()


@pytest.fixture(scope="module")
def greedy_prompt(llm) -> list[int]:
    """PROMPT's tokens and the model's greedy continuation: tokens of rank 1 after tokens of any rank."""
    ids = llm.tokenizer.encode(PROMPT)
    return ids + offline(llm, ids, max_tokens=6, ignore_eos=True).outputs[0].token_ids


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagefleet", timeout=60)


async def post(app, path: str, **body) -> httpx.Response:
    async with client(app) as c:
        return await c.post(path, json={"model": "smol", **body})


async def completion(app, **body) -> dict:
    r = await post(app, "/v1/completions", **body)
    assert r.status_code == 200, r.text
    return r.json()


def offline(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, **kw))[0]


def check_prompt_logprobs(got: list, ref, k: int, decode) -> None:
    """vLLM's shape with the offline engine's values: null first, then {id: {logprob, rank, decoded_token}} with the
    prompt token first (its own rank) and the top k after it, best first, ranks 1..k."""
    ids, want = ref.prompt_token_ids, ref.prompt_logprobs
    assert want is not None and len(want) == len(ids) and want[0] is None
    assert len(got) == len(ids) and got[0] is None
    for token, entry, w in zip(ids[1:], got[1:], want[1:]):
        assert w.token_id == token and len(w.top) == k
        keys = list(entry)
        assert keys[0] == str(token)
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(w.logprob, abs=1e-4) and own["rank"] == w.rank
        assert own["decoded_token"] == decode(token)
        # rank: 1 + how many are more likely, as the top k (which holds every token more likely, up to k) says
        assert sum(lp > w.logprob + 1e-6 for _, lp in w.top) == min(w.rank - 1, k)
        top = [(t, lp) for t, lp in w.top if t != token]
        assert keys[1:] == [str(t) for t, _ in top]
        assert len(entry) == k + (w.rank > k)
        for rank, (t, lp) in enumerate(w.top, 1):
            if t != token:
                assert entry[str(t)]["rank"] == rank and entry[str(t)]["logprob"] == pytest.approx(lp, abs=1e-4)
                assert entry[str(t)]["decoded_token"] == decode(t)


@pytest.mark.parametrize("k", [0, 3])
async def test_completions_prompt_logprobs_match_offline(app, llm, greedy_prompt, k):
    for prompt in (PROMPT, greedy_prompt):
        ref = offline(llm, prompt, max_tokens=4, prompt_logprobs=k)
        body = await completion(app, prompt=prompt, max_tokens=4, temperature=0, prompt_logprobs=k, n=2)
        for choice in body["choices"]:  # each choice of the prompt carries them
            check_prompt_logprobs(choice["prompt_logprobs"], ref, k, llm.tokenizer.decode)
        assert body["choices"][0]["text"] == ref.outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    ranks = [e.rank for e in ref.prompt_logprobs[1:]]
    assert 1 in ranks and max(ranks) > 3  # the greedy continuation's tokens, and the prompt's unlikely ones
    plain = await completion(app, prompt=PROMPT, max_tokens=2)
    assert "prompt_logprobs" not in plain["choices"][0]


async def test_chat_prompt_logprobs_match_offline(app, llm):
    ref = llm.chat([MESSAGES], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2))[0]
    r = await post(app, "/v1/chat/completions", messages=MESSAGES, max_tokens=4, temperature=0, prompt_logprobs=2)
    assert r.status_code == 200, r.text
    body = r.json()
    check_prompt_logprobs(body["prompt_logprobs"], ref, 2, llm.tokenizer.decode)  # beside the choices, as vLLM
    assert "prompt_logprobs" not in body["choices"][0]
    assert body["choices"][0]["message"]["content"] == ref.outputs[0].text


def check_completion_logprobs(lp: dict, ids: list[int], want: list, k: int, decode) -> None:
    """Echoed logprobs: one entry per prompt and generated token, the first null; want: their offline entries."""
    assert lp["tokens"] == [decode(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([w.logprob for w in want[1:]], abs=1e-4)
    for top, w in zip(lp["top_logprobs"][1:], want[1:]):
        expected = {decode(t): lp for t, lp in w.top[:k]}
        expected.setdefault(decode(w.token_id), w.logprob)
        assert top == pytest.approx(expected, abs=1e-4)
    offsets = lp["text_offset"]
    assert offsets[0] == 0
    assert all(b - a == len(text) for a, b, text in zip(offsets, offsets[1:], lp["tokens"]))


async def test_echo_prompt_and_completion(app, llm):
    ref = offline(llm, PROMPT, max_tokens=5, logprobs=1, prompt_logprobs=2, ignore_eos=True)
    gen = ref.outputs[0]
    body = await completion(app, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=1,
                            prompt_logprobs=2, ignore_eos=True)
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT + gen.text
    ids = ref.prompt_token_ids + gen.token_ids
    # the prompt is scored for 2; its echoed top_logprobs show logprobs=1 of them, prompt_logprobs all 2
    check_completion_logprobs(choice["logprobs"], ids, ref.prompt_logprobs + gen.logprobs, 1, llm.tokenizer.decode)
    check_prompt_logprobs(choice["prompt_logprobs"], ref, 2, llm.tokenizer.decode)
    assert body["usage"] == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": 5, "total_tokens":
                             len(ref.prompt_token_ids) + 5}
    plain = await completion(app, prompt=ref.prompt_token_ids, max_tokens=5, temperature=0, echo=True,
                             ignore_eos=True)
    assert plain["choices"][0]["text"] == llm.tokenizer.decode(ref.prompt_token_ids) + gen.text
    assert plain["choices"][0]["logprobs"] is None and "prompt_logprobs" not in plain["choices"][0]
    sampled = await completion(app, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=5, n=3, echo=True)
    texts = [c["text"] for c in sorted(sampled["choices"], key=lambda c: c["index"])]
    assert all(t.startswith(PROMPT) for t in texts) and len(set(texts)) > 1


async def test_lm_eval_loglikelihood_request(app, llm, greedy_prompt):
    """lm-eval-harness's local-completions: token-id prompts in one batch, max_tokens 1, echo, logprobs 1; it reads
    token_logprobs[ctxlen:-1] (the continuation's log-likelihood) and whether each was the top token."""
    context = llm.tokenizer.encode(PROMPT)
    other = llm.tokenizer.encode("Once upon a time there was")
    prompts = [greedy_prompt, other]
    refs = [offline(llm, p, max_tokens=1, prompt_logprobs=1, logprobs=1) for p in prompts]
    body = await completion(app, prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0, seed=1234)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for choice, ids, ref in zip(choices, prompts, refs):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1
        assert choice["text"] == llm.tokenizer.decode(ids) + ref.outputs[0].text
        check_completion_logprobs(lp, ids + ref.outputs[0].token_ids, ref.prompt_logprobs + ref.outputs[0].logprobs,
                                  1, llm.tokenizer.decode)
    # the greedy continuation after PROMPT: its log-likelihood, and greedy at every token
    lp, ref = choices[0]["logprobs"], refs[0]
    ctxlen = len(context)
    assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(
        sum(e.logprob for e in ref.prompt_logprobs[ctxlen:]), abs=1e-3)
    for token, top in zip(lp["tokens"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]):
        assert max(top, key=top.get) == token


async def test_streamed_echo_equals_the_whole_body(app, llm):
    kw = dict(model="smol", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, n=2, echo=True, logprobs=1,
              extra_body={"ignore_eos": True})
    async with client(app) as http:
        api = openai.AsyncOpenAI(base_url="http://pagefleet/v1", api_key="none", http_client=http, max_retries=0)
        whole = await api.completions.create(**kw)
        text, tokens, token_logprobs, firsts = {}, {}, {}, {}
        async for chunk in await api.completions.create(stream=True, **kw):
            for c in chunk.choices:
                firsts.setdefault(c.index, c.text)
                text[c.index] = text.get(c.index, "") + c.text
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                token_logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    prompt_len = len(llm.tokenizer.encode(PROMPT))
    for c in whole.choices:
        assert firsts[c.index].startswith(PROMPT)  # the prompt leads the choice's first chunk
        assert text[c.index] == c.text and c.text.startswith(PROMPT)
        assert tokens[c.index] == c.logprobs.tokens and len(c.logprobs.tokens) == prompt_len + 8
        assert token_logprobs[c.index][0] is None
        assert token_logprobs[c.index][1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-4)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
async def test_bad_prompt_logprobs_are_400s(app, path, body):
    for value in (21, -1, "x", 1.5):
        r = await post(app, path, prompt_logprobs=value, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    r = await post(app, path, prompt_logprobs=1, stream=True, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert "not available when `stream=true`" in r.json()["error"]["message"]
    r = await post(app, path, prompt_logprobs=0, stream=True, max_tokens=2, **body)  # vLLM lets 0 through
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text


async def test_an_echo_of_the_prompt_alone_is_refused(app):
    """Chat's echo (the continued turn) is tests/entrypoints/test_chat_template_http.py's."""
    r = await post(app, "/v1/completions", prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "echo" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def engine_process_app(model):
    from pagefleet.worker.engine.engine_process import EngineProcess

    engine = EngineProcess(EngineConfig(model=model, **ENGINE))
    yield build_app(engine, "smol")
    engine.shutdown()


async def test_engine_process_carries_prompt_logprobs(app, engine_process_app, greedy_prompt):
    """The same answers when the engine runs in a child process: prompt logprobs sent once, kept on every output.
    One prompt a request, so both engines run the same batches and agree to the bit."""
    kw = dict(prompt=greedy_prompt, max_tokens=6, temperature=1.0, seed=2, n=2, prompt_logprobs=3, ignore_eos=True)
    here, there = await completion(app, **kw), await completion(engine_process_app, **kw)
    assert [(c["text"], c["prompt_logprobs"]) for c in there["choices"]] == \
        [(c["text"], c["prompt_logprobs"]) for c in here["choices"]]
    assert there["choices"][1]["prompt_logprobs"][1] is not None
    kw = dict(prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2, stream=True, ignore_eos=True)
    here, there = [streamed(await post(a, "/v1/completions", **kw)) for a in (app, engine_process_app)]
    assert here == there and here[0][0].startswith(PROMPT) and here[0][2][1] is not None


def streamed(r: httpx.Response) -> dict[int, tuple]:
    """A completions stream's choices: index -> (text, tokens, token_logprobs, top_logprobs)."""
    assert r.status_code == 200, r.text
    out: dict[int, tuple] = {}
    for event in r.text.split("\n\n"):
        if event.startswith("data: {"):
            for c in json.loads(event[len("data: "):])["choices"]:
                text, tokens, lps, tops = out.get(c["index"], ("", [], [], []))
                lp = c["logprobs"]
                out[c["index"]] = (text + c["text"], tokens + lp["tokens"], lps + lp["token_logprobs"],
                                   tops + lp["top_logprobs"])
    return out
