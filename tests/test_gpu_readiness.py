"""What a GPU run needs, checked on the CPU: device checks before CUDA is touched, and the
bucketed gradient all-reduce."""

import pytest
import torch

from isoloco import distributed
from isoloco.configbase import ConfigError


def test_one_named_gpu_is_refused_for_several_processes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ConfigError, match="device=cuda:1 names one GPU, but this run has 2 processes"):
        distributed.process_gpu("cuda:1", world_size=2)


def test_a_process_without_a_gpu_of_its_own_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match="LOCAL_RANK=2 has no GPU of its own \\(2 visible\\)"):
        distributed.process_gpu("cuda", world_size=4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.process_gpu("auto", world_size=4) == torch.device("cuda", 1)


def test_gradient_buckets_pack_small_tensors_and_leave_large_ones_alone():
    sizes = [10, 10, 300, 5, 3, 40]  # floats; a limit of 256 bytes = 64 floats
    tensors = [torch.zeros(n) for n in sizes] + [torch.zeros(4, dtype=torch.float64)]
    buckets = distributed._buckets(tensors, 256)
    assert [[t.numel() for t in b] for b in buckets] == [[10, 10], [300], [5, 3, 40], [4]]
    assert [t for b in buckets for t in b] == tensors  # order kept, nothing lost
