"""Structured outputs' pure parts: the bitmask on logits, the wire's constraint, a grammar state rebuilt
from tokens already produced, and a scheduler that lets no compile hold up other requests."""

from __future__ import annotations

import json
from concurrent.futures import Future

import pytest
import torch

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.sampling.grammar_bitmask import allowed_tokens, apply_grammar_bitmask, bitmask_from_bytes
from engine.sampling.sampler import Sampler, SamplingMetadata, make_generator
from engine.structured.compiler import CompileJob, GrammarCompiler, GrammarError, PendingGrammar
from engine.structured.manager import StructuredOutputManager
from engine.structured.matcher import RequestGrammar, bitmask_bytes, rebuilt
from engine.wire.protocol import FinishReason
from engine.wire.sampling_params import SamplingParams
from engine.wire.scheduler_output import ModelRunnerOutput
from engine.wire.structured_outputs import StructuredOutputs, choice_grammar
from tests.local_deployment import with_test_tokenizer

VOCAB = 100


def random_bitmask(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=g) < 0.1
    allowed[:, int(torch.randint(vocab, (1,), generator=g))] = True  # never an empty row
    words = -(-vocab // 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return allowed, torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_a_bitmask_unpacks_to_the_tokens_it_allows():
    allowed, bitmask = random_bitmask(3, VOCAB, 0)
    assert torch.equal(allowed_tokens(bitmask, VOCAB), allowed)
    data = bitmask.numpy().astype("<i4").tobytes()
    assert torch.equal(bitmask_from_bytes(data, 3), bitmask)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_masked_tokens_are_never_chosen_and_other_rows_are_untouched(temperature):
    sampler = Sampler()
    for seed in range(20):
        logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
        allowed, bitmask = random_bitmask(2, VOCAB, seed)
        rows = torch.tensor([1, 3])
        params = [SamplingParams(temperature=temperature, top_k=5 if seed % 2 else -1, top_p=0.9)] * 4
        metadata = SamplingMetadata.from_params(params, [[]] * 4, [make_generator(seed + i) for i in range(4)])
        metadata.grammar_rows, metadata.grammar_bitmask = rows, bitmask
        sampled = sampler(logits, metadata).sampled_token_ids
        for i, row in enumerate(rows.tolist()):
            assert allowed[i, sampled[row]]
        plain = SamplingMetadata.from_params(params, [[]] * 4, [make_generator(seed + i) for i in range(4)])
        unmasked = sampler(logits, plain).sampled_token_ids
        assert sampled[0] == unmasked[0] and sampled[2] == unmasked[2]
    masked = apply_grammar_bitmask(logits, rows, bitmask)
    assert torch.isinf(masked[1][~allowed[0]]).all() and torch.equal(masked[0], logits[0])


def test_the_wire_constraint_says_what_it_compiles_and_refuses_what_is_wrong():
    assert StructuredOutputs(json_object=True).key == ("json", '{"type": "object"}')
    assert StructuredOutputs(json="{}", disable_any_whitespace=True).key == ("json-compact", "{}")
    assert StructuredOutputs(choice=("a", 'b"\n')).key == ("grammar", 'root ::= "a" | "b\\"\\n"')
    for bad, says in [(StructuredOutputs(), "got none"), (StructuredOutputs(regex="a", grammar="b"), "regex, grammar"),
                      (StructuredOutputs(json="{x"), "not valid JSON"), (StructuredOutputs(json="3"), "object or"),
                      (StructuredOutputs(choice=()), "at least one"), (StructuredOutputs(regex="a\x00"), "NUL")]:
        with pytest.raises(ValueError, match=says):
            bad.validate()
    assert choice_grammar(["x"]) == 'root ::= "x"'


@pytest.fixture(scope="module")
def compiler(tiny_model, tmp_path_factory):
    model = with_test_tokenizer(tiny_model("llama_tied"), tmp_path_factory.mktemp("tok") / "model")
    compiler = GrammarCompiler(str(model), 256, [2])
    yield compiler
    compiler.close()


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "yy"]}}, "required": ["a", "b"]}


def walk(grammar: RequestGrammar, seed: int, max_steps: int = 200) -> list[int]:
    """Tokens a seeded random sampler picks under the grammar, until it terminates."""
    import xgrammar

    g, tokens = torch.Generator().manual_seed(seed), []
    mask = xgrammar.allocate_token_bitmask(1, 256)
    while not grammar.is_terminated and len(tokens) < max_steps:
        grammar.fill_bitmask(mask, 0)
        choices = allowed_tokens(mask, 256)[0].nonzero().flatten()
        token = int(choices[torch.randint(len(choices), (1,), generator=g)])
        assert grammar.accept([token])
        tokens.append(token)
    return tokens


