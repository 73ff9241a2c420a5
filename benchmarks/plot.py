"""docs/h200.png from docs/results/h200.json: offline and serving output tok/s, bf16 and FP8, beside vLLM 0.26.

Usage: python3 benchmarks/plot.py [RESULTS_JSON [OUT_PNG]]   (needs matplotlib)
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# vLLM 0.26.0 and transformers 5.17 on the same H200 kind, same checkpoint shape and workloads (ANCHORS.md)
VLLM_OFFLINE = {"batch 1": 198.8, "batch 8": 1334, "mixed 256": 8237, "mixed 2048": 9500}
HF_OFFLINE = {"batch 1": 15.7, "batch 8": 142, "mixed 256": 411}
VLLM_SERVE = {1: 195, 4: 721, 8: 1308, 16: 2216, 32: 3420, 64: 4478}


def offline(results: dict, dtype: str) -> dict:
    """Batch 1 / 8 (512 in, 128 out) from the eager benchmark's graphed arm, the mixed draws at 1,024 sequences."""
    static = results["call_3"]["eager_bench"][dtype]
    mixed = results["call_2"]["mixed_bench"][f"{dtype}_1024"]
    return {"batch 1": static["1"]["graphs"], "batch 8": static["8"]["graphs"],
            "mixed 256": mixed["256"]["output_tok_per_s"], "mixed 2048": mixed["2048"]["output_tok_per_s"]}


def main(results_path: Path, out: Path) -> None:
    results = json.loads(results_path.read_text())
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(VLLM_OFFLINE)
    x = range(len(names))
    w = 0.2
    bars = [("transformers 5.17", HF_OFFLINE), ("vLLM 0.26 (bf16)", VLLM_OFFLINE),
            ("pagefleet bf16", offline(results, "bf16")), ("pagefleet FP8", offline(results, "fp8"))]
    for i, (label, figures) in enumerate(bars):
        a.bar([j + (i - 1.5) * w for j in x], [figures.get(n, 0) for n in names], w, label=label)
    a.set_xticks(list(x), names)
    a.set_yscale("log")
    a.set_xlabel("offline workload (batches: 512 in / 128 out; mixed: the anchors' draws)")
    a.set_ylabel("output tok/s")
    a.set_title("Offline, Llama-3.1-8B shape, one H200")
    a.legend()
    serve = results["call_1"]
    bf16_serve, fp8_serve = serve["serve_bf16"], serve["serve_fp8"]
    conc = [r["concurrency"] for r in bf16_serve]
    b.plot(conc, [VLLM_SERVE[c] for c in conc], "o-", label="vLLM 0.26 serve (bf16)")
    b.plot(conc, [r["output_tok_s"] for r in bf16_serve], "o-", label="pagefleet serve bf16")
    b.plot([r["concurrency"] for r in fp8_serve], [r["output_tok_s"] for r in fp8_serve], "o-",
           label="pagefleet serve FP8")
    b.set_xscale("log", base=2)
    b.set_xlabel("concurrency (564 in / 128 out, streaming)")
    b.set_ylabel("output tok/s")
    b.set_title("Serving, same H200 kind")
    b.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    docs = Path(__file__).resolve().parent.parent / "docs"
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else docs / "results" / "h200.json",
         Path(sys.argv[2]) if len(sys.argv) > 2 else docs / "h200.png")
