"""The scheduler, driven by a fake worker that follows SchedulerOutput exactly as a real one does."""

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.wire.protocol import FinishReason
from engine.wire.sampling_params import SamplingParams
from engine.wire.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs

VOCAB, EOS = 40, 0


def sample(kv_values):
    """The fake model's next token: a function of every KV entry the request attends to."""
    return hash(tuple(kv_values)) % VOCAB


def kv_entry(previous, token):
    """A position's fake KV stands for its whole prefix, as a real layer stack's does."""
    return hash((previous, token))


@dataclass
class WorkerState:
    token_ids: list
    block_ids: list
    num_prompt_tokens: int
    num_computed_tokens: int


class FakeWorker:
    """Holds only what NewRequest/CachedRequest told it, writes a paged KV cache and samples
    from what it reads back, so a wrong block table, a bad prefix hit or an overwritten shared
    block changes the output, and reading a never-written slot fails outright."""

    def __init__(self, num_blocks, block_size, choose=None):
        self.block_size = block_size
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.state = {}
        self.choose = choose  # (req_id, WorkerState) -> token, to script outputs

    def slot(self, state, position):
        block, offset = divmod(position, self.block_size)
        return self.kv[state.block_ids[block]], offset

    def execute(self, out):
        for req_id in out.finished_req_ids:
            self.state.pop(req_id, None)
        for new in out.new_requests:
            self.state[new.req_id] = WorkerState(list(new.token_ids), list(new.block_ids),
                                                 new.num_prompt_tokens, new.num_computed_tokens)
        for cached in out.cached_requests:
            state = self.state[cached.req_id]
            assert cached.num_computed_tokens == state.num_computed_tokens
            state.token_ids += cached.new_token_ids
            state.block_ids += cached.new_block_ids
        req_ids, sampled, logprobs = [], [], []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.state[req_id]
            end = state.num_computed_tokens + num_tokens
            assert 0 < end <= len(state.token_ids) and end <= len(state.block_ids) * self.block_size
            for p in range(state.num_computed_tokens, end):
                block, offset = self.slot(state, p - 1) if p else ([0], 0)
                assert block[offset] is not None, f"{req_id} reads position {p - 1}, never written"
                here, at = self.slot(state, p)
                here[at] = kv_entry(block[offset], state.token_ids[p])
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                req_ids.append(req_id)
                token = (self.choose(req_id, state) if self.choose else
                         sample(b[o] for b, o in (self.slot(state, p) for p in range(end))))
                sampled.append(token)
                logprobs.append(TokenLogprobs(-0.5, [token], [-0.5]))
        return ModelRunnerOutput(out.step_id, req_ids, sampled, logprobs)


def reference_output(prompt, sampling, max_model_len):
    """What the fake model generates for one request alone, with no scheduler or cache."""
    tokens, kv = list(prompt), []
    for token in tokens:
        kv.append(kv_entry(kv[-1] if kv else 0, token))
    while True:
        token = sample(kv)
        tokens.append(token)
        n = len(tokens) - len(prompt)
        if n >= sampling.min_tokens and (token in sampling.stop_token_ids
                                         or (token == EOS and not sampling.ignore_eos)):
            return tokens[len(prompt):], "stop"
        if n >= sampling.max_tokens or len(tokens) >= max_model_len:
            return tokens[len(prompt):], "length"
        kv.append(kv_entry(kv[-1], token))


