"""Rendering an InferenceService into its Deployment and Service (no cluster)."""

import copy

import pytest

from pagefleet.operator import adapters, resources, worker_pod

OWNER_UID = "0f9c1d2e-aaaa-bbbb-cccc-123456789abc"


def inference_service(**spec_overrides):
    spec = {
        "model": {"name": "smollm2", "hostPath": {"path": "/mnt/nvme/models/smollm2"}},
        "replicas": 2,
        "resources": {"gpus": 1, "cpu": "4", "memory": "32Gi"},
        "image": "pagefleet/pagefleet:test",
        "drainSeconds": 45,
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "serving", "uid": OWNER_UID, "generation": 3},
        "spec": spec,
    }


def container(deployment):
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag(args, name):
    return args[args.index(name) + 1]


def test_hostpath_deployment_mounts_checkpoint_read_only_at_its_node_path():
    dep = resources.deployment(inference_service())
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "model", "hostPath": {"path": "/mnt/nvme/models/smollm2", "type": "Directory"}} in pod["volumes"]
    mount = next(m for m in container(dep)["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/mnt/nvme/models/smollm2", "readOnly": True}
    assert flag(container(dep)["args"], "--model") == "/mnt/nvme/models/smollm2"


def test_pvc_deployment_mounts_claim_read_only_with_sub_path():
    body = inference_service(model={"name": "llama", "pvc": {"claimName": "weights", "subPath": "llama-3.1-8b"}})
    dep = resources.deployment(body)
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    mount = next(m for m in container(dep)["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models/weights", "readOnly": True, "subPath": "llama-3.1-8b"}
    args = container(dep)["args"]
    assert flag(args, "--model") == "/models/weights"
    assert flag(args, "--served-model-name") == "llama"
    assert not any("hostPath" in v for v in pod["volumes"])


def test_kernel_cache_is_an_emptydir_unless_spec_names_a_node_directory():
    dep = resources.deployment(inference_service())
    pod, worker = dep["spec"]["template"]["spec"], container(dep)
    assert {"name": "kernel-cache", "emptyDir": {}} in pod["volumes"]  # kept across container restarts
    assert {"name": "kernel-cache", "mountPath": "/var/cache/pagefleet"} in worker["volumeMounts"]
    assert {"name": "TRITON_CACHE_DIR", "value": "/var/cache/pagefleet/triton"} in worker["env"]
    dep = resources.deployment(inference_service(kernelCache={"hostPath": {"path": "/mnt/nvme/pagefleet-kernels"}}))
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "kernel-cache")
    assert volume == {"name": "kernel-cache",
                      "hostPath": {"path": "/mnt/nvme/pagefleet-kernels", "type": "DirectoryOrCreate"}}
    mount = next(m for m in container(dep)["volumeMounts"] if m["name"] == "kernel-cache")
    assert not mount.get("readOnly")  # the one volume the worker writes


def test_pvc_without_sub_path_mounts_the_claim_root():
    dep = resources.deployment(inference_service(model={"name": "m", "pvc": {"claimName": "weights"}}))
    mount = next(m for m in container(dep)["volumeMounts"] if m["name"] == "model")
    assert "subPath" not in mount and mount["readOnly"] is True


def test_engine_fields_become_worker_flags():
    engine = {
        "gpuMemoryFraction": 0.35, "maxModelLen": 4096, "maxNumSeqs": 64, "maxNumBatchedTokens": 8192,
        "blockSize": 32, "enablePrefixCaching": False, "enforceEager": True, "dtype": "bfloat16",
        "quantization": "fp8", "kvCacheDtype": "fp8", "extraArgs": ["--max-queue", "512"],
    }
    args = container(resources.deployment(inference_service(engine=engine)))["args"]
    assert args[:8] == ["--model", "/mnt/nvme/models/smollm2", "--served-model-name", "smollm2",
                        "--host", "$(POD_IP)", "--port", "8000"]
    assert flag(args, "--gpu-memory-fraction") == "0.35"
    assert flag(args, "--max-model-len") == "4096"
    assert flag(args, "--max-num-seqs") == "64"
    assert flag(args, "--max-num-batched-tokens") == "8192"
    assert flag(args, "--block-size") == "32"
    assert flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--quantization") == "fp8"
    assert flag(args, "--kv-cache-dtype") == "fp8"
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
    assert "--enforce-eager" in args
    assert flag(args, worker_pod.DRAIN_FLAG) == "45"
    assert args[-2:] == ["--max-queue", "512"]


def test_unset_engine_fields_keep_worker_defaults():
    args = container(resources.deployment(inference_service()))["args"]
    for absent in ("--gpu-memory-fraction", "--max-num-seqs", "--enforce-eager", "--enable-prefix-caching",
                   "--no-enable-prefix-caching", "--dtype", "--quantization", "--kv-cache-dtype"):
        assert absent not in args
    args = container(resources.deployment(inference_service(engine={"enablePrefixCaching": True,
                                                                    "enforceEager": False})))["args"]
    assert "--enable-prefix-caching" in args and "--enforce-eager" not in args


def test_worker_listens_on_the_pod_ip_from_the_downward_api():
    c = container(resources.deployment(inference_service()))
    assert c["command"] == ["pagefleet", "serve"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    assert flag(c["args"], "--host") == "$(POD_IP)"
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"


def test_probes_startup_readiness_liveness():
    c = container(resources.deployment(inference_service()))
    assert c["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    # A big checkpoint may load for many minutes before liveness applies.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_termination_grace_covers_pre_stop_and_drain():
    dep = resources.deployment(inference_service(drainSeconds=100))
    pod = dep["spec"]["template"]["spec"]
    pre_stop = container(dep)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + 100
    assert flag(container(dep)["args"], worker_pod.DRAIN_FLAG) == "100"


def test_shm_gpu_limits_cpu_memory():
    dep = resources.deployment(inference_service())
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(dep)["volumeMounts"]
    res = container(dep)["resources"]
    assert res["limits"] == {"nvidia.com/gpu": 1, "cpu": "4", "memory": "32Gi"}
    assert res["requests"] == {"cpu": "4", "memory": "32Gi"}


def test_zero_gpus_requests_no_gpu():
    dep = resources.deployment(inference_service(resources={"gpus": 0}))
    assert "resources" not in container(dep)


def test_children_are_owned_by_the_inference_service():
    body = inference_service()
    for child in resources.children(body):
        assert child["metadata"]["namespace"] == "serving"
        assert child["metadata"]["name"] == "chat"
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService", "name": "chat",
            "uid": OWNER_UID, "controller": True, "blockOwnerDeletion": True,
        }]
        assert child["metadata"]["labels"][resources.INSTANCE_LABEL] == "chat"


def test_deployment_selects_its_pods_and_rolls_without_losing_capacity():
    dep = resources.deployment(inference_service())
    assert dep["spec"]["selector"]["matchLabels"] == {"pagefleet.io/inference-service": "chat"}
    template_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "pagefleet/pagefleet:test"


def test_service_fronts_the_worker_port():
    svc = resources.service(inference_service())
    assert svc["spec"]["selector"] == {"pagefleet.io/inference-service": "chat"}
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert svc["metadata"]["annotations"][resources.SERVED_MODEL_ANNOTATION] == "smollm2"


def test_node_selector_and_tolerations_pass_through():
    tol = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    dep = resources.deployment(inference_service(nodeSelector={"gpu": "h200"}, tolerations=tol))
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h200"}
    assert pod["tolerations"] == tol


@pytest.mark.parametrize("replicas, bounds, expected", [
    (3, None, 3), (0, None, 0), (1, (2, 5), 2), (9, (2, 5), 5), (4, (2, 5), 4),
])
def test_desired_replicas_stay_within_autoscaling_bounds(replicas, bounds, expected):
    spec = {"replicas": replicas}
    if bounds:
        spec["autoscaling"] = {"minReplicas": bounds[0], "maxReplicas": bounds[1]}
    assert resources.desired_replicas(spec) == expected


def test_rendering_is_deterministic_and_does_not_touch_the_input():
    body = inference_service(engine={"maxNumSeqs": 8})
    before = copy.deepcopy(body)
    assert resources.children(body) == resources.children(body)
    assert body == before


def test_changing_max_num_seqs_changes_only_the_pod_template_args():
    old = resources.deployment(inference_service(engine={"maxNumSeqs": 8}))
    new = resources.deployment(inference_service(engine={"maxNumSeqs": 16}))
    assert flag(container(new)["args"], "--max-num-seqs") == "16"
    container(old)["args"] = container(new)["args"]
    assert old == new


def test_operator_imports_no_torch():
    import subprocess
    import sys
    code = ("import sys, pagefleet.operator, pagefleet.operator.main; "
            "bad = [m for m in ('torch', 'pagefleet.worker', 'pagefleet.kernels') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lora_adapters_mount_read_only_and_stay_out_of_the_pod_template():
    listed = [{"name": "sql", "path": "sql-v3"}, {"name": "chat-de", "path": "de/v1"}]
    body = inference_service(lora={"pvc": {"claimName": "adapters", "subPath": "team-a"}, "maxLoraRank": 32,
                                   "adapters": listed})
    dep = resources.deployment(body)
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "lora", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}} in pod["volumes"]
    mount = next(m for m in container(dep)["volumeMounts"] if m["name"] == "lora")
    assert mount == {"name": "lora", "mountPath": "/adapters", "readOnly": True, "subPath": "team-a"}
    args = container(dep)["args"]
    assert "--enable-lora" in args and flag(args, "--max-loras") == "4" and flag(args, "--max-lora-rank") == "32"
    assert "--lora-modules" not in args  # the sweep loads them: a list in the template would roll pods on every change
    assert adapters.desired_adapters(body["spec"]) == {"sql": "/adapters/sql-v3", "chat-de": "/adapters/de/v1"}
    other = inference_service(lora={**body["spec"]["lora"], "adapters": [{"name": "sql", "path": "sql-v4"}]})
    assert resources.deployment(other)["spec"]["template"] == dep["spec"]["template"]
    annotations = resources.service(body)["metadata"]["annotations"]
    assert annotations == {"pagefleet.io/served-model-name": "smollm2", "pagefleet.io/lora-adapters": "sql,chat-de"}