def test_a_grammar_rebuilt_from_produced_tokens_continues_validly(compiler):
    from transformers import AutoTokenizer

    compiled = compiler.compile(StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True)).future.result()
    tokenizer = AutoTokenizer.from_pretrained(compiler.model_dir)
    for seed in range(5):
        whole = walk(RequestGrammar(compiled, [2]), seed)
        assert whole[-1] == 2  # it ends by accepting EOS
        value = json.loads(tokenizer.decode(whole[:-1]))
        assert 0 <= value["a"] <= 99 and value["b"] in ("x", "yy")
        head = whole[:len(whole) // 2]
        resumed = rebuilt(compiled, head, [2])
        assert resumed is not None and resumed.num_accepted == len(head)
        first, second = RequestGrammar(compiled, [2]), resumed
        assert first.accept(head)
        import xgrammar
        masks = xgrammar.allocate_token_bitmask(2, 256)
        first.fill_bitmask(masks, 0)
        second.fill_bitmask(masks, 1)
        assert bitmask_bytes(masks[0:1]) == bitmask_bytes(masks[1:2])
        tail = walk(resumed, seed + 100)
        json.loads(tokenizer.decode(head + tail[:-1]))
    assert rebuilt(compiled, [ord("x") - 29], [2]) is None  # "x" can't open an object


def test_compile_errors_name_the_compiler_error_and_are_cached(compiler):
    pending = compiler.compile(StructuredOutputs(regex="a(b"))
    pending.future.exception()
    with pytest.raises(GrammarError, match="invalid regex: .*parenthesis is not closed"):
        pending.result()
    assert compiler.compile(StructuredOutputs(regex="a(b")).job is pending.job
    with pytest.raises(GrammarError, match="--max-grammar-bytes"):
        compiler.compile(StructuredOutputs(regex="a" * (compiler.max_bytes + 1))).result()


class FakeCompiler:
    """Compiles nothing: each key's future is the test's to finish."""

    vocab_size, eos_token_ids = 256, [2]

    def __init__(self):
        self.jobs: dict[tuple, CompileJob] = {}

    def compile(self, spec):
        job = self.jobs.setdefault(spec.key, CompileJob())
        job.future = job.future or Future()
        return PendingGrammar(job, timeout_s=1.0)


def test_a_request_waiting_for_its_grammar_holds_up_no_one_and_a_failed_one_ends_with_its_error():
    fake = FakeCompiler()
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, eos_token_id=2), StructuredOutputManager(fake))
    spec = StructuredOutputs(regex="[0-9]+")
    scheduler.add(Request("s", [5, 6], SamplingParams(max_tokens=4, structured_outputs=spec)))
    scheduler.add(Request("p", [7, 8], SamplingParams(max_tokens=4)))
    for step in range(3):
        out = scheduler.schedule()
        assert list(out.num_scheduled_tokens) == ["p"] and out.grammar_bitmask is None
        assert all(r.sampling.structured_outputs is None for r in out.new_requests)
        scheduler.update_from_output(out, ModelRunnerOutput(out.step_id, ["p"], [9]))
    fake.jobs[spec.key].future.set_exception(GrammarError("invalid regex: broken"))
    out = scheduler.schedule()
    updates = scheduler.update_from_output(out, ModelRunnerOutput(out.step_id, list(out.num_scheduled_tokens),
                                                                  [9] * len(out.num_scheduled_tokens)))
    failed = [u for u in updates if u.req_id == "s"]
    assert failed[0].finish_reason is FinishReason.ERROR and failed[0].error == "invalid regex: broken"
    assert "s" not in scheduler.requests and not scheduler.structured.pending


def test_a_compile_that_outlives_its_timeout_fails_the_request():
    job = CompileJob()
    job.future, job.started = Future(), 100.0
    pending = PendingGrammar(job, timeout_s=2.0)
    assert pending.result(now=101.0) is None
    with pytest.raises(GrammarError, match="--grammar-compile-timeout"):
        pending.result(now=103.0)
    job.started = None  # still queued: the clock has not started
    assert pending.result(now=1e9) is None


def test_structured_requests_preempted_for_kv_space_resume_their_grammar_and_validate(compiler):
    """Six structured requests and a plain one in a cache that holds about two of them: preempted and
    resumed, each keeps its grammar state, and its output validates. Tokens come from a fake model that
    draws uniformly from what each row's bitmask allows (any token for the plain one)."""
    from transformers import AutoTokenizer

    schema = {"type": "array", "items": {"enum": ["x", "yy"]}, "minItems": 6, "maxItems": 6}
    spec = StructuredOutputs(json=json.dumps(schema), disable_any_whitespace=True)
    scheduler = Scheduler(SchedulerConfig(num_blocks=24, block_size=4, max_model_len=128, eos_token_id=2),
                          StructuredOutputManager(compiler))
    for i in range(6):
        scheduler.add(Request(f"s{i}", [3 + i, 4, 5, 6], SamplingParams(max_tokens=60, structured_outputs=spec)))
    scheduler.add(Request("plain", [7, 8], SamplingParams(max_tokens=30, ignore_eos=True)))
    g, outputs = torch.Generator().manual_seed(0), {}
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        if scheduler.structured.has_pending():
            scheduler.structured.wait(0.05)  # as the engine core does when a compile holds its only work
        rows = {}
        if out.grammar_bitmask is not None:
            masks = bitmask_from_bytes(out.grammar_bitmask.data, len(out.grammar_bitmask.req_ids))
            rows = dict(zip(out.grammar_bitmask.req_ids, allowed_tokens(masks, 256)))
        sampling = [r for r in out.num_scheduled_tokens
                    if scheduler.requests[r].num_computed_tokens == scheduler.requests[r].num_tokens]
        assert set(rows) == {r for r in sampling if r != "plain"}
        tokens = []
        for req_id in sampling:
            choices = rows[req_id].nonzero().flatten() if req_id in rows else torch.arange(3, 256)
            tokens.append(int(choices[torch.randint(len(choices), (1,), generator=g)]))
        for update in scheduler.update_from_output(out, ModelRunnerOutput(out.step_id, sampling, tokens)):
            outputs.setdefault(update.req_id, []).extend(update.new_token_ids)
            assert update.finish_reason in (None, FinishReason.STOP, FinishReason.LENGTH), update
    assert not scheduler.has_unfinished_requests() and scheduler.num_preemptions > 0
    tokenizer = AutoTokenizer.from_pretrained(compiler.model_dir)
    for i in range(6):
        assert outputs[f"s{i}"][-1] == 2
        items = json.loads(tokenizer.decode(outputs[f"s{i}"][:-1]))
        assert len(items) == 6 and set(items) <= {"x", "yy"}
    assert len(outputs["plain"]) == 30 and not scheduler.structured.grammars
