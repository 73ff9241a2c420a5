"""The compile workers' two-layer twin: a hybrid keeps one layer of each mixer, not its whole layer list."""

from engine_models import tiny_qwen3_5
from pagefleet.worker.models.loader import load_model_config


def test_hybrid_twin_keeps_one_layer_of_each_mixer(tmp_path):
    config = load_model_config(tiny_qwen3_5(tmp_path))
    assert config.num_hidden_layers == len(config.layer_types) > 2
    twin = config.twin(2)
    assert (twin.num_hidden_layers, twin.layer_types) == (2, ["linear_attention", "full_attention"])
    assert config.num_hidden_layers > 2  # the model's own config is left as it was


def test_twin_of_one_mixer_cuts_to_the_asked_layers(tmp_path):
    config = load_model_config(tiny_qwen3_5(tmp_path))
    full = config.__class__(**{**config.__dict__, "layer_types": ["full_attention"] * config.num_hidden_layers})
    assert (full.twin(2).num_hidden_layers, full.twin(2).layer_types) == (2, ["full_attention"] * 2)
    plain = config.__class__(**{**config.__dict__, "layer_types": None})
    assert (plain.twin(2).num_hidden_layers, plain.twin(2).layer_types) == (2, None)
