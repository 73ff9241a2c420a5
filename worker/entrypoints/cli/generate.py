"""`pagefleet generate`: run prompts (or one chat message) through the engine from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.entrypoints.engine_args import add_engine_arguments, engine_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("prompts", nargs="*", help="prompts (plain completion); see --chat")
    parser.add_argument("--chat", action="store_true",
                        help="treat each prompt as one user message through the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--json", action="store_true", help="one JSON object per output")


def run(args: argparse.Namespace) -> int:
    from pagefleet.worker.engine.llm import LLM

    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
            stop=args.stop,
        ).validate()
        prompts = args.prompts or ["Write one sentence about the sea."]
        config = engine_config_from_args(args)
        llm = LLM(**{k: v for k, v in vars(config).items()})
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outs = llm.generate(prompts, params)
    except ValueError as e:
        print(f"pagefleet generate: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": prompt, "index": c.index, "text": c.text,
                                  "finish_reason": c.finish_reason, "tokens": len(c.token_ids)}))
            else:
                print(f"[{c.index}] {prompt!r} -> {c.text!r} ({c.finish_reason}, {len(c.token_ids)} tokens)")
    return 0
