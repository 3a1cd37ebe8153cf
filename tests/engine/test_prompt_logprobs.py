"""Prompt logprobs (vLLM's prompt_logprobs) through the engine core and a real worker, against
transformers' own log-softmax; and the stop token that ended a request (vLLM's stop_reason)."""

from __future__ import annotations

import pytest
import torch

from engine.core.engine_core import EngineCore
from engine.core.request import Request, stop_token_of
from engine.core.scheduler_config import SchedulerConfig
from engine.executor.executor import InprocExecutor
from engine.sampling.prompt_logprobs import logprobs_of, prompt_logprobs
from engine.wire.protocol import AddRequest
from engine.wire.sampling_params import SamplingParams
from engine.wire.scheduler_output import TokenLogprobs
from engine.worker.worker import WorkerConfig

PROMPT = [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # 19 tokens: 3 chunks of 8
NUM_TOP = 3
TOLERANCE = 1e-4


def test_logprobs_of_is_the_log_softmax_with_ranks_and_top():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([0, 7, 39, 3, 3])
    out = logprobs_of(logits, targets, 4)
    reference = logits.log_softmax(-1)
    for row, entry in enumerate(out):
        assert entry.logprob == pytest.approx(float(reference[row, targets[row]]), abs=1e-6)
        assert entry.rank == int((reference[row] > reference[row, targets[row]]).sum()) + 1
        assert entry.top_ids == reference[row].argsort(descending=True)[:4].tolist()
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
    assert all(e.top_ids == [] and e.top_logprobs == [] for e in logprobs_of(logits, targets, 0))


def test_prompt_logprobs_slices_long_prompts_and_skips_non_driver_ranks(monkeypatch):
    import engine.sampling.prompt_logprobs as module
    monkeypatch.setattr(module, "ROWS_PER_SLICE", 2)
    head = torch.randn(6, 30, generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    sliced = prompt_logprobs(hidden, [1, 2, 3, 4, 5], 2, lambda h: h @ head)
    whole = logprobs_of(hidden @ head, torch.tensor([1, 2, 3, 4, 5]), 2)
    # a GEMM of 2 rows may round otherwise than one of 5 (another kernel, another summation order)
    assert [(e.rank, e.top_ids) for e in sliced] == [(e.rank, e.top_ids) for e in whole]
    for s, w in zip(sliced, whole, strict=True):
        assert [s.logprob, *s.top_logprobs] == pytest.approx([w.logprob, *w.top_logprobs], abs=1e-6)
    assert prompt_logprobs(hidden, [1, 2, 3, 4, 5], 2, lambda h: None) == []


def test_a_recomputed_chunk_adds_only_what_is_missing():
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=0))
    entry = [TokenLogprobs(-float(i), [], []) for i in range(1, 5)]
    request.add_prompt_logprobs(1, entry[:2])
    request.add_prompt_logprobs(1, entry[:3])  # preempted and recomputed from the start
    request.add_prompt_logprobs(4, entry[3:])
    assert request.needs_prompt_logprobs and request.take_prompt_logprobs() == entry
    assert not request.needs_prompt_logprobs and request.take_prompt_logprobs() == []
    assert Request("s", [1], SamplingParams()).take_prompt_logprobs() == []


def test_stop_reason_is_the_stop_token_never_eos():
    def ended_on(token, **params):
        return stop_token_of(Request("r", [5, 6], SamplingParams(**params), output_token_ids=[token]),
                             frozenset({2}))
    assert ended_on(9, stop_token_ids=(9,)) == 9
    assert ended_on(2, stop_token_ids=(2, 9)) is None  # EOS comes first, as in vLLM
    assert ended_on(2, stop_token_ids=(2,), ignore_eos=True) == 2
    assert ended_on(7, stop_token_ids=(9,)) is None


@pytest.fixture(scope="module")
def core(tiny_model):
    executor = InprocExecutor(WorkerConfig(model=str(tiny_model("llama_tied")), kv_cache_bytes=1 << 20, block_size=4))
    core = EngineCore(SchedulerConfig(num_blocks=executor.num_blocks, block_size=4, max_model_len=512,
                                      max_num_batched_tokens=8, enable_prefix_caching=True), executor, vocab_size=256)
    yield core
    core.close()


def run(core, requests: dict[str, SamplingParams]) -> dict[str, list]:
    for req_id, params in requests.items():
        assert core.add_request(AddRequest(req_id, PROMPT, params)) is None
    updates = {r: [] for r in requests}
    while core.has_work():
        for update in core.step():
            updates[update.req_id].append(update)
    return updates


def check_against_transformers(entries: list[TokenLogprobs], reference: torch.Tensor, num_top: int) -> None:
    assert len(entries) == len(PROMPT) - 1  # the first prompt token has none
    for position, entry in enumerate(entries):
        row = reference[position]  # position p predicts prompt token p + 1
        target = PROMPT[position + 1]
        assert entry.logprob == pytest.approx(float(row[target]), abs=TOLERANCE)
        assert int((row > row[target] + TOLERANCE).sum()) < entry.rank <= int((row > row[target] - TOLERANCE).sum()) + 1
        assert entry.top_logprobs == pytest.approx(row.topk(num_top).values.tolist(), abs=TOLERANCE)
        assert len(entry.top_ids) == num_top
        assert [float(row[t]) for t in entry.top_ids] == pytest.approx(entry.top_logprobs, abs=TOLERANCE)


