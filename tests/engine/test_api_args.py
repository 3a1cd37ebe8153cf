"""The API server's argv contract with the supervisor, and the shared listening port."""

from __future__ import annotations

import socket

import pytest

from engine.api_server.server import listen_socket, parse_args

SUPERVISOR_ARGV = ["--api-server-rank", "1", "--engine-address", "ipc:///run/a1-engines.sock",
                   "--coordinator-address", "ipc:///run/coord.sock", "--tensor-parallel-size", "2",
                   "--pipeline-parallel-size", "1", "--data-parallel-size", "2", "--model", "/m",
                   "--served-model-name", "m", "--host", "127.0.0.1", "--port", "8001", "--dtype", "float32",
                   "--max-num-seqs", "64", "--kv-cache-bytes", "1048576", "--seed", "0", "--api-server-count", "2"]


def test_the_supervisors_argv_parses_and_other_roles_flags_pass_through(monkeypatch):
    monkeypatch.delenv("VSUP_API_KEY", raising=False)
    monkeypatch.delenv("VSUP_ENABLE_MULTIPROCESSING", raising=False)
    args = parse_args(SUPERVISOR_ARGV)
    assert (args.api_server_rank, args.api_server_count, args.data_parallel_size) == (1, 2, 2)
    assert args.engine_address == "ipc:///run/a1-engines.sock" and args.multiprocessing
    assert args.served_model_name == ["m"] and args.port == 8001 and args.api_key is None


def test_environment_sets_the_key_and_in_process_mode(monkeypatch):
    monkeypatch.setenv("VSUP_API_KEY", "from-env")
    monkeypatch.setenv("VSUP_ENABLE_MULTIPROCESSING", "0")
    args = parse_args(["--model", "/m"])
    assert args.api_key == "from-env" and not args.multiprocessing
    assert parse_args(["--model", "/m", "--no-multiprocessing", "--api-key", "flag"]).api_key == "flag"


def test_bad_combinations_say_what_to_do(monkeypatch, capsys):
    monkeypatch.delenv("VSUP_ENABLE_MULTIPROCESSING", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m"])
    assert "--engine-address is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m", "--no-multiprocessing", "--data-parallel-size", "2"])
    assert "it needs DP = 1" in capsys.readouterr().err


def test_api_servers_share_a_port_only_when_told_to():
    first = listen_socket("127.0.0.1", 0, reuse_port=True)
    port = first.getsockname()[1]
    try:
        second = listen_socket("127.0.0.1", port, reuse_port=True)
        second.close()
        with pytest.raises(OSError):
            listen_socket("127.0.0.1", port, reuse_port=False).close()
    finally:
        first.close()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # and the port is free again