def check_consistent(sched, out=None):
    """Block accounting and batch limits hold: the invariants every test relies on."""
    bm, cfg = sched.block_manager, sched.config
    held = Counter(b for table in bm.block_tables.values() for b in table)
    for block in bm.blocks:
        assert block.ref_count == held[block.block_id]
        assert (block.block_id in bm.free_block_ids) == (block.ref_count == 0)
        assert held[block.block_id] <= 1 or block.block_hash is not None  # only cached blocks are shared
        if block.block_hash is not None:
            assert bm.hash_to_block_id[block.block_hash] == block.block_id
    assert len(bm.hash_to_block_id) == sum(b.block_hash is not None for b in bm.blocks)
    assert set(bm.block_tables) == {r.req_id for r in sched.running}
    assert all(r.status is RequestStatus.RUNNING for r in sched.running)
    assert all(r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 for r in sched.waiting)
    assert len(sched.running) <= cfg.max_num_seqs
    for r in sched.running:
        assert len(bm.block_table(r.req_id)) >= math.ceil(r.num_computed_tokens / cfg.block_size)
    if out is not None:
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        # the blocks a step writes belong to one request and are not in the prefix cache
        for req in out.new_requests + out.cached_requests:
            for block_id in bm.block_table(req.req_id)[req.num_computed_tokens // cfg.block_size:]:
                assert bm.blocks[block_id].ref_count == 1 and bm.blocks[block_id].block_hash is None


def run(sched, arrivals, crash_steps=(), choose=None, max_steps=3000):
    """Drive a scheduler to the end; `arrivals` maps a step to the requests added then."""
    worker = FakeWorker(sched.block_manager.num_blocks, sched.config.block_size, choose)
    outputs, reasons = defaultdict(list), {}

    def record(updates):
        for u in updates:
            outputs[u.req_id] += u.new_token_ids
            if u.finish_reason is not None:
                assert u.req_id not in reasons
                reasons[u.req_id] = u.finish_reason

    step, last_arrival = 0, max(arrivals, default=0)
    while step <= last_arrival or sched.has_unfinished_requests():
        for request in arrivals.get(step, []):
            record([u for u in [sched.add(request)] if u])
        out = sched.schedule()
        check_consistent(sched, out)
        if step in crash_steps:  # the worker group died during the step: its KV is gone
            record(sched.preempt_all())
            worker = FakeWorker(sched.block_manager.num_blocks, sched.config.block_size, choose)
        else:
            record(sched.update_from_output(out, worker.execute(out)))
        check_consistent(sched)
        step += 1
        assert step < max_steps, "no progress"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return dict(outputs), reasons


def make(num_blocks=64, block_size=4, **kw):
    kw.setdefault("eos_token_id", EOS)
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, **kw))


def greedy(**kw):
    return SamplingParams(temperature=0, **kw)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(6, 40))
    prefixes = [draw(st.lists(st.integers(1, VOCAB - 1), min_size=2, max_size=12)) for _ in range(2)]
    specs = []
    for i in range(draw(st.integers(2, 8))):
        suffix = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=8))
        prompt = (draw(st.sampled_from(prefixes)) + suffix)[-max_model_len:]
        max_tokens = draw(st.integers(1, 12))
        sampling = greedy(max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
                          ignore_eos=draw(st.booleans()),
                          stop_token_ids=tuple(draw(st.lists(st.integers(1, VOCAB - 1), max_size=2))))
        specs.append((f"r{i}", prompt, sampling, draw(st.integers(0, 4))))
    need = max(math.ceil(max(len(p), min(max_model_len, len(p) + s.max_tokens) - 1) / block_size)
               for _, p, s, _ in specs)
    return block_size, max_model_len, specs, need


def arrivals_of(specs):
    arrivals = defaultdict(list)
    for req_id, prompt, sampling, step in specs:
        arrivals[step].append(Request(req_id, prompt, sampling))
    return arrivals


@settings(max_examples=150, deadline=None)
@given(workloads(), st.integers(0, 2), st.integers(1, 16), st.integers(2, 8),
       st.sets(st.integers(0, 40), max_size=3), st.sampled_from([True, True, False]))
def test_outputs_do_not_depend_on_blocks_batching_or_crashes(workload, extra, budget, max_seqs,
                                                              crashes, prefix_caching):
    block_size, max_model_len, specs, need = workload
    expected = {rid: reference_output(p, s, max_model_len) for rid, p, s, _ in specs}
    tiny = make(need + extra, block_size, max_model_len=max_model_len, max_num_batched_tokens=budget,
                max_num_seqs=max_seqs, enable_prefix_caching=prefix_caching)
    outputs, reasons = run(tiny, arrivals_of(specs), crash_steps=crashes)
    assert {rid: (outputs.get(rid, []), reasons[rid]) for rid in expected} == expected
    event("preempted" if tiny.stats().num_preemptions else "not preempted")
    event("prefix hit" if tiny.stats().prefix_cache_hit_tokens else "no prefix hit")
    ample = make(1000, block_size, max_model_len=max_model_len, max_num_batched_tokens=512)
    outputs, reasons = run(ample, arrivals_of(specs))
    assert {rid: (outputs.get(rid, []), reasons[rid]) for rid in expected} == expected
    assert ample.stats().num_preemptions == 0


