"""The prefix index (gateway/prefix.py) and the prompt keys (gateway/prefix_keys.py): pure, no servers."""

import random

import pytest

from pagefleet.gateway.config import deployment
from pagefleet.gateway.prefix import PrefixAffinity, PrefixIndex, chain_hashes, text_blocks, token_blocks
from pagefleet.gateway.prefix_keys import CHARS_PER_TOKEN, TextKeys, TokenKeys, canonical_text, prompt_of
from pagefleet.gateway.probe import Prober
from pagefleet.gateway.routing import RoutingPolicy, WorkerLoad
from pagefleet.gateway.strategy import QueueDepthStrategy, cache_salt_of, is_chat


def turn(n: int) -> list[dict]:
    """A conversation after n user turns, each turn re-sending the history."""
    out = [{"role": "system", "content": "You answer questions about the history of trains. " * 4}]
    for i in range(n):
        out.append({"role": "user", "content": f"Question {i}: when did line {i} open, and who built it? " * 3})
        if i < n - 1:
            out.append({"role": "assistant", "content": f"Line {i} opened in {1850 + i}, built by company {i}. " * 3})
    return out


def test_chains_share_exactly_the_common_prefix():
    a = chain_hashes("m", [b"x", b"y", b"z"])
    b = chain_hashes("m", [b"x", b"y", b"w", b"z"])
    assert a[:2] == b[:2] and a[2] != b[2] and a[2] not in b
    assert chain_hashes("adapter", [b"x"])[0] != a[0]  # an adapter's K/V differ from the base model's


def test_only_full_blocks_are_hashed():
    assert len(token_blocks(list(range(47)), 16)) == 2 and len(token_blocks(list(range(48)), 16)) == 3
    assert token_blocks(list(range(32)), 16)[1] == token_blocks(list(range(16, 40)), 16)[0]
    assert text_blocks("abcdefg", 3) == [b"abc", b"def"]


def test_hit_is_the_leading_run_found():
    index = PrefixIndex()
    chain = chain_hashes("m", [b"a", b"b", b"c", b"d"])
    index.record("w", chain[:3], capacity=100)
    assert index.hit_blocks("w", chain) == 3
    assert index.hit_blocks("w", chain_hashes("m", [b"a", b"x"])) == 1
    assert index.hit_blocks("other", chain) == 0


def test_lru_is_bounded_by_the_workers_kv_blocks_and_keeps_chain_roots_longest():
    index = PrefixIndex()
    old = chain_hashes("m", [b"o1", b"o2", b"o3"])
    new = chain_hashes("m", [b"n1", b"n2", b"n3"])
    index.record("w", old, capacity=4)
    index.record("w", new, capacity=4)
    assert len(index.blocks["w"]) == 4
    # The old chain lost its tail first: its root is still a hit, its deeper blocks are not.
    assert index.hit_blocks("w", old) == 1 and index.hit_blocks("w", new) == 3
    index.record("w", old[:1], capacity=4)  # touched again: now the most recent
    index.record("w", chain_hashes("m", [b"z"]), capacity=4)
    assert index.hit_blocks("w", old) == 1 and index.hit_blocks("w", new) == 2


def test_forget_and_retain_drop_workers():
    index = PrefixIndex()
    chain = chain_hashes("m", [b"a"])
    for url in ("a", "b", "c"):
        index.record(url, chain, capacity=10)
    index.forget("a")
    index.retain(["b"])
    assert set(index.blocks) == {"b"}


def test_text_keys_keep_a_conversation_prefix_across_turns():
    keys = TextKeys()
    two, three = keys.blocks(turn(2), True, 16), keys.blocks(turn(3), True, 16)
    assert len(two[0]) == 16 * CHARS_PER_TOKEN and len(three) > len(two)
    assert three[:len(two)] == two  # turn 3 re-sends turn 2 whole
    assert keys.blocks(turn(2), True, 32)[0] == two[0] + two[1]


def test_prompt_of_reads_chat_parts_batches_and_token_ids():
    parts = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}]
    assert prompt_of(parts, chat=True) == [{"role": "user", "content": "abcd"}]
    assert prompt_of([{"role": "user", "content": ["first", "second"]}], chat=False) == "first"
    assert prompt_of([{"role": "user", "content": [5, 6, 7]}], chat=False) == [5, 6, 7]
    assert prompt_of(None, chat=True) == [] and canonical_text([]) == ""


