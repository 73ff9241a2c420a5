"""Prefix-cache hit rate and TTFT of gateways over the same workers: multi-turn and shared-system-prompt load.

Drives running gateways with two workloads, one gateway after the other, each with its own text (no
gateway profits from another's cached blocks):
- multi-turn: CONVERSATIONS conversations at once, TURNS turns each, every turn re-sending the history;
- shared system prompt: SYSTEM_PROMPTS long system prompts (tenants), each with SYSTEM_QUESTIONS distinct
  questions, all requests in one random order (tenants' arrivals interleave), SYSTEM_CONCURRENCY in flight.
Every request is a streamed chat completion through the gateway (TTFT = first content chunk). Hit rates
come from the workers' own `vllm:prefix_cache_queries` / `_hits` counters (tokens), read before and
after each gateway's turn; the gateway's own estimate from its `pagefleet_gateway_prefix_*` counters, its
choices from `pagefleet_gateway_routing_decisions_total`. Sizes, with SmolLM2's tokenizer and chat template
(e2e/test_prefix_routing.py sets the workers' KV against them): a multi-turn conversation grows from ~82
prompt tokens to ~293 tokens (18 blocks of 16) at its last answer; a shared system prompt is ~385 tokens
(24 blocks), a question and its answer add ~35.

    python e2e/bench_prefix_routing.py --key sk-... --worker http://10.0.0.7:8000 --worker http://10.0.0.8:8000 \\
        --gateway queue-depth=http://gw-a:4000 --gateway prefix-aware=http://gw-b:4000

e2e/test_prefix_routing.py runs it on the e2e control plane; the figures are in docs/gateway.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

CONVERSATIONS, TURNS, ANSWER_TOKENS = 12, 6, 8
THINK_S = 1.0  # a user reads and types between turns: uniform in [0, THINK_S], so turns arrive interleaved
SYSTEM_PROMPTS, SYSTEM_QUESTIONS, SYSTEM_CONCURRENCY = 8, 6, 4
SYSTEM_SENTENCES = 32  # ~385 tokens: a tenant's instructions and examples
WORDS = ("river station engine signal bridge tunnel valley harbor market winter summer garden library "
         "captain doctor farmer teacher painter sailor miner baker weaver copper silver timber granite "
         "northern southern eastern western ancient modern quiet busy narrow broad steep gentle early late "
         "carries builds repairs measures follows crosses reaches opens closes lights counts sends keeps "
         "morning evening harvest festival journey letter ledger compass lantern ticket schedule platform "
         "freight passenger carriage whistle boiler furnace piston wheel axle rail sleeper gauge junction").split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def conversation_starts(seed: str) -> list[list[dict]]:
    """One opening per conversation: its own system prompt (~60 tokens)."""
    rng = random.Random(f"{seed}-turns")
    return [[{"role": "system", "content": " ".join(sentence(rng, 10) for _ in range(4))}]
            for _ in range(CONVERSATIONS)]


def question(rng: random.Random) -> str:
    return " ".join(sentence(rng, 8) for _ in range(2)) + " What follows?"  # ~25 tokens


@dataclass
class Sample:
    workload: str
    worker: str
    ttft_s: float
    prompt_tokens: int = 0
    conversation: int = -1  # multi-turn: which conversation, its turns in order; shared system: which prompt


@dataclass
class Phase:
    name: str
    samples: list[Sample] = field(default_factory=list)
    worker_delta: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)  # workload -> url -> q, h
    estimate: dict[str, tuple[float, float]] = field(default_factory=dict)  # workload -> (expected, queried)
    decisions: dict[str, Counter] = field(default_factory=dict)  # workload -> reason -> routing decisions
    wall_s: float = 0.0


async def chat(client: httpx.AsyncClient, url: str, key: str, model: str, messages: list[dict],
               workload: str) -> tuple[Sample, str]:
    """One streamed chat completion: (its sample, the answer text)."""
    body = {"model": model, "messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, prompt_tokens = None, [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as resp:
        resp.raise_for_status()
        worker = resp.headers.get("x-litellm-model-api-base", "").removesuffix("/v1")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(piece)
    return Sample(workload, worker, ttft if ttft is not None else time.perf_counter() - start, prompt_tokens), \
        "".join(text)


async def multi_turn(client, url, key, model, seed: str) -> list[Sample]:
    async def one(i: int, history: list[dict]) -> list[Sample]:
        rng, out = random.Random(f"{seed}-conversation-{i}"), []
        for _ in range(TURNS):
            await asyncio.sleep(rng.uniform(0, THINK_S))
            history.append({"role": "user", "content": question(rng)})
            sample, answer = await chat(client, url, key, model, history, "multi-turn")
            sample.conversation = i
            history.append({"role": "assistant", "content": answer})
            out.append(sample)
        return out

    runs = await asyncio.gather(*(one(i, h) for i, h in enumerate(conversation_starts(seed))))
    return [s for run in runs for s in run]


def system_prompts(seed: str) -> list[str]:
    rng = random.Random(f"{seed}-system")
    return [" ".join(sentence(rng, 10) for _ in range(SYSTEM_SENTENCES)) for _ in range(SYSTEM_PROMPTS)]


async def shared_system(client, url, key, model, seed: str) -> list[Sample]:
    rng = random.Random(f"{seed}-questions")
    requests = [(i, [{"role": "system", "content": s}, {"role": "user", "content": question(rng)}])
                for i, s in enumerate(system_prompts(seed)) for _ in range(SYSTEM_QUESTIONS)]
    rng.shuffle(requests)
    gate = asyncio.Semaphore(SYSTEM_CONCURRENCY)

    async def one(i, messages):
        async with gate:
            sample = (await chat(client, url, key, model, messages, "shared-system"))[0]
            sample.conversation = i
            return sample

    return list(await asyncio.gather(*(one(i, m) for i, m in requests)))


def counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each named counter over its label sets, from a Prometheus exposition."""
    out = dict.fromkeys(names, 0.0)
    for m in re.finditer(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", text, re.M):
        if m.group(1) in out:
            out[m.group(1)] += float(m.group(2))
    return out


async def worker_hits(client, workers: list[str]) -> dict[str, tuple[float, float]]:
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    out = {}
    for url in workers:
        c = counters((await client.get(f"{url}/metrics")).text, names)
        out[url] = (c[names[0]], c[names[1]])
    return out


async def gateway_estimate(client, url) -> tuple[float, float, Counter]:
    """(expected hit blocks, queried blocks, routing decisions by reason) so far."""
    text = (await client.get(f"{url}/pagefleet/metrics")).text
    names = ("pagefleet_gateway_prefix_expected_hit_blocks_total", "pagefleet_gateway_prefix_query_blocks_total")
    c = counters(text, names)
    reasons = Counter()
    for m in re.finditer(r'^pagefleet_gateway_routing_decisions_total\{[^}]*reason="([^"]+)"[^}]*\} (\S+)$', text,
                         re.M):
        reasons[m.group(1)] += int(float(m.group(2)))
    return c[names[0]], c[names[1]], reasons


async def run_phase(name: str, url: str, key: str, model: str, workers: list[str]) -> Phase:
    phase = Phase(name)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as client:
        for workload, drive in (("multi-turn", multi_turn), ("shared-system", shared_system)):
            before, est_before = await worker_hits(client, workers), await gateway_estimate(client, url)
            phase.samples += await drive(client, url, key, model, f"{name}-{workload}")
            after, est_after = await worker_hits(client, workers), await gateway_estimate(client, url)
            phase.worker_delta[workload] = {u: (after[u][0] - before[u][0], after[u][1] - before[u][1])
                                            for u in workers}
            phase.estimate[workload] = (est_after[0] - est_before[0], est_after[1] - est_before[1])
            phase.decisions[workload] = est_after[2] - est_before[2]
    phase.wall_s = time.perf_counter() - start
    return phase


def hit_rate(phase: Phase, workload: str) -> float:
    queries = sum(q for q, _ in phase.worker_delta[workload].values())
    return sum(h for _, h in phase.worker_delta[workload].values()) / queries if queries else 0.0


def ideal_hit_rate(phase: Phase, block_size: int = 16) -> float:
    """Multi-turn with every turn on the worker of the turn before: turn k finds at least turn k-1's prompt,
    in full blocks (the answer's blocks may add a little)."""
    hit = total = 0
    multi = [s for s in phase.samples if s.workload == "multi-turn"]
    for i in {s.conversation for s in multi}:
        turns = [s.prompt_tokens for s in multi if s.conversation == i]
        total += sum(turns)
        hit += sum(prev // block_size * block_size for prev in turns[:-1])
    return hit / total if total else 0.0


def busiest_share(phase: Phase, workload: str | None = None) -> float:
    served = Counter(s.worker for s in phase.samples if workload in (None, s.workload))
    return max(served.values()) / sum(served.values())


def ttft(phase: Phase, workload: str, q: float) -> float:
    values = sorted(s.ttft_s for s in phase.samples if s.workload == workload)
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if len(values) > 1 \
        else values[0]


def report(phases: list[Phase]) -> str:
    lines = [f"{'gateway':<22}{'workload':<15}{'hit rate':>9}{'gw est.':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'busiest':>9}{'reqs':>6}"]
    for p in phases:
        for workload in p.worker_delta:
            expected, queried = p.estimate[workload]
            est = f"{expected / queried:.2f}" if queried else "-"
            n = sum(1 for s in p.samples if s.workload == workload)
            lines.append(f"{p.name:<22}{workload:<15}{hit_rate(p, workload):>9.2f}{est:>9}"
                         f"{ttft(p, workload, 0.5) * 1000:>8.0f}ms{ttft(p, workload, 0.99) * 1000:>8.0f}ms"
                         f"{busiest_share(p, workload):>8.0%}{n:>6}")
        lines.append(f"{p.name:<22}{'(all)':<15}{'':>9}{'':>9}{'':>10}{'':>10}{busiest_share(p):>8.0%}"
                     f"{len(p.samples):>6}   {p.wall_s:.0f} s; multi-turn hit rate with perfect affinity "
                     f">= {ideal_hit_rate(p):.2f}")
        for workload, reasons in p.decisions.items():
            if reasons:
                lines.append(f"{'':<22}{workload:<15}decisions: " + ", ".join(f"{r} {n}" for r, n in
                                                                             sorted(reasons.items())))
    return "\n".join(lines)


async def warm_up(url: str, key: str, model: str) -> None:
    """A few requests before any phase: the first gateway must not pay the workers' first-request costs."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as client:
        rng = random.Random("warm-up")
        await asyncio.gather(*(chat(client, url, key, model, [{"role": "user", "content": question(rng)}], "warm-up")
                               for _ in range(8)))


async def run_all(gateways: list[tuple[str, str]], key: str, model: str, workers: list[str]) -> list[Phase]:
    await warm_up(gateways[0][1], key, model)
    return [await run_phase(name, url, key, model, workers) for name, url in gateways]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", action="append", required=True, metavar="NAME=URL")
    parser.add_argument("--worker", action="append", required=True, metavar="URL", help="for their /metrics")
    parser.add_argument("--key", required=True, help="the gateway's master key")
    parser.add_argument("--model", default="smol", help="served model name")
    args = parser.parse_args()
    gateways = [tuple(g.split("=", 1)) for g in args.gateway]
    print(report(asyncio.run(run_all(gateways, args.key, args.model, args.worker))))


if __name__ == "__main__":
    main()