def test_chunked_prefill_with_prefix_cache_gives_every_prompt_logprob(core, tiny_model, hf_logits, hf_greedy):
    model_dir = tiny_model("llama_tied")
    reference = hf_logits(model_dir, PROMPT).log_softmax(-1)
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = hf_greedy(model_dir, {"x": (PROMPT, 6)})["x"]

    first = run(core, {"plain": SamplingParams(**greedy)})["plain"]
    hits_before = core.stats().prefix_cache_hit_tokens
    # the prompt is cached now: asking for prompt logprobs must still compute every position
    second = run(core, {"asks": SamplingParams(**greedy, prompt_logprobs=NUM_TOP, logprobs=1)})["asks"]
    assert core.stats().prefix_cache_hit_tokens == hits_before
    third = run(core, {"again": SamplingParams(**greedy)})["again"]
    assert core.stats().prefix_cache_hit_tokens > hits_before  # one that does not ask still hits the cache

    for updates in (first, second, third):  # greedy tokens unchanged by asking
        assert [t for u in updates for t in u.new_token_ids] == expected
    assert all(u.prompt_logprobs == [] for u in first + third)
    assert second[0].prompt_logprobs and all(u.prompt_logprobs == [] for u in second[1:])
    check_against_transformers(second[0].prompt_logprobs, reference, NUM_TOP)
    zero = run(core, {"zero": SamplingParams(**greedy, prompt_logprobs=0)})["zero"][0].prompt_logprobs
    check_against_transformers(zero, reference, 0)
    single = core.add_request(AddRequest("one", [7], SamplingParams(**greedy, prompt_logprobs=2)))
    assert single is None
    while core.has_work():
        for update in core.step():
            assert update.prompt_logprobs == []  # a one-token prompt has no prompt logprob


def test_stop_reason_of_a_stop_token(core, tiny_model, hf_greedy):
    expected = hf_greedy(tiny_model("llama_tied"), {"x": (PROMPT, 6)})["x"]
    stop = expected[3]
    updates = run(core, {"s": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                             stop_token_ids=(stop,))})["s"]
    assert updates[-1].finish_reason == "stop" and updates[-1].stop_reason == stop
    assert all(u.stop_reason is None for u in updates[:-1])
    length = run(core, {"l": SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)})["l"]
    assert length[-1].finish_reason == "length" and length[-1].stop_reason is None


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_prompt_logprobs_from_a_tp_or_pp_worker_group(tmp_path, tiny_model, hf_logits, tp, pp):
    from engine.wire.scheduler_output import CachedRequest, NewRequest, SchedulerOutput
    from tests.engine.test_worker import make_group, spawn_group, stop

    model_dir = tiny_model("llama_tied")
    group = make_group(tmp_path, tp * pp)
    procs = spawn_group(tmp_path, model_dir, tp, pp)
    try:
        group.wait_for_ready(timeout_s=120)
        group.initialize_cache()
        params = SamplingParams(temperature=0.0, prompt_logprobs=NUM_TOP)
        blocks = list(range(1, 7))
        chunks, start = [], 0
        for step, n in enumerate((8, 8, 3)):
            if step == 0:
                new, cached = [NewRequest("p", PROMPT, len(PROMPT), params, blocks, 0)], []
            else:
                new, cached = [], [CachedRequest("p", start)]
            out = group.execute(SchedulerOutput(step_id=step, new_requests=new, cached_requests=cached,
                                                num_scheduled_tokens={"p": n}), timeout_s=60)
            chunks += out.prompt_logprobs
            start += n
        group.close()
        assert [p.wait(timeout=30) for p in procs] == [0] * (tp * pp)
    finally:
        stop(procs)
    assert [(c.req_id, c.start) for c in chunks] == [("p", 1), ("p", 9), ("p", 17)]
    check_against_transformers([e for c in chunks for e in c.logprobs],
                               hf_logits(model_dir, PROMPT).log_softmax(-1), NUM_TOP)


def test_the_scheduler_sends_prompt_logprobs_once_whole_across_chunks_and_a_lost_step():
    from engine.core.scheduler import Scheduler
    from engine.wire.scheduler_output import PromptLogprobs
    from tests.engine.test_scheduler import FakeWorker

    prompt = list(range(3, 13))
    sched = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=4, eos_token_id=0))
    worker = FakeWorker(32, 4)
    sched.add(Request("r", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)))

    def execute(out):
        result = worker.execute(out)
        starts = {r.req_id: r.num_computed_tokens for r in [*out.new_requests, *out.cached_requests]}
        for req_id, n in out.num_scheduled_tokens.items():
            start, end = starts[req_id], min(starts[req_id] + n, len(prompt) - 1)
            if end > start:  # the logprob of prompt token t is -t: what arrives says where it came from
                result.prompt_logprobs.append(PromptLogprobs(req_id, start + 1, [
                    TokenLogprobs(-float(t), [], [], 1) for t in range(start + 1, end + 1)]))
        return result

    updates = []
    for step in range(20):
        out = sched.schedule()
        if step == 1:  # the workers die during the second chunk: it is lost, and the prefill starts over
            sched.preempt_all()
            worker = FakeWorker(32, 4)
            continue
        updates += sched.update_from_output(out, execute(out))
        if not sched.has_unfinished_requests():
            break
    assert [len(u.new_token_ids) for u in updates] == [1, 1, 1]
    assert [e.logprob for e in updates[0].prompt_logprobs] == [-float(t) for t in range(1, len(prompt))]
    assert updates[1].prompt_logprobs == [] and updates[2].prompt_logprobs == []
