"""benchmarks/mixed_prefill_bench.sh end to end on the CPU: two real servers on a tiny Llama in turn, one holding
prompt chunks beside decodes to 8 tokens, the real `pagefleet bench serve` against each, and the table they make;
a setting the server refuses stops the script with the server's reason, not a hang."""

import os
import subprocess
from pathlib import Path

from ports import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mixed_prefill_bench.sh"
SMOKE = "--concurrency 4 --num-requests 8 --input-len 32 --output-len 8 --prompt-format ids"


def bench(out, model, settings, max_model_len=1024):
    env = dict(os.environ, SETTINGS=settings, BENCH_ARGS=SMOKE, MAX_MODEL_LEN=str(max_model_len),
               PORT=str(free_port()))
    return subprocess.run(["bash", str(SCRIPT), str(out), str(model)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=SCRIPT.parents[1])


def test_the_sweep_serves_each_setting_and_tabulates_it(tiny_models, tmp_path):
    done = bench(tmp_path, tiny_models["llama"], "64 64/8")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line for line in (tmp_path / "mixed_prefill.md").read_text().splitlines()[2:]]
    assert [r.split("|")[1].strip() for r in rows] == ["64", "64/8"]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert float(cells[1].replace(",", "")) > 0 and cells[5] == "0", row  # tok/s, errors
    assert "--mixed-prefill-tokens 8" in done.stdout


def test_a_refused_setting_stops_with_the_servers_reason(tiny_models, tmp_path):
    done = bench(tmp_path, tiny_models["llama"], "64", max_model_len=4096)
    assert done.returncode == 1
    assert "exceeds the model's max_position_embeddings" in done.stdout
