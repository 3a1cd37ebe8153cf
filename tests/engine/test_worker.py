"""Worker and WorkerProc: real shards, real processes, real sockets; greedy tokens equal transformers'."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import psutil
import pytest
import structlog
import zmq

from engine.executor.worker_group import WorkerGroup, WorkerGroupFailed
from engine.wire.sampling_params import SamplingParams
from engine.wire.scheduler_output import CachedRequest, NewRequest, SchedulerOutput
from engine.ring.shm_broadcast import ShmBroadcastReader
from engine.wire.worker_messages import (CacheReady, GroupEpoch, InitializeCache, JoinGroup, WorkerReady, encoder,
                                         to_worker)
from engine.worker.worker import Worker, WorkerConfig
from tests.malformed import nested_too_deep
from tests.polling import wait_for

BLOCK = 4
PROMPTS = {"a": [5, 17, 42, 99, 3, 250, 7], "b": [11, 12, 13]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def drive(execute, prompts: dict[str, list[int]], num_tokens: int, chunk: int = 4,
          block_size: int = BLOCK) -> dict[str, list[int]]:
    """Play the engine core: chunked prefill (at most `chunk` prompt tokens a step) mixed with
    decodes, each request in its own blocks; returns the sampled tokens per request."""
    tokens = {r: list(p) for r, p in prompts.items()}
    blocks, next_block = {}, 1
    for r, p in prompts.items():
        n = -(-(len(p) + num_tokens) // block_size)
        blocks[r], next_block = list(range(next_block, next_block + n)), next_block + n
    computed = dict.fromkeys(prompts, 0)
    known: set[str] = set()
    pending: dict[str, list[int]] = {r: [] for r in prompts}
    outputs = {r: [] for r in prompts}
    step = 0
    while any(len(o) < num_tokens for o in outputs.values()):
        new, cached, scheduled = [], [], {}
        for r in prompts:
            if len(outputs[r]) >= num_tokens:
                continue
            n = min(chunk, len(tokens[r]) - computed[r])
            if r not in known:
                new.append(NewRequest(r, tokens[r], len(prompts[r]), GREEDY, blocks[r], 0))
                known.add(r)
            else:
                cached.append(CachedRequest(r, computed[r], pending[r]))
            pending[r] = []
            scheduled[r] = n
        result = execute(SchedulerOutput(step_id=step, new_requests=new, cached_requests=cached,
                                         num_scheduled_tokens=scheduled))
        for r, n in scheduled.items():
            computed[r] += n
        for r, t in zip(result.req_ids, result.sampled_token_ids):
            assert computed[r] == len(tokens[r]), "only a request at the end of its tokens samples"
            tokens[r].append(t)
            outputs[r].append(t)
            pending[r].append(t)
        step += 1
    return outputs


def test_in_process_worker_greedy_equals_transformers(tiny_model, hf_greedy):
    model_dir = tiny_model("llama")
    worker = Worker(WorkerConfig(model=str(model_dir), kv_cache_bytes=1 << 20, block_size=BLOCK))
    worker.init_device()
    worker.load_model()
    ready = worker.ready_report()
    per_block = 2 * 4 * 2 * 16 * 4 * BLOCK  # K,V x 4 layers x 2 KV heads x head_dim 16 x float32 x block
    assert ready.kv_bytes_per_block == per_block and ready.num_blocks == (1 << 20) // per_block
    worker.initialize_cache(64)
    assert drive(worker.execute, PROMPTS, 32) == hf_greedy(model_dir, {r: (p, 32) for r, p in PROMPTS.items()})


def make_group(tmp_path, world_size, address=None, **options):
    return WorkerGroup(address or f"ipc://{tmp_path}/w.sock", world_size, ring_prefix=f"vsup-test-{tmp_path.name}",
                       wakeup_address=f"ipc://{tmp_path}/wakeup.sock", **options)


def spawn_group(tmp_path, model_dir, tp, pp):
    procs = []
    for rank in range(tp * pp):
        argv = [sys.executable, "-m", "engine.worker", "--model", str(model_dir), "--dp-rank", "0",
                "--pp-rank", str(rank // tp), "--tp-rank", str(rank % tp), "--tensor-parallel-size", str(tp),
                "--pipeline-parallel-size", str(pp), "--kv-cache-bytes", str(1 << 20), "--block-size", str(BLOCK),
                "--core-address", f"ipc://{tmp_path}/w.sock", "--dist-init-method", f"file://{tmp_path}/dist",
                "--num-threads", "1"]
        env = {**os.environ, "VSUP_PROCESS_NAME": f"worker dp0 pp{rank // tp} tp{rank % tp}",
               "VSUP_PROCESS_TITLE": f"vsup::worker_dp0_pp{rank // tp}_tp{rank % tp}"}
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
    return procs


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
    return [p.stdout.read().decode() for p in procs]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_worker_group_processes_equal_transformers(tmp_path, tiny_model, hf_greedy, tp, pp):
    model_dir = tiny_model("llama_tied")
    group = make_group(tmp_path, tp * pp)
    procs = spawn_group(tmp_path, model_dir, tp, pp)
    try:
        ready = group.wait_for_ready(timeout_s=120)
        titles = {" ".join(psutil.Process(p.pid).cmdline()).strip() for p in procs}
        assert titles == {f"vsup::worker_dp0_pp{r // tp}_tp{r % tp}" for r in range(tp * pp)}
        assert len({w.name for w in ready}) == tp * pp
        assert all(w.weight_bytes > 0 and w.rss_bytes > 0 for w in ready)
        assert group.initialize_cache() == min(w.num_blocks for w in ready)
        outputs = drive(lambda out: group.execute(out, timeout_s=60), PROMPTS, 5)
        assert outputs == hf_greedy(model_dir, {r: (p, 5) for r, p in PROMPTS.items()})
        group.close()
        assert [p.wait(timeout=30) for p in procs] == [0] * (tp * pp)
    finally:
        logs = stop(procs)
    for rank, out in enumerate(logs):
        lines = [json.loads(line) for line in out.splitlines()]
        assert {"starting", "model loaded", "ready"} <= {line["event"] for line in lines}
        assert all(line["role"] == "worker" and (line["pp"], line["tp"]) == (rank // tp, rank % tp) for line in lines)


def test_tp_shards_hold_half_the_weights(tmp_path, tiny_model):
    model_dir = tiny_model("llama")
    group = make_group(tmp_path, 2)
    procs = spawn_group(tmp_path, model_dir, 2, 1)
    try:
        ready = group.wait_for_ready(timeout_s=120)
        group.close()
    finally:
        stop(procs)
    single = Worker(WorkerConfig(model=str(model_dir)))
    single.init_device()
    single.load_model()
    # everything but the replicated norms is split in two
    norms = (2 * 4 + 1) * 64 * 4
    assert all(w.weight_bytes == (single.weight_bytes - norms) // 2 + norms for w in ready)


def test_failed_worker_reports_instead_of_hanging(tmp_path, tiny_model):
    model_dir = tiny_model("llama")
    group = make_group(tmp_path, 1)
    argv = [sys.executable, "-m", "engine.worker", "--model", str(model_dir), "--kv-cache-bytes", "10",
            "--core-address", f"ipc://{tmp_path}/w.sock"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with pytest.raises(WorkerGroupFailed, match="holds no block"):
            group.wait_for_ready(timeout_s=120)
        assert proc.wait(timeout=30) == 1
    finally:
        stop([proc])
        group.close()


def test_malformed_message_is_dropped_and_logged(tmp_path, tiny_model):
    model_dir = tiny_model("llama")
    group = make_group(tmp_path, 1)
    procs = spawn_group(tmp_path, model_dir, 1, 1)
    try:
        group.wait_for_ready(timeout_s=120)
        identity = next(iter(group.workers))
        group.sock.send_multipart([identity, b"\xc1 not msgpack"])
        group.initialize_cache(32)
        group.ring.enqueue(b"\xc1 not msgpack either")
        out = drive(lambda o: group.execute(o, timeout_s=60), {"b": PROMPTS["b"]}, 2)
        assert len(out["b"]) == 2  # still serving
        group.close()
        assert procs[0].wait(timeout=30) == 0
    finally:
        logs = stop(procs)
    events = [json.loads(line)["event"] for line in logs[0].splitlines()]
    assert events.count("dropped malformed message") == 2  # one on the socket, one in the ring


def stand_in(tmp_path, group):
    """A stand-in worker of a group of one: (its context, its DEALER, connected, and the READY it would send)."""
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.connect(f"ipc://{tmp_path}/w.sock")
    return ctx, peer, stand_in_ready(group)


def stand_in_ready(group) -> WorkerReady:
    """The READY of a stand-in `worker dp0 pp0 tp0` (this process) for `group`."""
    return WorkerReady(name="worker dp0 pp0 tp0", pid=os.getpid(), dp=0, pp=0, tp=0, device="cpu", num_blocks=8,
                       block_size=BLOCK, weight_bytes=1, kv_bytes_per_block=1, rss_bytes=1, load_seconds=0.0,
                       epoch=group.epoch)


def test_group_drops_a_message_of_more_frames_or_nested_too_deep(tmp_path):
    """A worker sends one frame: the group logs and drops anything else, and still takes the READY after it."""
    group = make_group(tmp_path, 1)
    ctx, peer, ready = stand_in(tmp_path, group)
    try:
        peer.send_multipart([b"\xc1", b"two frames"])
        peer.send(nested_too_deep(encoder.encode(ready), 5000))
        peer.send(encoder.encode(ready))
        with structlog.testing.capture_logs() as logs:
            assert group.wait_for_ready(timeout_s=10) == [ready]
    finally:
        peer.close(linger=0)
        ctx.term()
        group.close(shutdown_workers=False)
    dropped = [e for e in logs if e["event"] == "dropped malformed message"]
    assert [e.get("num_frames") for e in dropped] == [3, None], logs
    assert "nested deeper" in dropped[1]["error"]


def test_a_worker_that_missed_the_cache_size_gets_it_again(tmp_path):
    """InitializeCache goes once; a worker that did not get it says READY again (as it does every 2 s while
    it waits), and the group answers with the cache size again instead of waiting for its timeout."""
    group = make_group(tmp_path, 1)
    ctx, peer, ready = stand_in(tmp_path, group)
    peer.setsockopt(zmq.RCVTIMEO, 10_000)  # a group that never answers fails the test, not hangs it
    answers, ring = [], []

    def worker():
        peer.send(encoder.encode(ready))
        answers.append(to_worker.decode(peer.recv()))  # lost, as far as this worker knows
        peer.send(encoder.encode(ready))
        msg = to_worker.decode(peer.recv())
        answers.append(msg)
        ring.append(ShmBroadcastReader.attach(msg.ring_name, 0, msg.wakeup_address))
        peer.send(encoder.encode(CacheReady(name=ready.name, num_blocks=msg.num_blocks, kv_cache_bytes=1,
                                            epoch=group.epoch)))
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        group.wait_for_ready(timeout_s=10)
        with structlog.testing.capture_logs() as logs:
            assert group.initialize_cache(timeout_s=10) == 8
    finally:
        thread.join(timeout=10)
        for r in ring:
            r.close()
        peer.close(linger=0)
        ctx.term()
        group.close(shutdown_workers=False)
    assert [type(a) for a in answers] == [InitializeCache, InitializeCache] and answers[0] == answers[1]
    assert [e["worker"] for e in logs if e["event"] == "sent the cache size again"] == [ready.name]


def test_default_model_answers_paris():
    """Greedy on the default model says where the capital of France is."""
    from transformers import AutoTokenizer

    from engine.model.default_model import default_model_dir

    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    worker = Worker(WorkerConfig(model=str(model_dir), kv_cache_bytes=64 << 20, block_size=16))
    worker.init_device()
    worker.load_model()
    worker.initialize_cache(worker.ready_report().num_blocks)
    tokens = drive(worker.execute, {"q": prompt}, 9, chunk=64, block_size=16)["q"]
    assert tokenizer.decode(tokens, skip_special_tokens=True).startswith("The capital of France is Paris.")


def test_a_group_formed_again_waits_for_its_port_and_otherwise_fails_cleanly(tmp_path, monkeypatch):
    """A group spanning nodes binds the same tcp:// address each generation. The previous generation's
    socket frees it only once ZeroMQ's I/O thread gets to it: the new group waits for the port rather
    than crash the core with EADDRINUSE. A port held for good fails the group (the core forms it again),
    and leaves no socket open, which would hang the core's exit in zmq_ctx_term."""
    from engine import cluster

    monkeypatch.setenv(cluster.SECRET_ENV, "test-secret")
    holder = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
    ctx = zmq.Context()
    threading.Timer(0.5, holder.close).start()  # what the old generation's close does, a moment late
    make_group(tmp_path, 1, address, ctx=ctx).close()

    monkeypatch.setattr(cluster, "BIND_RETRY_S", 0.3)
    holder = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
    try:
        # held, as the core's exception is while it closes: its traceback keeps the half-made group alive
        with pytest.raises(WorkerGroupFailed, match=f"cannot bind the workers' socket {address}") as failed:
            make_group(tmp_path, 1, address, ctx=ctx)
    finally:
        holder.close()
    term = threading.Thread(target=ctx.term, daemon=True)  # returns only once no socket is left open
    term.start()
    term.join(timeout=5)
    assert not term.is_alive(), f"the failed group left its socket open ({failed.value})"


