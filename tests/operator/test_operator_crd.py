"""The InferenceService CRD: names, subresources, columns, schema shape; the chart ships the same file."""

from pathlib import Path

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
                           "enablePrefixCaching", "enforceEager", "dtype", "quantization", "extraArgs"}
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
