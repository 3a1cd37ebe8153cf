"""`GrammarCompiler`: StructuredOutputs -> compiled xgrammar grammars, in threads, cached per key.

xgrammar releases the GIL while it compiles, so a compile in the pool never
stalls the step loop. xgrammar (and with it torch) is imported on the first
structured request only: a core that never sees one never loads it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from engine.args import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES
from engine.wire.structured_outputs import StructuredOutputs

log = structlog.get_logger("engine-core")

MAX_CACHED_GRAMMARS = 256


class GrammarError(ValueError):
    """A grammar that cannot be served: invalid, or too slow to compile. The message says which."""


class CompileJob:
    """One compile in the pool, shared by every request of its key; `started` is set when it begins
    compiling (after any queue, and after the tokenizer's one-off load), which the timeout counts from."""

    def __init__(self):
        self.future: Future | None = None
        self.started: float | None = None


class PendingGrammar:
    """One request's compile: ready, failed (with the reason) or still running."""

    def __init__(self, job: CompileJob, timeout_s: float):
        self.job, self.timeout_s = job, timeout_s

    @property
    def future(self) -> Future:
        return self.job.future

    def result(self, now: float | None = None):
        """The compiled grammar; None while it compiles; raises GrammarError if it failed or timed out."""
        if self.future.done():
            error = self.future.exception()
            if error is not None:
                raise GrammarError(str(error)) from None
            return self.future.result()
        started = self.job.started
        if started is not None and (now if now is not None else time.monotonic()) - started > self.timeout_s:
            raise GrammarError(f"the grammar took longer than the compile timeout ({self.timeout_s:g} s, "
                               f"--grammar-compile-timeout) to compile; simplify the schema or grammar")
        return None


class GrammarCompiler:
    """Compiles against one model's tokenizer; equal keys share one compile (and its failure). A grammar
    over `max_bytes` fails at once: the API server refuses those, but the core does not rely on it."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Sequence[int], *,
                 timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
                 max_threads: int = 2):
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self.pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar")
        self._xgrammar = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompileJob] = OrderedDict()

    def compile(self, spec: StructuredOutputs) -> PendingGrammar:
        """Start (or join) the compile of `spec`; never raises."""
        if spec.num_bytes > self.max_bytes:
            job = CompileJob()
            job.future = Future()
            job.future.set_exception(GrammarError(f"the grammar is {spec.num_bytes} bytes, more than this server's "
                                                  f"limit of {self.max_bytes} (--max-grammar-bytes)"))
            return PendingGrammar(job, self.timeout_s)
        key = spec.key
        job = self._cache.get(key)
        if job is None or (job.future.done() and _is_transient(job.future)):
            job = CompileJob()
            job.future = self.pool.submit(self._compile, key, job)
            self._cache[key] = job
        self._cache.move_to_end(key)
        while len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return PendingGrammar(job, self.timeout_s)

    def _compile(self, key: tuple[str, str], job: CompileJob):
        kind, source = key
        compiler = self._xgrammar_compiler()
        job.started = time.monotonic()
        started = time.perf_counter()
        try:
            if kind in ("json", "json-compact"):
                compiled = compiler.compile_json_schema(source, any_whitespace=kind == "json",
                                                        separators=(",", ":") if kind == "json-compact" else None)
            elif kind == "regex":
                compiled = compiler.compile_regex(source)
            else:
                compiled = compiler.compile_grammar(source)
        except Exception as e:
            raise GrammarError(f"invalid {_NAMES[kind]}: {_compiler_message(e)}") from None
        log.debug("grammar compiled", kind=kind, num_bytes=len(source), seconds=round(time.perf_counter() - started, 4))
        return compiled

    def _xgrammar_compiler(self):
        """xgrammar's compiler for this tokenizer, built once (by the first compile's thread)."""
        with self._lock:
            if self._xgrammar is None:
                self._xgrammar = self._build_xgrammar_compiler()
            return self._xgrammar

    def _build_xgrammar_compiler(self):
        import xgrammar
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=self.eos_token_ids or None)
        return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


_NAMES = {"json": "JSON schema", "json-compact": "JSON schema", "regex": "regex", "grammar": "grammar"}


def _compiler_message(error: Exception) -> str:
    """xgrammar's message without its C++ source location ("[12:00:00] /project/cpp/x.cc:83: ")."""
    message = str(error).strip()
    head, sep, rest = message.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        return rest.strip()
    return message


def _is_transient(future: Future) -> bool:
    """A compile that failed for a reason other than its grammar (the tokenizer's load): try again."""
    error = future.exception()
    return error is not None and not isinstance(error, GrammarError)
