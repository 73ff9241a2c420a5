"""The InferenceService CRD: names, subresources, columns, schema shape, the spec's CEL rules run on specs; the chart
ships the same file."""

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from pagefleet.operator import resources

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "inferenceservices.pagefleet.io.yaml"
CHART_CRD_FILE = ROOT / "charts" / "pagefleet" / "crds" / "inferenceservices.pagefleet.io.yaml"


def crd():
    return yaml.safe_load(CRD_FILE.read_text())


def version():
    (only,) = crd()["spec"]["versions"]
    return only


def schema():
    return version()["schema"]["openAPIV3Schema"]


def test_names_match_what_the_operator_watches():
    doc = crd()
    assert doc["metadata"]["name"] == f"{resources.PLURAL}.{resources.GROUP}"
    assert doc["spec"]["group"] == resources.GROUP
    assert doc["spec"]["scope"] == "Namespaced"
    names = doc["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "InferenceService", "inferenceservices", ["infsvc"])
    assert version()["name"] == resources.VERSION and version()["served"] and version()["storage"]


def test_status_and_scale_subresources():
    sub = version()["subresources"]
    assert sub["status"] == {}
    assert sub["scale"] == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector"}


def test_printer_columns():
    columns = {c["name"]: c["jsonPath"] for c in version()["additionalPrinterColumns"]}
    assert columns == {"Model": ".spec.model.name", "Ready": ".status.readyReplicas", "Desired": ".spec.replicas",
                       "Phase": ".status.phase", "LoRA": ".status.lora.workersInSync",
                       "Age": ".metadata.creationTimestamp"}
    wide_only = {c["name"] for c in version()["additionalPrinterColumns"] if c.get("priority", 0) > 0}
    assert wide_only == {"LoRA"}


def test_spec_fields_and_rules():
    spec = schema()["properties"]["spec"]
    assert set(spec["properties"]) >= {"model", "engine", "replicas", "autoscaling", "resources", "image",
                                       "nodeSelector", "tolerations", "lora"}
    lora = spec["properties"]["lora"]
    assert [r["rule"] for r in lora["x-kubernetes-validations"]][:2] == [
        "has(self.hostPath) != has(self.pvc)", "self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))"]
    assert lora["properties"]["adapters"]["maxItems"] == 32  # bounds the CEL cost of the uniqueness rule
    model = spec["properties"]["model"]
    assert model["x-kubernetes-validations"][0]["rule"] == "has(self.hostPath) != has(self.pvc)"
    cache_path = spec["properties"]["kernelCache"]["properties"]["hostPath"]["properties"]["path"]
    assert cache_path["x-kubernetes-validations"][0]["rule"] == "self.startsWith('/')"
    engine = spec["properties"]["engine"]["properties"]
    assert set(engine) == {"gpuMemoryFraction", "maxModelLen", "maxNumSeqs", "maxNumBatchedTokens", "blockSize",
                           "enablePrefixCaching", "enforceEager", "dtype", "quantization", "kvCacheDtype",
                           "extraArgs", "tensorParallelSize"}
    fraction = engine["gpuMemoryFraction"]
    assert (fraction["minimum"], fraction["exclusiveMinimum"], fraction["maximum"]) == (0, True, 1)
    autoscaling = spec["properties"]["autoscaling"]
    assert autoscaling["x-kubernetes-validations"][0]["rule"] == "self.minReplicas <= self.maxReplicas"
    assert set(autoscaling["properties"]) == {"minReplicas", "maxReplicas", "targetQueueDepth", "scaleDownDelaySeconds",
                                              "scaleToZeroAfterSeconds"}
    # Every rule carries a message that names the field, so `kubectl apply` explains the refusal.
    rules = _all_rules(schema())
    assert len(rules) >= 4 and all("spec." in r["message"] for r in rules)


def test_scale_to_zero_fields_and_rules():
    autoscaling = schema()["properties"]["spec"]["properties"]["autoscaling"]
    props = autoscaling["properties"]
    assert (props["minReplicas"]["minimum"], props["minReplicas"]["default"]) == (0, 1)
    assert props["scaleToZeroAfterSeconds"]["minimum"] == 1 and "default" not in props["scaleToZeroAfterSeconds"]
    rules = {r["rule"]: r["message"] for r in autoscaling["x-kubernetes-validations"]}
    assert "needs minReplicas: 0" in rules["!has(self.scaleToZeroAfterSeconds) || self.minReplicas == 0"]
    assert "needs scaleToZeroAfterSeconds" in rules["self.minReplicas > 0 || has(self.scaleToZeroAfterSeconds)"]


def test_status_fields():
    status = schema()["properties"]["status"]["properties"]
    assert set(status) >= {"phase", "replicas", "readyReplicas", "observedGeneration", "endpoints", "conditions",
                           "lastScaleTime", "selector", "lastStartSeconds"}
    assert "idleSince" in status["autoscaling"]["properties"]
    assert "Idle" in status["phase"]["description"]


def test_schema_is_structural():
    """Every node states its type (or is int-or-string): the API server rejects a CRD otherwise."""
    def walk(node, path):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        for name, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}{{}}")
    walk(schema(), "")


def test_chart_ships_the_same_crd():
    assert CHART_CRD_FILE.read_text() == CRD_FILE.read_text()


def _all_rules(node):
    rules = list(node.get("x-kubernetes-validations") or [])
    for child in (node.get("properties") or {}).values():
        rules += _all_rules(child)
    if "items" in node:
        rules += _all_rules(node["items"])
    return rules


