"""`pagefleet serve | generate | bench | operator | gateway`: one entry point, each command in its own module.

Commands import their module only when chosen, so `pagefleet operator` and `pagefleet gateway`
never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, help); the module provides add_arguments(parser) and run(args) -> int | None
COMMANDS = {
    "serve": ("pagefleet.worker.entrypoints.serve", "run the OpenAI-compatible worker server"),
    "generate": ("pagefleet.worker.entrypoints.cli.generate", "generate offline from prompts on the command line"),
    "operator": ("pagefleet.operator.main", "run the InferenceService operator (kopf)"),
    "gateway": ("pagefleet.gateway.app", "run the LiteLLM gateway with queue-depth routing"),
}
BENCH_COMMANDS = {
    "throughput": ("pagefleet.worker.entrypoints.cli.bench_throughput",
                   "offline throughput of the engine (and transformers)"),
    "serve": ("pagefleet.worker.entrypoints.cli.bench_serve",
              "load a running server and report TTFT, inter-token latency, tok/s"),
}


def _add(subparsers, name: str, module: str, help: str) -> None:
    parser = subparsers.add_parser(name, help=help, description=help)
    mod = importlib.import_module(module)
    mod.add_arguments(parser)
    parser.set_defaults(_run=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagefleet", description="LLM inference platform for Kubernetes")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Import only the module of the chosen command: argparse needs its flags, the others stay unloaded.
    chosen = argv[0] if argv else None
    for name, (module, help) in COMMANDS.items():
        if name == chosen:
            _add(sub, name, module, help)
        else:
            sub.add_parser(name, help=help)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    bench_chosen = argv[1] if chosen == "bench" and len(argv) > 1 else None
    for name, (module, help) in BENCH_COMMANDS.items():
        if name == bench_chosen:
            _add(bench_sub, name, module, help)
        else:
            bench_sub.add_parser(name, help=help)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    result = args._run(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
