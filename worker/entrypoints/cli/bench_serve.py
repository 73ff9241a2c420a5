"""`pagefleet bench serve`: AIPerf-style load against a running OpenAI-compatible server.

At concurrency c, max(16, 4c) streaming /v1/completions requests (564 input / 128 output tokens,
ignore_eos), each of c slots sending its next request as soon as its last one finished. Reports TTFT and
inter-token latency p50 / p99, output tok/s, and the scaling against concurrency 1.

`--request-rate R ...` replaces the closed loop with an open one, as `vllm bench serve --request-rate`:
requests arrive at R a second on average (Poisson: exponential gaps, seeded), whatever is in flight, so
prompts land one by one beside running decodes instead of in waves; each level also reports the most
requests that were in flight at once.

Exact prompt lengths: `--prompt-format words` sends N words "t<id>", which is N tokens when the server's
checkpoint has the word-level tokenizer that `--write-word-tokenizer DIR` writes ("t0" ... "tN", split on
whitespace); `--prompt-format ids` sends token ids and needs no tokenizer change.

`--json-schema FILE` puts the schema in every request as its `response_format` (structured outputs under
load): outputs then end where the JSON closes (no ignore_eos), and each is checked against the schema; a level
reports the outputs that do not validate and those cut off at the output length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--base-url", default="http://127.0.0.1:8000")
    a("--model", default=None, help="served model name (default: the server's first)")
    a("--api-key", default=None)
    a("--input-len", type=int, default=564)
    a("--output-len", type=int, default=128)
    a("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    a("--num-requests", type=int, default=None, help="per level (default: max(16, 4c); 64 a request rate)")
    a("--request-rate", type=float, nargs="+", default=None,
      help="open-loop levels instead: requests a second, Poisson arrivals (replaces --concurrency)")
    a("--prompt-format", choices=["words", "ids"], default="words")
    a("--vocab-low", type=int, default=100, help="prompt tokens are drawn from [low, high)")
    a("--vocab-high", type=int, default=None, help="default: the server's vocabulary size")
    a("--seed", type=int, default=0)
    # Sampling fields as `vllm bench serve` sends them; greedy unless asked, as every earlier figure here was.
    a("--temperature", type=float, default=0.0)
    a("--top-p", type=float, default=None)
    a("--top-k", type=int, default=None)
    a("--min-p", type=float, default=None)
    a("--json-schema", metavar="FILE", default=None,
      help="a JSON schema (or an OpenAI json_schema object with name and schema) every request carries as "
           "response_format; outputs are validated against it")
    a("--json-out", default=None, help="also write the results as JSON here")
    a("--trace-out", default=None,
      help="write each request's start, first-token and end times and the server's steps (/debug/steps) per "
           "concurrency as JSON here; the two line up when client and server share a machine (time.perf_counter)")
    a("--write-word-tokenizer", metavar="MODEL_DIR", default=None,
      help="write a word-level tokenizer over MODEL_DIR's vocabulary (from its config.json) and exit")
    a("--json-chars", action="store_true",
      help="with --write-word-tokenizer: the top 95 ids are the printable ASCII characters, so a grammar can "
           "spell JSON (prompts then need --vocab-high of at most the vocabulary size - 95)")


JSON_CHARS = [chr(c) for c in range(32, 127)]  # printable ASCII: every character a JSON document needs


def write_word_tokenizer(model_dir: str, json_chars: bool = False) -> int:
    """tokenizer.json with the words t0 ... t{V-1}; a prompt of N such words is N tokens.

    json_chars: the top 95 ids become the printable ASCII characters instead and tokens decode side by side
    (no space between), so a grammar can spell any JSON document (structured-output benchmarks on random
    weights; prompts then draw words below V - 95, `bench serve --vocab-high`); the config's eos_token_id is
    the end-of-sequence special token, which a grammar needs to end on and the text leaves out."""
    import os

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    vocab_size = config["vocab_size"]
    first = vocab_size - len(JSON_CHARS) if json_chars else vocab_size  # the first id past the words
    vocab = {f"t{i}": i for i in range(first)} | {c: first + j for j, c in enumerate(JSON_CHARS) if json_chars}
    extra = {}
    if json_chars:
        eos = config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        if eos is None or not 0 < eos < first:
            raise ValueError(f"{model_dir}: eos_token_id {eos} must be a word below {first} for json_chars")
        extra = {"eos_token": f"t{eos}"}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if json_chars:
        tok.decoder = decoders.Fuse()  # '{', '"', 'a', ... decode as '{"a'
        tok.add_special_tokens([AddedToken(extra["eos_token"], special=True)])
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    # No special tokens otherwise: nothing is added to a prompt, and with ignore_eos none are needed.
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30,
                   "unk_token": "t0", "clean_up_tokenization_spaces": False, **extra}, f, indent=1)
    for stale in ("vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer.model"):
        if os.path.exists(os.path.join(model_dir, stale)):
            os.remove(os.path.join(model_dir, stale))
    kind = f"{vocab_size - len(JSON_CHARS)} words and {len(JSON_CHARS)} characters" if json_chars else \
        f"{vocab_size} words"
    print(f"wrote a word-level tokenizer of {kind} to {model_dir}")
    return 0


@dataclass
class Result:
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    text: str = ""  # kept only with --json-schema, to validate
    finish_reason: str | None = None
    start: float = 0.0  # time.perf_counter() at send and at the end of the stream
    end: float = 0.0


async def _one(session, url: str, headers: dict, body: dict, keep_text: bool = False) -> Result:
    r = Result()
    start = r.start = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            async for raw in resp.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.error = chunk["error"]["message"]
                    return r
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                    r.finish_reason = chunk["choices"][0]["finish_reason"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if keep_text:
                        r.text += chunk["choices"][0]["text"]
                    now = time.perf_counter()
                    if last is None:
                        r.ttft = now - start
                    else:
                        r.itls.append(now - last)
                    last = now
    except Exception as e:  # a failed request is reported, not fatal to the run
        r.error = f"{type(e).__name__}: {e}"
    r.end = time.perf_counter()
    return r


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def _level(session, args, headers: dict, model: str, prompts: list, concurrency: int | None,
                 rate: float | None = None, gaps: random.Random | None = None) -> tuple[dict, list[Result], float]:
    """Closed loop (concurrency slots) or, with rate, open loop (Poisson arrivals drawn from gaps)."""
    url = args.base_url.rstrip("/") + "/v1/completions"
    todo = list(prompts)
    results: list[Result] = []
    in_flight = peak = 0

    async def send(prompt) -> None:
        nonlocal in_flight, peak
        body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True,
                "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
        body.update({k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k), ("min_p", args.min_p))
                     if v is not None})
        if args.response_format is not None:  # the output ends where its JSON closes
            body["response_format"] = args.response_format
            body["ignore_eos"] = False
        in_flight += 1
        peak = max(peak, in_flight)
        results.append(await _one(session, url, headers, body, keep_text=args.response_format is not None))
        in_flight -= 1

    async def slot():
        while todo:
            await send(todo.pop())

    async def arrivals():
        sent = []
        for i, prompt in enumerate(todo):
            if i:
                await asyncio.sleep(gaps.expovariate(rate))
            sent.append(asyncio.create_task(send(prompt)))
        await asyncio.gather(*sent)

    start = time.perf_counter()
    await (arrivals() if rate else asyncio.gather(*(slot() for _ in range(concurrency))))
    wall = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    constrained = {}
    if args.response_format is not None:
        cut = [r for r in ok if r.finish_reason == "length"]
        invalid = [r for r in ok if r.finish_reason != "length" and not _validates(r.text, args.schema)]
        constrained = {"invalid_outputs": len(invalid), "cut_off_outputs": len(cut),
                       "first_invalid": invalid[0].text[:200] if invalid else None}
    return {
        "concurrency": concurrency, "request_rate": rate, "max_in_flight": peak,
        "requests": len(results), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "short_outputs": 0 if constrained else sum(1 for r in ok if r.output_tokens != args.output_len),
        **constrained,
        "ttft_p50_ms": 1e3 * _pct([r.ttft for r in ok], 50), "ttft_p99_ms": 1e3 * _pct([r.ttft for r in ok], 99),
        "itl_p50_ms": 1e3 * _pct([x for r in ok for x in r.itls], 50),
        "itl_p99_ms": 1e3 * _pct([x for r in ok for x in r.itls], 99),
        # per request, the time from its first token to its last over the tokens after the first (vLLM's TPOT)
        "tpot_p50_ms": 1e3 * _pct([sum(r.itls) / len(r.itls) for r in ok if r.itls], 50),
        "output_tok_s": tokens / wall, "wall_s": wall,
    }, results, start


async def _main(args) -> list[dict]:
    import aiohttp

    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(base + "/v1/models", headers=headers) as resp:
            card = (await resp.json())["data"][0]
        model = args.model or card["id"]
        high = args.vocab_high or card["vocab_size"]  # a pagefleet extra in /v1/models

        def prompt():
            ids = [rng.randrange(args.vocab_low, high) for _ in range(args.input_len)]
            return " ".join(f"t{i}" for i in ids) if args.prompt_format == "words" else ids

        await _level(session, args, headers, model, [prompt()], 1)  # warm-up, not reported
        rows, trace = [], []
        gaps = random.Random(args.seed + 1)  # arrival times apart from the prompts: the same prompts at every rate
        levels = [(None, r) for r in args.request_rate] if args.request_rate else [(c, None) for c in args.concurrency]
        for c, rate in levels:
            n = args.num_requests or (64 if rate else max(16, 4 * c))
            row, results, start = await _level(session, args, headers, model, [prompt() for _ in range(n)], c, rate,
                                               gaps)
            rows.append(row)
            print(f"  {_level_name(row)}: {row['requests']} requests, {row['errors']} errors, "
                  f"{row['output_tok_s']:.1f} tok/s"
                  + (f", {row['invalid_outputs']} invalid, {row['cut_off_outputs']} cut off JSON outputs"
                     if "invalid_outputs" in row else ""), file=sys.stderr, flush=True)
            if args.trace_out:
                async with session.get(base + "/debug/steps", headers=headers) as resp:
                    steps = (await resp.json())["recent_steps"] if resp.status == 200 else []  # not a pagefleet server
                trace.append({**_trace(c, results, steps, start), "request_rate": rate})
    if args.trace_out:
        with open(args.trace_out, "w") as f:
            json.dump(trace, f, indent=1)
    return rows


def _trace(concurrency: int, results: list[Result], steps: list[dict], start: float) -> dict:
    """One level's timeline, in seconds from its start: where a slow first token waited (steps the server
    ran before the level began, and any it no longer holds, are left out)."""
    return {
        "concurrency": concurrency,
        "requests": [{"start_s": r.start - start, "ttft_s": r.ttft, "end_s": r.end - start,
                      "output_tokens": r.output_tokens, "error": r.error} for r in results],
        "server_steps": [{**st, "start_s": st["start_s"] - start} for st in steps if st.get("start_s", 0.0) >= start],
    }


def _validates(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def load_response_format(path: str) -> dict:
    """The file's schema as a json_schema response_format; ValueError when it is not JSON or not an object."""
    import jsonschema

    with open(path) as f:
        spec = json.load(f)
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a JSON schema must be an object")
    if isinstance(spec.get("schema"), dict) and "name" in spec:  # already OpenAI's json_schema object
        spec, name = spec["schema"], spec["name"]
    else:
        name = os.path.splitext(os.path.basename(path))[0] or "schema"
    try:
        jsonschema.validators.validator_for(spec).check_schema(spec)
    except jsonschema.SchemaError as e:
        raise ValueError(f"{path}: not a valid JSON schema: {e.message}") from None
    return {"type": "json_schema", "json_schema": {"name": name, "schema": spec, "strict": True}}


