"""`Serving`: what one API server generates with (engine client, tokenizer, limits), and how a
request's choices start."""

from __future__ import annotations

from collections.abc import Sequence

from engine.api_server.dp_ranks import EngineUnavailable
from engine.api_server.errors import model_not_found, unavailable
from engine.api_server.generation import ChoiceRunner
from engine.api_server.openai_models import ModelLimits, SamplingFields
from engine.api_server.sampling import choice_params
from engine.api_server.tokenizer import Tokenizer
from engine.args import DEFAULT_MAX_GRAMMAR_BYTES
from engine.load import LoadMeter
from engine.wire.sampling_params import SamplingParams


class Serving:
    """The engine client, tokenizer and limits one API server generates with."""

    def __init__(self, client, tokenizer: Tokenizer, *, served_model_names: Sequence[str],
                 max_model_len: int | None, vocab_size: int, metrics=None,
                 max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES):
        self.client = client
        self.tokenizer = tokenizer
        self.served_model_names = list(served_model_names)
        self.default_max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_grammar_bytes = max_grammar_bytes
        self.metrics = metrics
        self.meter = LoadMeter()  # for `vsup ps`: the event loop's busy share, time spent tokenizing
        tokenizer.meter = self.meter

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (the default if none); 404 for any other."""
        if name is None:
            return self.model_name
        if name not in self.served_model_names:
            raise model_not_found(name)
        return name

    def max_model_len(self) -> int:
        """The context length: what the ready cores say, else --max-model-len / the model's."""
        served = self.client.max_model_len()
        if served is None and self.default_max_model_len is None:
            raise unavailable("no engine core is ready yet; retry shortly")
        return min(x for x in (served, self.default_max_model_len) if x is not None)

    def limits(self) -> ModelLimits:
        """What the model allows a request now (503 while no core is ready and no length is known)."""
        return ModelLimits(self.max_model_len(), self.vocab_size, self.max_grammar_bytes)

    def check_ready(self) -> None:
        """503 now rather than after tokenizing, when no rank could take the request."""
        try:
            self.client.ranks.choose()
        except EngineUnavailable as e:
            raise unavailable(str(e)) from e

    def start(self, request_id: str, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
              body: SamplingFields) -> list[ChoiceRunner]:
        """Send `body.n` engine requests per prompt; choice index = prompt index * n + i. 503 if no core."""
        runners: list[ChoiceRunner] = []
        n, stop = body.n, body.stop_strings()
        try:
            for p, (prompt, prompt_params) in enumerate(zip(prompts, params)):
                for i in range(n):
                    index = p * n + i
                    stream = self.client.add_request(prompt, choice_params(prompt_params, i), f"{request_id}-{index}")
                    runners.append(ChoiceRunner(index, stream, self.tokenizer, metrics=self.metrics, stop=stop,
                                                include_stop_str_in_output=body.include_stop_str_in_output,
                                                skip_special_tokens=body.skip_special_tokens))
        except EngineUnavailable as e:
            for runner in runners:
                runner.stream.close()
            raise unavailable(str(e)) from e
        return runners
