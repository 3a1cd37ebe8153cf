"""The API server: HTTP, the OpenAI routes, tokenization and the stream back to the client.

`python -m engine.api_server` runs one. It never imports torch, except in
in-process mode (`--no-multiprocessing`), where it runs the engine core and
its one worker itself. The parts:

- server.py: argv, the listening socket (the supervisor's, or its own with SO_REUSEPORT), uvicorn
- app.py: the FastAPI app and the small routes; middleware.py: API key, body limit
- serving.py, serving_completions.py, serving_chat.py: the two generation routes
- openai_models.py, sampling.py, errors.py: requests in, OpenAI errors out
- tokenizer.py, detokenizer.py, generation.py, logprobs.py: text in, text out
- client_base.py, engine_client.py, dp_ranks.py, request_stream.py: the ZeroMQ
  client to the engine cores; inproc_client.py: the same API on an in-process core
  (its one reach into engine.core, docs/ARCHITECTURE.md)
- metrics.py: Prometheus metrics
"""
