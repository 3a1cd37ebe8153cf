"""/metrics under `vsup serve`: every API server's counters live in files of one directory, summed at
scrape time. One API server may be creating its file (still empty) while another starts or is scraped."""

from __future__ import annotations

import struct

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

from engine.api_server.metrics import SharedFilesCollector


def write_counter(path, value: float) -> None:
    d = MmapedDict(str(path))
    d.write_value(mmap_key("vsup_generation_tokens", "vsup_generation_tokens_total", [], [], "Tokens generated."),
                  value, 0.0)
    d.close()


def test_the_files_of_every_api_server_are_summed_and_one_being_created_is_skipped(tmp_path):
    write_counter(tmp_path / "counter_101.db", 5)
    write_counter(tmp_path / "counter_102.db", 7)
    (tmp_path / "counter_103.db").touch()  # an API server between creating its file and sizing it
    with pytest.raises(struct.error):  # what prometheus_client's own collector does with it
        list(MultiProcessCollector(None, path=str(tmp_path)).collect())

    registry = CollectorRegistry(auto_describe=True)
    registry.register(SharedFilesCollector(str(tmp_path)))  # registering reads no file
    text = generate_latest(registry).decode()
    assert "vsup_generation_tokens_total 12.0" in text
