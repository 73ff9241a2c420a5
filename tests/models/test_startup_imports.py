"""Building the model imports nothing start-up does not need: torch._dynamo alone costs about 2 s."""

import subprocess
import sys

CODE = """
import sys, torch
from pathlib import Path
from safetensors.torch import load_file
from pagefleet.worker.models.loader import build_model, load_model_config
path = Path(sys.argv[1])
model = build_model(load_model_config(path), path, torch.float32, torch.device("cpu"))
weights = {}
for f in path.glob("*.safetensors"):
    weights.update(load_file(f))
assert torch.equal(model.model.embed_tokens.weight, weights["model.embed_tokens.weight"].float())
print("torch._dynamo" in sys.modules)
"""


def test_building_the_model_does_not_import_dynamo(tiny_models):
    # a child process: other tests in this one may have imported torch._dynamo already
    done = subprocess.run([sys.executable, "-c", CODE, str(tiny_models["llama"])], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
