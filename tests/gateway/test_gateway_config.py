"""The generated LiteLLM config (gateway/config.py), checked by LiteLLM's own Router."""

import os

import pytest
import yaml

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from pagefleet.gateway.config import (  # noqa: E402
    WORKER_URL_KEY,
    ProxySettings,
    deployment,
    litellm_config,
    normalise_worker_url,
    write_config,
)


def test_worker_urls_are_normalised_or_refused():
    assert normalise_worker_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert normalise_worker_url(" http://10.0.0.7:8000 ") == "http://10.0.0.7:8000"
    for bad in ("127.0.0.1:8000", "http://host", "http://h:1/v1", "ftp://h:1"):
        with pytest.raises(ValueError, match="worker URL"):
            normalise_worker_url(bad)


def test_one_deployment_per_worker_in_the_served_model_group():
    d = deployment("smol", "http://127.0.0.1:8001")
    assert d["model_name"] == "smol"
    assert d["litellm_params"]["api_base"] == "http://127.0.0.1:8001/v1"
    assert d["model_info"][WORKER_URL_KEY] == "http://127.0.0.1:8001"
    assert d["model_info"]["id"] == "smol@http://127.0.0.1:8001"


def test_master_key_must_look_like_one():
    with pytest.raises(ValueError, match="sk-"):
        ProxySettings(master_key="hunter2")
    with pytest.raises(ValueError):
        ProxySettings(master_key="sk-x", num_retries=-1)


def test_litellm_router_accepts_the_config(tmp_path):
    import litellm

    settings = ProxySettings(master_key="sk-test", num_retries=2, cooldown_time_s=3)
    config = litellm_config(settings, [("smol", "http://127.0.0.1:8001"), ("smol", "http://127.0.0.1:8002")])
    path = write_config(config, str(tmp_path))
    loaded = yaml.safe_load(open(path))
    assert loaded == config
    assert loaded["general_settings"]["master_key"] == "sk-test"
    router = litellm.Router(model_list=loaded["model_list"], **loaded["router_settings"])
    assert router.num_retries == 2 and router.cooldown_time == 3
    ids = {d["model_info"]["id"] for d in router.get_model_list(model_name="smol")}
    assert ids == {"smol@http://127.0.0.1:8001", "smol@http://127.0.0.1:8002"}
    # LiteLLM keeps our model_info key: the strategy reads the worker URL from it.
    assert {d["model_info"][WORKER_URL_KEY] for d in router.model_list} == {"http://127.0.0.1:8001",
                                                                            "http://127.0.0.1:8002"}