def test_the_proxy_url_says_chat_or_text_completion():
    assert is_chat({"proxy_server_request": {"url": "http://gw/v1/chat/completions"}})
    assert not is_chat({"proxy_server_request": {"url": "http://gw/v1/completions"}})
    assert is_chat({}) and is_chat(None)


def test_token_keys_cut_prompts_where_the_worker_does(smollm2_path):
    from transformers import AutoTokenizer

    keys = TokenKeys(smollm2_path)
    reference = AutoTokenizer.from_pretrained(smollm2_path)
    for messages in (turn(1), turn(3), turn(1)[1:]):  # the last one: the template's own system prompt
        text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert keys.encode(messages) == reference.encode(text, add_special_tokens=False)
    assert keys.encode("The capital of France is") == reference.encode("The capital of France is")
    assert keys.blocks([{"role": "user", "content": list(range(40))}], False, 16) == token_blocks(list(range(40)), 16)


def test_token_keys_need_a_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        TokenKeys(tmp_path)


def workers(**loads) -> list[WorkerLoad]:
    return [WorkerLoad(url=url, up=True, max_num_seqs=4, block_size=16, num_blocks=1000, **kw)
            for url, kw in loads.items()]


def test_a_conversation_finds_the_worker_it_went_to():
    affinity = PrefixAffinity(TextKeys())
    loads = workers(a={}, b={})
    first = affinity.lookup(loads, "m", turn(1), True)
    assert first.hits == {"a": 0.0, "b": 0.0}
    affinity.record("b", first)
    second = affinity.lookup(loads, "m", turn(2), True)
    assert second.hits["a"] == 0.0 and 0.0 < second.hits["b"] < 1.0
    assert affinity.record("b", second) == (round(second.hits["b"] * len(second.chains["b"])), len(second.chains["b"]))
    assert affinity.lookup(loads, "m", turn(2), True).hits["b"] == 1.0
    assert affinity.lookup(loads, "adapter", turn(2), True).hits["b"] == 0.0


def test_a_salted_conversation_meets_only_its_own_salt():
    """vLLM's cache_salt: the workers share prefix-cache entries only between requests with the same salt, so the
    index keys a salted chain by its salt too."""
    affinity = PrefixAffinity(TextKeys())
    loads = workers(a={}, b={})
    affinity.record("a", affinity.lookup(loads, "m", turn(2), True, "tenant-1"))
    assert affinity.lookup(loads, "m", turn(2), True, "tenant-1").hits["a"] == 1.0
    assert affinity.lookup(loads, "m", turn(2), True, "tenant-2").hits["a"] == 0.0
    assert affinity.lookup(loads, "m", turn(2), True).hits["a"] == 0.0
    assert cache_salt_of({"proxy_server_request": {"body": {"cache_salt": "tenant-1"}}}) == "tenant-1"
    assert cache_salt_of({"proxy_server_request": {"body": {"cache_salt": ""}}}) is None
    assert cache_salt_of({}) is None and cache_salt_of(None) is None


def test_a_worker_that_failed_its_probe_is_assumed_empty():
    affinity = PrefixAffinity(TextKeys())
    loads = workers(a={})
    affinity.record("a", affinity.lookup(loads, "m", turn(2), True))
    loads[0].up = False  # restarted, perhaps: its cache is gone
    affinity.lookup(loads, "m", turn(2), True)
    loads[0].up = True
    assert affinity.lookup(loads, "m", turn(2), True).hits["a"] == 0.0


def test_workers_of_another_block_size_get_their_own_chain():
    affinity = PrefixAffinity(TextKeys())
    loads = workers(a={}) + [WorkerLoad(url="b", up=True, block_size=32, num_blocks=1000)]
    lookup = affinity.lookup(loads, "m", turn(3), True)
    assert len(lookup.chains["a"]) in (2 * len(lookup.chains["b"]), 2 * len(lookup.chains["b"]) + 1)


def test_the_text_index_remembers_what_a_worker_caches_of_long_tokened_text():
    """Four prompts of 12 blocks at 6 characters a token fill 48 of a worker's 64 blocks; in 64-character
    chunks they are 72 chunks, so a bound of 64 chunks would forget the first while the worker holds it."""
    affinity = PrefixAffinity(TextKeys())
    loads = [WorkerLoad(url="a", up=True, max_num_seqs=4, block_size=16, num_blocks=64)]
    prompts = [[{"role": "system", "content": f"{i} {'tenant instructions ' * 60}"[:12 * 16 * 6]}] for i in range(8)]
    for prompt in prompts[:4]:
        affinity.record("a", affinity.lookup(loads, "m", prompt, True))
    assert affinity.lookup(loads, "m", prompts[0], True).hits["a"] == 1.0
    assert TextKeys().capacity(64) == 128 and TokenKeys.capacity(None, 64) == 64
    for prompt in prompts[4:]:  # 144 chunks: past even the generous bound, the oldest go
        affinity.record("a", affinity.lookup(loads, "m", prompt, True))
    assert affinity.lookup(loads, "m", prompts[0], True).hits["a"] < 1.0
    assert len(affinity.index.blocks["a"]) == 128