def test_too_few_blocks_preempt_and_still_match():
    specs = [(f"r{i}", [i + 1] * 5, greedy(max_tokens=12, ignore_eos=True), 0) for i in range(4)]
    sched = make(num_blocks=5, block_size=4, max_model_len=32)
    outputs, reasons = run(sched, arrivals_of(specs))
    assert sched.stats().num_preemptions > 0
    for rid, prompt, sampling, _ in specs:
        assert (outputs[rid], reasons[rid]) == reference_output(prompt, sampling, 32)


class Accounting(RuleBasedStateMachine):
    """Any mix of add, step, abort and worker crash keeps every block accounted for."""

    def __init__(self):
        super().__init__()
        self.sched = make(num_blocks=12, block_size=2, max_model_len=16, max_num_batched_tokens=6,
                          max_num_seqs=4)
        self.worker = FakeWorker(12, 2)
        self.num_added = 0

    @rule(prefix=st.sampled_from([[], [5, 6, 7, 8], [5, 6, 9]]),
          suffix=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6),
          max_tokens=st.integers(1, 8))
    def add(self, prefix, suffix, max_tokens):
        self.num_added += 1
        self.sched.add(Request(f"r{self.num_added}", prefix + suffix, greedy(max_tokens=max_tokens)))

    @rule()
    def step(self):
        out = self.sched.schedule()
        check_consistent(self.sched, out)
        self.sched.update_from_output(out, self.worker.execute(out))

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        self.sched.abort([data.draw(st.sampled_from(sorted(self.sched.requests)))])

    @rule(num_blocks=st.integers(4, 16))
    def crash(self, num_blocks):
        self.sched.schedule()
        self.sched.preempt_all(num_blocks)
        self.worker = FakeWorker(num_blocks, 2)

    @invariant()
    def consistent(self):
        check_consistent(self.sched)

    def teardown(self):
        for _ in range(500):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests()
        assert self.sched.block_manager.num_free_blocks == self.sched.block_manager.num_blocks


Accounting.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestAccounting = Accounting.TestCase


def step(sched, worker):
    out = sched.schedule()
    return out, sched.update_from_output(out, worker.execute(out))


def scripted(script):
    """A worker choice that emits script[req_id][i] as the request's i-th output."""
    return lambda req_id, state: script[req_id][len(state.token_ids) - state.num_prompt_tokens]


def test_same_prefix_shares_blocks_and_starts_past_it():
    sched = make(block_size=4)
    worker = FakeWorker(64, 4)
    prefix = list(range(1, 13))  # three full blocks
    sched.add(Request("a", prefix + [20, 21], greedy(max_tokens=5)))
    step(sched, worker)
    sched.add(Request("b", prefix + [30], greedy(max_tokens=5)))
    out, _ = step(sched, worker)
    (new_b,) = out.new_requests
    assert new_b.num_computed_tokens == 12 and out.num_scheduled_tokens["b"] == 1
    table_a = sched.block_manager.block_table("a")
    assert new_b.block_ids[:3] == table_a[:3] and new_b.block_ids[3] != table_a[3]
    assert sched.stats().prefix_cache_hit_tokens == 12


def test_chunked_prefill_mixes_with_decodes_within_the_budget():
    sched = make(max_num_batched_tokens=8)
    worker = FakeWorker(64, 4)
    sched.add(Request("a", [1, 2, 3], greedy(max_tokens=10, ignore_eos=True)))
    step(sched, worker)
    sched.add(Request("b", list(range(1, 21)), greedy(max_tokens=10, ignore_eos=True)))
    chunks = []
    for _ in range(3):
        out, updates = step(sched, worker)
        assert out.num_scheduled_tokens["a"] == 1 and out.total_num_scheduled_tokens <= 8
        chunks.append(out.num_scheduled_tokens["b"])
        assert {u.req_id for u in updates} == ({"a", "b"} if sum(chunks) == 20 else {"a"})
    assert chunks == [7, 7, 6]
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # both decode now


def test_max_num_seqs_caps_the_running_batch():
    sched = make(max_num_seqs=2)
    worker = FakeWorker(64, 4)
    for i in range(5):
        sched.add(Request(f"r{i}", [i + 1] * 3, greedy(max_tokens=2 + i, ignore_eos=True)))
    out, _ = step(sched, worker)
    assert [n.req_id for n in out.new_requests] == ["r0", "r1"]
    assert sched.stats().num_running == 2 and sched.stats().num_waiting == 3
    out, updates = step(sched, worker)
    assert [u.finish_reason for u in updates] == ["length", None]
    out, _ = step(sched, worker)
    assert [n.req_id for n in out.new_requests] == ["r2"] and out.finished_req_ids == ["r0"]