def test_lora_host_path_source_and_slots_for_every_listed_adapter():
    adapters_ = [{"name": f"a{i}", "path": f"a{i}"} for i in range(6)]
    source = {"hostPath": {"path": "/mnt/nvme/adapters"}}
    dep = resources.deployment(inference_service(lora={**source, "adapters": adapters_}))
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "lora", "hostPath": {"path": "/mnt/nvme/adapters", "type": "Directory"}} in pod["volumes"]
    mount = next(m for m in container(dep)["volumeMounts"] if m["name"] == "lora")
    assert mount == {"name": "lora", "mountPath": "/mnt/nvme/adapters", "readOnly": True}  # its node path, as the model
    assert flag(container(dep)["args"], "--max-loras") == "6"
    trailing_slash = inference_service(lora={"hostPath": {"path": "/mnt/nvme/adapters/"}, "adapters": adapters_})
    assert adapters.desired_adapters(trailing_slash["spec"])["a0"] == "/mnt/nvme/adapters/a0"


def test_no_lora_section_renders_no_lora_flags_volume_or_annotation():
    body = inference_service()
    dep = resources.deployment(body)
    assert not any(a.startswith("--enable-lora") or a == "--lora-modules" for a in container(dep)["args"])
    assert all(v["name"] != "lora" for v in dep["spec"]["template"]["spec"]["volumes"])
    assert "pagefleet.io/lora-adapters" not in resources.service(body)["metadata"]["annotations"]