def strategy_over(urls: list[str], seed: int = 0) -> tuple[QueueDepthStrategy, list[dict]]:
    prober = Prober(interval_s=10)
    for url in urls:
        prober.add(url)
        load = prober.loads[url]
        load.up, load.max_num_seqs, load.block_size, load.num_blocks = True, 4, 16, 1000
    strategy = QueueDepthStrategy(None, prober, RoutingPolicy(), random.Random(seed), PrefixAffinity(TextKeys()))
    return strategy, [deployment("m", url) for url in urls]


def test_strategy_keeps_each_conversation_on_one_worker_and_counts_expected_hits():
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    strategy, deployments = strategy_over(urls)
    homes = {}
    for n in range(1, 5):
        for conversation in range(4):
            messages = [{"role": "system", "content": f"conversation {conversation} " * 20}] + turn(n)[1:]
            url = strategy.pick(deployments, "m", messages)["model_info"]["pagefleet_worker_url"]
            assert homes.setdefault(conversation, url) == url
        for url in urls:  # every turn answered before the next round
            strategy.prober.loads[url].unreflected = 0
    assert sorted(homes.values()) == sorted(urls * 2)  # first turns spread by load, two conversations each
    registry = strategy.prober.metrics.registry
    expected = sum(registry.get_sample_value("pagefleet_gateway_prefix_expected_hit_blocks_total", {"worker": u})
                   for u in urls)
    queried = sum(registry.get_sample_value("pagefleet_gateway_prefix_query_blocks_total", {"worker": u})
                  for u in urls)
    assert 0.5 < expected / queried < 1.0


def test_strategy_forgets_a_worker_that_left():
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    strategy, deployments = strategy_over(urls)
    home = strategy.pick(deployments, "m", turn(2))["model_info"]["pagefleet_worker_url"]
    strategy.prober.remove(home)
    rest = [d for d in deployments if d["model_info"]["pagefleet_worker_url"] != home]
    assert strategy.pick(rest, "m", turn(2))["model_info"]["pagefleet_worker_url"] != home
    assert home not in strategy.prefix.index.blocks


def parse(*argv):
    import argparse

    from pagefleet.gateway import app as gateway_app

    parser = argparse.ArgumentParser()
    gateway_app.add_arguments(parser)
    return gateway_app, parser.parse_args(["--master-key", "sk-x", "--kubernetes", *argv])


def test_prefix_aware_is_the_default_with_its_weights_as_flags(tmp_path):
    gateway_app, args = parse()
    _, policy, _ = gateway_app._validate(args)
    assert args.routing == "prefix-aware" and (policy.prefix_weight, policy.load_factor) == (2.0, 1.25)
    assert isinstance(gateway_app._prefix_affinity(args).keys, TextKeys)
    _, args = parse("--prefix-weight", "3", "--load-factor", "1.5", "--queue-weight", "0.5", "--kv-weight", "0")
    _, policy, _ = gateway_app._validate(args)
    assert (policy.prefix_weight, policy.load_factor, policy.queue_weight, policy.kv_weight) == (3.0, 1.5, 0.5, 0)
    _, args = parse("--routing", "queue-depth")
    assert gateway_app._prefix_affinity(args) is None
    for argv, message in ((("--load-factor", "0.5"), "load_factor"), (("--prefix-tokenizer", str(tmp_path)),
                                                                       "tokenizer.json")):
        with pytest.raises(SystemExit, match=message):
            gateway_app._validate(parse(*argv)[1])


async def test_the_probe_reads_the_block_size_and_kv_capacity():
    import httpx

    body = {"waiting": 0, "running": 1, "kv_cache_usage": 0.1, "max_num_seqs": 4, "block_size": 32, "num_blocks": 512}
    prober = Prober(interval_s=10)
    prober._client = httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(200, json=body)))
    prober.add("http://w:1")
    await prober.probe_once("http://w:1")
    assert (prober.loads["http://w:1"].block_size, prober.loads["http://w:1"].num_blocks) == (32, 512)
    await prober._client.aclose()