@pytest.mark.parametrize("sampling,script,expected", [
    (greedy(max_tokens=9), [5, EOS, 6], ([5, EOS], "stop")),
    (greedy(max_tokens=3, ignore_eos=True), [EOS, EOS, EOS, EOS], ([EOS] * 3, "length")),
    (greedy(max_tokens=9, min_tokens=3), [EOS, EOS, 5, EOS], ([EOS, EOS, 5, EOS], "stop")),
    (greedy(max_tokens=9, stop_token_ids=(7,)), [1, 7, 2], ([1, 7], "stop")),
    (greedy(max_tokens=9, min_tokens=2, stop_token_ids=(7,)), [7, 7], ([7, 7], "stop")),
    (greedy(max_tokens=2), [1, 2, 3], ([1, 2], "length")),
    (greedy(max_tokens=2), [1, EOS], ([1, EOS], "stop")),  # the model did stop
    (greedy(max_tokens=None), [1] * 20, ([1] * 6, "length")),  # max_model_len 10, prompt 4
])
def test_stop_reasons(sampling, script, expected):
    sched = make(max_model_len=10)
    assert run(sched, {0: [Request("r", [1, 2, 3, 4], sampling)]}, choose=scripted({"r": script})) == (
        {"r": expected[0]}, {"r": expected[1]})


def test_a_prompt_of_max_model_len_gets_one_token_and_several_eos_ids_work():
    sched = make(max_model_len=4, eos_token_id=[EOS, 9])
    outputs, reasons = run(sched, {0: [Request("full", [1, 2, 3, 4], greedy()),
                                       Request("nine", [1], greedy())]},
                           choose=scripted({"full": [5, 5], "nine": [3, 9]}))
    assert outputs == {"full": [5], "nine": [3, 9]} and reasons == {"full": "length", "nine": "stop"}


@pytest.mark.parametrize("prompt_len,max_tokens,match", [
    (11, 1, "more than max_model_len 10"),
    (6, 10, r"KV cache for 9 tokens \(3 blocks of 4\) but the cache holds only 2 blocks"),
])
def test_a_request_that_can_never_run_fails_at_once(prompt_len, max_tokens, match):
    sched = make(num_blocks=2, max_model_len=10)
    update = sched.add(Request("r", [1] * prompt_len, greedy(max_tokens=max_tokens)))
    assert update.finish_reason == FinishReason.ERROR and re.search(match, update.error)
    assert not sched.has_unfinished_requests() and sched.schedule().num_scheduled_tokens == {}


def test_a_request_that_just_fits_the_whole_cache_runs():
    outputs, reasons = run(make(num_blocks=2, max_model_len=10),
                           {0: [Request("r", [1] * 6, greedy(max_tokens=3, ignore_eos=True))]})
    assert len(outputs["r"]) == 3 and reasons == {"r": "length"}


def test_abort_frees_blocks_and_tells_the_workers():
    sched = make(num_blocks=8, max_num_seqs=1)
    worker = FakeWorker(8, 4)
    sched.add(Request("run", [1] * 9, greedy(max_tokens=9)))
    sched.add(Request("wait", [2] * 3, greedy(max_tokens=9)))
    out = sched.schedule()
    updates = sched.abort(["run", "wait", "unknown"])
    assert [(u.req_id, u.finish_reason) for u in updates] == [("run", "abort"), ("wait", "abort")]
    assert sched.update_from_output(out, worker.execute(out)) == []  # aborted while the step ran
    assert sched.stats().kv_cache_usage == 0 and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == ["run", "wait"]
    check_consistent(sched)


def test_the_newest_request_is_preempted_and_resent_with_its_outputs():
    sched = make(num_blocks=3, block_size=2, max_model_len=20)
    worker = FakeWorker(3, 2)
    for rid in ("old", "new"):
        sched.add(Request(rid, [1, 2], greedy(max_tokens=5, ignore_eos=True)))
    step(sched, worker)  # both prefill: one block each, one token out each
    out, _ = step(sched, worker)  # both need a second block; only one is free
    assert list(out.num_scheduled_tokens) == ["old"]
    assert [r.req_id for r in sched.waiting] == ["new"] and sched.stats().num_preemptions == 1
    (waiting,) = sched.waiting
    assert waiting.num_computed_tokens == 0 and waiting.num_output_tokens == 1
    assert sched.block_manager.block_table("new") == []
    while "new" in [r.req_id for r in sched.waiting]:
        out, _ = step(sched, worker)
    (resent,) = out.new_requests
    assert resent.token_ids == [1, 2, waiting.output_token_ids[0]]  # prompt plus its output
    assert resent.num_prompt_tokens == 2
    assert resent.num_computed_tokens == 2  # its first block is old's, cached: only its output recomputes


