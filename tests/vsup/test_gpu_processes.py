"""Who holds memory on which GPU, from nvidia-smi's CSV (parsed here; read on a GPU host by `vsup ps`)."""

from vsup.devices import parse_gpu_processes

GPUS = "0, GPU-aaa\n1, GPU-bbb\n2, GPU-ccc\n"
APPS = "4242, GPU-aaa, 10240\n777, GPU-ccc, 512\nbad line\n99, GPU-zzz, 1\n"


def test_each_holder_on_the_gpu_index_the_deployment_uses():
    assert parse_gpu_processes(GPUS, APPS) == [{"pid": 4242, "gpu": 0, "bytes": 10240 << 20},
                                               {"pid": 777, "gpu": 2, "bytes": 512 << 20}]


def test_cuda_visible_devices_renumbers_and_hides_the_others():
    # the deployment's cuda:0 is physical GPU 2, cuda:1 is GPU-aaa (by uuid); GPU 1 is not ours to show
    assert parse_gpu_processes(GPUS, APPS, "2,GPU-aaa") == [{"pid": 4242, "gpu": 1, "bytes": 10240 << 20},
                                                            {"pid": 777, "gpu": 0, "bytes": 512 << 20}]
    assert parse_gpu_processes(GPUS, APPS, "1") == []
    assert parse_gpu_processes("", APPS) == []
