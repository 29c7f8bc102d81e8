"""What every training rank runs with (review F4, F12, F21; ``distributed.rank_environment``,
``divide_host_threads``, ``local_device_index``): NCCL's flight recorder on and dumped into the run
directory on a watchdog timeout, CUDA's allocator growing its segments, the host's cores divided
between a node's ranks (torch's threads and the tokenizers' pool), each rank on its own device
whether the node shows it every GPU or only its own; never over a variable the user set, and never
``TORCH_NCCL_BLOCKING_WAIT``."""

import os

import pytest
import torch

from embed_core.errors import LaunchError
from embed_core.dist.distributed import (FLIGHT_RECORDER_ENTRIES, divide_host_threads, host_share,
                                          local_device_index, rank_environment)

OURS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "RAYON_NUM_THREADS",
        "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "TORCH_NCCL_BLOCKING_WAIT")


@pytest.fixture
def clean(monkeypatch):
    for name in OURS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_rank_gets_the_flight_recorder_dumped_into_the_run_directory_and_expandable_segments(clean):
    env = rank_environment(2, "/runs/x/checkpoints/.ranks-ret/flight-recorder/rank-")
    share = str(host_share(2))
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": "/runs/x/checkpoints/.ranks-ret/flight-recorder/rank-",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/x/checkpoints/.ranks-ret/flight-recorder/rank-",
                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "RAYON_NUM_THREADS": share,
                   **({"TOKENIZERS_PARALLELISM": "false"} if share == "1" else {})}


def test_what_the_user_set_is_kept_and_blocking_wait_is_never_turned_on(clean):
    for name, value in {"TORCH_FR_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_", "PYTORCH_ALLOC_CONF": "backend:native",
                        "RAYON_NUM_THREADS": "3"}.items():
        clean.setenv(name, value)
    assert rank_environment(8, "/runs/x/fr/rank-") == {}
    assert "TORCH_NCCL_BLOCKING_WAIT" not in rank_environment(8) and "NCCL_BLOCKING_WAIT" not in rank_environment(8)


def test_a_nodes_ranks_divide_its_cores_between_them_unless_omp_num_threads_says(clean):
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        torch.set_num_threads(cores)
        divide_host_threads(cores * 2)  # more ranks than cores: one thread each, never zero
        assert torch.get_num_threads() == 1
        torch.set_num_threads(cores)
        clean.setenv("OMP_NUM_THREADS", str(cores))  # the user's (torchrun sets 1 unless the user did)
        divide_host_threads(cores * 2)
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)
    assert host_share(1) == cores and host_share(cores * 2) == 1


@pytest.mark.parametrize(("local_rank", "visible", "index"), [(3, 8, 3), (0, 8, 0), (3, 1, 0), (0, 1, 0)])
def test_a_rank_takes_its_local_rank_device_or_the_only_one_the_scheduler_shows_it(local_rank, visible, index):
    assert local_device_index(local_rank, visible) == index


def test_more_ranks_on_a_node_than_its_visible_gpus_is_one_line():
    with pytest.raises(LaunchError, match=r"^LOCAL_RANK=5 but this process sees 4 CUDA devices \(0\.\.3\): start at "
                                          r"most 4 processes per node \(torchrun --nproc_per_node 4\)$"):
        local_device_index(5, 4)