def test_a_worker_reconnecting_under_its_name_is_answered_while_its_old_connection_lingers(tmp_path):
    """A node's restarted worker may connect before the group finds its old connection dead (heartbeats
    take 5 s after a node is lost): the new connection takes the name over, rather than go unheard."""
    group = make_group(tmp_path, 1)
    ctx = zmq.Context()
    old, new = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock in (old, new):
        sock.setsockopt(zmq.IDENTITY, b"worker dp0 pp0 tp0")
        sock.setsockopt(zmq.RCVTIMEO, 5000)
    ready = stand_in_ready(group)
    answers = []

    def worker():
        old.connect(f"ipc://{tmp_path}/w.sock")
        old.send(encoder.encode(JoinGroup(name=ready.name, pid=1)))
        answers.append(to_worker.decode(old.recv()))
        new.connect(f"ipc://{tmp_path}/w.sock")  # the old one stays connected
        new.send(encoder.encode(JoinGroup(name=ready.name, pid=os.getpid())))
        answers.append(to_worker.decode(new.recv()))
        new.send(encoder.encode(ready))
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        assert group.wait_for_ready(timeout_s=10) == [ready]
        assert answers == [GroupEpoch(group.epoch)] * 2
    finally:
        thread.join(timeout=10)
        for sock in (old, new):
            sock.close(linger=0)
        ctx.term()
        group.close(shutdown_workers=False)


