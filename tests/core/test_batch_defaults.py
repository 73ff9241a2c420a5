"""EngineConfig's batch defaults: vLLM's choice per GPU class (EngineArgs.get_batch_defaults), set once at start."""

from pagefleet.worker.core.config import EngineConfig


def test_hopper_takes_vllms_defaults_offline_and_serving():
    assert EngineConfig().with_batch_defaults(hopper=True).max_num_seqs == 1024
    assert EngineConfig().with_batch_defaults(hopper=True).max_num_batched_tokens == 16384
    assert EngineConfig(serving=True).with_batch_defaults(hopper=True).max_num_batched_tokens == 8192


def test_other_devices_keep_256_and_2048_and_explicit_values_stay():
    cpu = EngineConfig().with_batch_defaults(hopper=False)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (256, 2048)
    mine = EngineConfig(max_num_seqs=12, max_num_batched_tokens=96).with_batch_defaults(hopper=True)
    assert (mine.max_num_seqs, mine.max_num_batched_tokens) == (12, 96)
    assert EngineConfig().validate().max_num_seqs is None  # auto until the engine starts