# ---- tensor parallelism: the rules evaluated, as the API server does ------------------------------
# The spec-level CEL rules run in a CEL interpreter (common-expression-language) on the spec after the schema's
# defaults are applied, the order the API server validates in; the bounds (enum, minimum) run in a JSON Schema
# validator. What only the API server checks (the rules' cost estimate, which refuses a messageExpression built on
# string(int); Kubernetes' CEL library such as isQuantity) is e2e/test_operator.py's.

def test_tensor_parallel_size_field():
    field = schema()["properties"]["spec"]["properties"]["engine"]["properties"]["tensorParallelSize"]
    assert field["type"] == "integer" and field["enum"] == [1, 2, 4, 8] and "default" not in field
    assert "spec.resources.gpus" in field["description"]


def defaulted(node, value):
    """`value` with the schema's defaults filled in, as the API server's structural defaulting does: a default
    is set where a property is missing, then the defaults inside it (resources: {} gets gpus: 1)."""
    if not isinstance(value, dict) or node.get("type") != "object":
        return value
    out = dict(value)
    for name, prop in (node.get("properties") or {}).items():
        if name not in out and "default" in prop:
            out[name] = copy.deepcopy(prop["default"])
    return {k: defaulted((node.get("properties") or {}).get(k, {}), v) for k, v in out.items()}


SPEC_RULES = schema()["properties"]["spec"]["x-kubernetes-validations"]
TP_RULE = next(r for r in SPEC_RULES if "tensorParallelSize" in r["rule"] and "gpus" in r["rule"])
MODEL = {"name": "m", "hostPath": {"path": "/m"}}
LORA = {"hostPath": {"path": "/a"}, "adapters": [{"name": "x", "path": "x"}]}


def refusals(spec):
    """The messages of the spec-level rules that refuse `spec` (messageExpression where the rule has one)."""
    cel = pytest.importorskip("cel", reason="the CRD's CEL rules are evaluated with common-expression-language")
    context = {"self": defaulted(schema()["properties"]["spec"], spec)}
    messages = []
    for rule in SPEC_RULES:
        if not cel.evaluate(rule["rule"], context):
            messages.append(cel.evaluate(rule["messageExpression"], context) if "messageExpression" in rule
                            else rule["message"])
    return messages


@pytest.mark.parametrize("engine, resources", [
    (None, None), ({}, None), ({"tensorParallelSize": 1}, None), ({"tensorParallelSize": 1}, {"gpus": 1}),
    ({"tensorParallelSize": 2}, {"gpus": 2}), ({"tensorParallelSize": 8}, {"gpus": 8}),
    ({"tensorParallelSize": 4}, {"gpus": 0}),  # the CPU: the ranks talk over gloo
    ({"maxNumSeqs": 8}, {"gpus": 4}),  # no tensorParallelSize: gpus is left to the user (a worker may use one)
])
def test_tensor_parallel_specs_the_rules_accept(engine, resources):
    spec = {"model": MODEL}
    if engine is not None:
        spec["engine"] = engine
    if resources is not None:
        spec["resources"] = resources
    assert refusals(spec) == []


def test_tensor_parallel_size_with_the_default_one_gpu_is_refused_with_the_fix():
    (message,) = refusals({"model": MODEL, "engine": {"tensorParallelSize": 2}})
    assert message == ("spec.resources.gpus must be 2 to match spec.engine.tensorParallelSize, or 0 to run on the "
                       "CPU: one pod holds all the GPUs of its tensor-parallel group (gpus is 1 when unset)")
    # resources present without gpus: the nested default (1) applies all the same.
    assert refusals({"model": MODEL, "engine": {"tensorParallelSize": 2}, "resources": {"memory": "8Gi"}}) == [
        message]


@pytest.mark.parametrize("size, gpus", [(4, 2), (8, 4), (2, 8), (1, 2)])
def test_tensor_parallel_size_and_another_gpu_count_is_refused(size, gpus):
    (message,) = refusals({"model": MODEL, "engine": {"tensorParallelSize": size}, "resources": {"gpus": gpus}})
    assert message.startswith(f"spec.resources.gpus must be {size} to match spec.engine.tensorParallelSize,")
    assert "when unset" not in message
    assert TP_RULE["message"].startswith("spec.resources.gpus must equal spec.engine.tensorParallelSize")


def test_tensor_parallel_with_lora_is_accepted():
    """The worker shards adapters like their linears (tests/executor/test_tensor_parallel.py)."""
    spec = {"model": MODEL, "lora": LORA, "engine": {"tensorParallelSize": 2}, "resources": {"gpus": 2}}
    assert refusals(spec) == []


def test_spec_rules_need_no_defaults_to_evaluate():
    """The has() guards: an object read without resources or engine evaluates instead of erroring."""
    cel = pytest.importorskip("cel", reason="the CRD's CEL rules are evaluated with common-expression-language")
    for spec in ({"model": MODEL}, {"model": MODEL, "engine": {"tensorParallelSize": 2}},
                 {"model": MODEL, "resources": {}}, {"model": MODEL, "lora": LORA, "engine": {}}):
        for rule in SPEC_RULES:
            assert cel.evaluate(rule["rule"], {"self": spec}) in (True, False), (rule["rule"], spec)


@pytest.mark.parametrize("size, ok", [(1, True), (2, True), (3, False), (4, True), (6, False), (8, True),
                                      (16, False), (0, False)])
def test_tensor_parallel_size_enum(size, ok):
    validator = jsonschema.Draft4Validator(schema())  # x-kubernetes-* keywords are ignored, bounds are not
    body = {"spec": {"model": MODEL, "engine": {"tensorParallelSize": size}, "resources": {"gpus": size}}}
    errors = [e.message for e in validator.iter_errors(body)]
    assert (errors == []) == ok, errors