def _level_name(row: dict) -> str:
    return f"rate {row['request_rate']:g}/s" if row["request_rate"] else f"c={row['concurrency']}"


def format_table(rows: list[dict]) -> str:
    open_loop = bool(rows) and bool(rows[0]["request_rate"])
    base = next((r["output_tok_s"] for r in rows if r["concurrency"] == 1), None)
    lines = [f"| {'request rate (/s)' if open_loop else 'concurrency'} | TTFT p50 / p99 (ms) "
             f"| inter-token p50 / p99 (ms) | TPOT p50 (ms) | output tok/s "
             f"| {'most in flight' if open_loop else 'scaling'} |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if open_loop:
            level, last = f"{r['request_rate']:g}", str(r["max_in_flight"])
        else:
            level, last = str(r["concurrency"]), f"{r['output_tok_s'] / base:.1f}×" if base else "—"
        lines.append(f"| {level} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
                     f"{r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | {r['tpot_p50_ms']:.2f} | "
                     f"{r['output_tok_s']:,.1f} | {last} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.json_chars and not args.write_word_tokenizer:
        print("pagefleet bench serve: --json-chars goes with --write-word-tokenizer MODEL_DIR", file=sys.stderr)
        return 2
    if args.write_word_tokenizer:
        try:
            return write_word_tokenizer(args.write_word_tokenizer, args.json_chars)
        except (OSError, KeyError, ValueError) as e:
            print(f"pagefleet bench serve: --write-word-tokenizer: {e}", file=sys.stderr)
            return 2
    for flag, path in (("--json-out", args.json_out), ("--trace-out", args.trace_out)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            # said now, not after a run of minutes whose results would then have nowhere to go
            print(f"pagefleet bench serve: {flag} {path}: {folder} is not a writable folder", file=sys.stderr)
            return 2
    bad_rates = [r for r in args.request_rate or [] if not r > 0]  # nan too
    if bad_rates:
        print(f"pagefleet bench serve: --request-rate must be > 0 (inf: all at once), got {bad_rates[0]:g}",
              file=sys.stderr)
        return 2
    args.response_format = args.schema = None
    if args.json_schema:
        try:
            args.response_format = load_response_format(args.json_schema)
        except (OSError, ValueError) as e:
            print(f"pagefleet bench serve: --json-schema {e}", file=sys.stderr)
            return 2
        args.schema = args.response_format["json_schema"]["schema"]
    rows = asyncio.run(_main(args))
    print(format_table(rows))
    bad = [r for r in rows if r["errors"] or r["short_outputs"] or r.get("invalid_outputs")]
    for r in bad:
        if r.get("invalid_outputs"):
            print(f"{_level_name(r)}: {r['invalid_outputs']} outputs do not validate against the schema, e.g. "
                  f"{r['first_invalid']!r}", file=sys.stderr)
        print(f"{_level_name(r)}: {r['errors']} errors ({r['first_error']}), "
              f"{r['short_outputs']} outputs not {args.output_len} tokens", file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0