# ---- tensor parallelism: one pod holds the group's GPUs -------------------------------------------

def env_of(c):
    return {e["name"]: e.get("value") for e in c["env"]}


@pytest.mark.parametrize("size", [2, 4, 8])
def test_tensor_parallel_size_becomes_the_flag_the_gpu_limit_and_nccl_env(size):
    dep = resources.deployment(inference_service(engine={"tensorParallelSize": size},
                                                 resources={"gpus": size, "memory": "64Gi"}))
    c = container(dep)
    assert flag(c["args"], worker_pod.TP_FLAG) == str(size) and c["args"].count(worker_pod.TP_FLAG) == 1
    assert c["resources"]["limits"]["nvidia.com/gpu"] == size
    assert env_of(c)["NCCL_NVLS_ENABLE"] == "0"
    # The group shares memory through /dev/shm: the memory-backed volume is there and mounted.
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in dep["spec"]["template"]["spec"]["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # Still one container on one port: the pod is one endpoint to the gateway.
    assert [p["containerPort"] for p in c["ports"]] == [worker_pod.WORKER_PORT]
    assert len(dep["spec"]["template"]["spec"]["containers"]) == 1


@pytest.mark.parametrize("engine", [None, {}, {"tensorParallelSize": 1}])
def test_tensor_parallel_size_1_or_unset_renders_no_flag_and_no_nccl_env(engine):
    c = container(resources.deployment(inference_service(**({"engine": engine} if engine is not None else {}))))
    assert worker_pod.TP_FLAG not in c["args"]
    assert "NCCL_NVLS_ENABLE" not in env_of(c)


def test_tensor_parallel_on_cpu_requests_no_gpu_and_keeps_the_flag():
    c = container(resources.deployment(inference_service(engine={"tensorParallelSize": 2}, resources={"gpus": 0})))
    assert flag(c["args"], worker_pod.TP_FLAG) == "2"
    assert "resources" not in c


def test_shared_memory_sets_the_size_limit_of_dev_shm():
    pod = resources.deployment(inference_service(resources={"gpus": 2, "sharedMemory": "8Gi"},
                                                 engine={"tensorParallelSize": 2}))["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    # sharedMemory sizes the volume; it is not a container resource.
    assert "sharedMemory" not in str(pod["containers"][0].get("resources"))


def test_worker_falls_back_to_its_logs_for_the_termination_message():
    # A worker refusing a flag exits before writing /dev/termination-log: its last log lines become the message.
    assert container(resources.deployment(inference_service()))["terminationMessagePolicy"] == "FallbackToLogsOnError"
