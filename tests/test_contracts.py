"""The contract between vsup and engine: argv, names and arithmetic both sides must agree on."""

from hypothesis import given
from hypothesis import strategies as st

from engine.distributed import layer_range
from engine.worker.worker_proc import parse_args
from vsup.memory import layer_ranges
from vsup.topology import WORKER, ParallelConfig, plan


@given(st.integers(1, 200), st.integers(1, 16))
def test_planner_and_engine_split_layers_alike(num_layers, pp):
    if pp <= num_layers:
        assert layer_ranges(num_layers, pp) == [layer_range(num_layers, pp, s) for s in range(pp)]


def test_worker_accepts_the_argv_the_topology_gives_it():
    p = plan(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2, device="cuda"),
             engine_args=("--model", "m", "--core-address", "ipc://x"))
    for spec in p.processes:
        if spec.role != WORKER:
            continue
        args = parse_args(list(spec.argv[3:]))
        assert (args.dp_rank, args.pp_rank, args.tp_rank) == (spec.dp, spec.pp, spec.tp)
        assert args.device == spec.device
        assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (2, 2, 2)


def test_every_role_parses_the_argv_serve_gives_it():
    from engine.api_server.server import parse_args as api_server_args

    from engine.core.engine_core_proc import parse_args as core_args

    p = plan(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, device="cpu"),
             engine_args=("--model", "m"), run_dir="/run/x", deployment="x")
    for spec in p.processes:
        argv = list(spec.argv[3:])
        if spec.role == "api-server":
            args = api_server_args(argv)
            assert args.engine_address.endswith(f"a{spec.a}-engines.sock") and args.coordinator_address
            assert args.api_server_count == 2 and args.state_file == "/run/x/state.json"
        elif spec.role == "engine-core":
            args = core_args(argv)
            assert args.dp_rank == spec.dp and len(args.api_server_address) == 2
            assert args.ring_prefix == f"vsup-x-dp{spec.dp}" and args.coordinator_address
        elif spec.role == WORKER:
            assert parse_args(argv).core_address.endswith(f"dp{spec.dp}-workers.sock")
