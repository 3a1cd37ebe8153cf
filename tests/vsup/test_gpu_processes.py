"""Who holds memory on which GPU, from NVML's view (read on a GPU host by `vsup ps`; renumbered here)."""

from vsup.devices import Gpu, as_visible, gpu_memory_bytes, gpu_processes, holders

GPUS = [Gpu(0, "GPU-aaa-1", 80 << 30, ((4242, 10240 << 20),)), Gpu(1, "GPU-bbb-2", 80 << 30),
        Gpu(2, "GPU-ccc-3", 40 << 30, ((777, 512 << 20), (4242, 1 << 20)))]


def test_each_holder_on_the_gpu_index_the_deployment_uses():
    assert holders(GPUS) == [{"pid": 4242, "gpu": 0, "bytes": 10240 << 20},
                             {"pid": 777, "gpu": 2, "bytes": 512 << 20}, {"pid": 4242, "gpu": 2, "bytes": 1 << 20}]


def test_cuda_visible_devices_renumbers_and_hides_the_others():
    # the deployment's cuda:0 is physical GPU 2, cuda:1 is GPU-aaa (a uuid prefix, as CUDA takes it)
    assert holders(GPUS, "2,GPU-aaa") == [{"pid": 777, "gpu": 0, "bytes": 512 << 20},
                                          {"pid": 4242, "gpu": 0, "bytes": 1 << 20},
                                          {"pid": 4242, "gpu": 1, "bytes": 10240 << 20}]
    assert holders(GPUS, "1") == []
    assert holders([], "0") == []


def test_cuda_stops_at_the_first_entry_it_cannot_use():
    assert [g.index for g in as_visible(GPUS, "2,7,0")] == [2]
    assert as_visible(GPUS, "-1") == [] and as_visible(GPUS, "") == []
    assert [g.index for g in as_visible(GPUS, "1,1")] == [1]


def test_without_a_driver_nothing_is_held_and_nothing_fails():
    # this machine has no NVIDIA driver: NVML's library is not found, and ps shows no GPU column
    assert gpu_processes() == [] and gpu_memory_bytes() is None


def test_where_the_driver_seems_there_but_nvml_is_not_nothing_fails(monkeypatch):
    # a device node without the NVML library behind it (a half-mounted container): NVML's init fails, [] again
    from vsup import devices

    monkeypatch.setattr(devices, "NVIDIA_CTL", "/dev/null")
    assert devices.nvml_gpus() == [] and devices.gpu_processes() == []