def test_a_step_counts_as_a_kv_stall_when_a_request_waits_for_blocks_or_one_is_preempted():
    sched = make(num_blocks=4, block_size=2, max_model_len=20)
    worker = FakeWorker(4, 2)
    sched.add(Request("a", [1, 2, 3, 4], greedy(max_tokens=5, ignore_eos=True)))
    step(sched, worker)  # "a" holds 2 of the 4 blocks
    assert sched.num_kv_stalls == 0
    sched.add(Request("b", [5, 6, 7, 8, 9], greedy(max_tokens=1, ignore_eos=True)))
    step(sched, worker)  # "a" grows to 3 blocks; "b" needs 3, 1 is free: it waits for blocks
    assert [r.req_id for r in sched.waiting] == ["b"] and sched.num_kv_stalls == 1
    limited = make(num_blocks=30, block_size=2, max_model_len=20, max_num_seqs=1)
    for rid in ("a", "b"):
        limited.add(Request(rid, [1, 2], greedy(max_tokens=5, ignore_eos=True)))
    step(limited, FakeWorker(30, 2))  # "b" waits for a seat (--max-num-seqs), not for blocks
    assert [r.req_id for r in limited.waiting] == ["b"] and limited.num_kv_stalls == 0
    tight = make(num_blocks=3, block_size=2, max_model_len=20)
    tight_worker = FakeWorker(3, 2)
    for rid in ("old", "new"):
        tight.add(Request(rid, [1, 2], greedy(max_tokens=5, ignore_eos=True)))
    step(tight, tight_worker)
    step(tight, tight_worker)  # a preemption
    assert tight.stats().num_preemptions == 1 and tight.num_kv_stalls == 1


def test_preempt_all_requeues_everything_and_ignores_the_lost_step():
    sched = make(num_blocks=16, max_num_seqs=2)
    worker = FakeWorker(16, 4)
    for rid in ("a", "b", "c"):
        sched.add(Request(rid, [1, 2, 3, 4, 5], greedy(max_tokens=8, ignore_eos=True)))
    step(sched, worker)
    lost = sched.schedule()
    lost_output = worker.execute(lost)
    assert sched.preempt_all() == []
    assert [r.req_id for r in sched.waiting] == ["a", "b", "c"] and sched.stats().kv_cache_usage == 0
    assert sched.update_from_output(lost, lost_output) == []
    out = sched.schedule()
    assert [(n.req_id, len(n.token_ids), n.num_computed_tokens) for n in out.new_requests] == [
        ("a", 6, 0), ("b", 6, 0)]
    check_consistent(sched)


def test_preempt_all_into_a_smaller_cache_fails_what_no_longer_fits():
    sched = make(num_blocks=16, max_model_len=64)
    sched.add(Request("big", [1] * 20, greedy(max_tokens=4)))
    sched.add(Request("small", [1] * 2, greedy(max_tokens=4)))
    sched.schedule()
    updates = sched.preempt_all(num_blocks=3)
    assert [(u.req_id, u.finish_reason) for u in updates] == [("big", "error")]
    assert [r.req_id for r in sched.waiting] == ["small"] and sched.block_manager.num_blocks == 3


def test_logprobs_pass_through_and_the_step_survives_msgpack():
    sched = make()
    worker = FakeWorker(64, 4)
    sched.add(Request("r", [1, 2, 3], greedy(max_tokens=2, logprobs=1)))
    out = sched.schedule()
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput)
    assert wire == out
    (update,) = sched.update_from_output(out, worker.execute(wire))
    assert update.logprobs[0].logprob == -0.5 and update.logprobs[0].top_ids == update.new_token_ids


def test_user_errors_raise_clear_exceptions():
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        SchedulerConfig(num_blocks=4, max_num_seqs=0)
    with pytest.raises(ValueError, match="empty prompt"):
        Request("r", [])
    sched = make()
    sched.add(Request("r", [1]))
    with pytest.raises(ValueError, match="already in flight"):
        sched.add(Request("r", [2]))
