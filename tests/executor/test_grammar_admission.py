"""A request whose grammar is still compiling waits in the queue, keeping its place, without holding the batch."""

from pagefleet.worker.core.block_manager import BlockManager
from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.core.scheduler import Scheduler
from pagefleet.worker.core.sequence import Sequence


class Compiling:
    """A grammar state whose compile finishes when the test says."""

    def __init__(self):
        self.ready = False
        self.error = None

    def fork(self):
        return self


def seq(rid: str, grammar=None) -> Sequence:
    s = Sequence(rid, 0, [1, 2, 3, 4], 4, SamplingParams(), None)
    s.grammar = grammar
    return s


def test_compiling_request_waits_aside_and_keeps_its_place():
    sched = Scheduler(BlockManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=64)
    grammar = Compiling()
    a, b, c = seq("a", grammar), seq("b"), seq("c")
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["b", "c"]  # the ones behind it run
    assert list(sched.waiting) == [a]
    for s in (b, c):
        sched.finish(s)
    assert sched.schedule().seqs == []  # still compiling: nothing to run, nothing blocked
    grammar.ready = True
    d = seq("d")
    sched.add(d)
    batch = sched.schedule()
    assert batch.seqs == [a, d] and not sched.waiting  # ready now: first in line again

def test_a_failed_compile_leaves_the_queue_for_the_engine_to_end():
    sched = Scheduler(BlockManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=64)
    grammar = Compiling()
    grammar.ready, grammar.error = True, "out of memory"
    a, b = seq("a", grammar), seq("b")
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.failed == [a] and batch.seqs == [b] and not sched.waiting
    assert not a.block_table  # it never took a block


def test_fork_gives_each_sample_its_own_grammar_state():
    class State:
        def fork(self):
            return State()

    parent = seq("p", State())
    child = parent.fork(1, None)
    assert child.grammar is not None and child.grammar is not parent.grammar
    assert seq("q").fork(1, None).grammar is None