def test_a_group_closed_as_a_worker_disconnects_frees_its_port(tmp_path, monkeypatch):
    """A group spanning nodes watches its workers' connections (a monitor on its ROUTER). A worker whose
    connection drops while the group closes (tp0 exits right after its WorkerFailed) must not leave
    ZeroMQ's I/O thread blocked for good sending that event to the closed monitor, with the port still
    bound: each new group then failed to bind it until --worker-timeout (the multinode heal, under load)."""
    from engine import cluster

    monkeypatch.setenv(cluster.SECRET_ENV, "test-secret")
    monkeypatch.setattr(cluster, "BIND_RETRY_S", 2.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    ctx, peer_ctx = zmq.Context(), zmq.Context()
    group = make_group(tmp_path, 1, address, ctx=ctx)
    peer = peer_ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    cluster.connect(peer, address)
    try:
        ready = stand_in_ready(group)
        peer.send(encoder.encode(ready))
        assert group.wait_for_ready(timeout_s=10) == [ready]
        group.monitor = group.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # as initialize_cache, for remote ones
        close = group.sock.close

        def close_as_the_worker_leaves(*args, **kwargs):  # its connection drops between the monitor's close and ours
            peer.close(linger=0)
            # ZeroMQ's I/O thread closes our end once it has handled the drop; blocked sending the event, never
            wait_for(lambda: not [c for c in psutil.Process().net_connections("tcp")
                                  if c.laddr.port == port and c.status != psutil.CONN_LISTEN],
                     timeout=10, what="the group's end of the dropped connection closed")
            close(*args, **kwargs)
        monkeypatch.setattr(group.sock, "close", close_as_the_worker_leaves)
        group.close(shutdown_workers=False)
        make_group(tmp_path, 1, address, ctx=ctx).close(shutdown_workers=False)  # the next generation binds
    finally:
        peer.close(linger=0)
        peer_ctx.term()
        ctx.destroy(linger=0)
