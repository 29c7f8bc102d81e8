"""A checkpoint's RNG state is portable between machines that show a rank different numbers of GPUs
(review F9, test T6): each rank keeps only its own device's CUDA generator. A checkpoint saved
before, with every visible GPU's generator (8 on an 8-GPU node), still resumes where a rank sees one
GPU (per-rank ``CUDA_VISIBLE_DEVICES`` under SLURM or Kubernetes), taking the generator of the
device it trained on (its ``LOCAL_RANK``); before, the resume failed as a "damaged checkpoint".

No GPU here: torch.cuda's generator functions are replaced by a simulation of ``n`` devices whose
generators are indexed as torch's ``default_generators`` are (an index past the last device raises
IndexError, as it does on a real machine)."""

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embed_core.train.engine import checkpoint


class SimulatedGenerators:
    """``n`` CUDA devices' generator states, device 0 current."""

    def __init__(self, n: int):
        self.states = [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(n)]
        self.read: list[int] = []

    @staticmethod
    def _index(device) -> int:
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return 0 if device.index is None else device.index

    def get_rng_state(self, device="cuda"):
        self.read.append(self._index(device))
        return self.states[self._index(device)].clone()

    def set_rng_state(self, new_state, device="cuda"):
        self.states[self._index(device)] = new_state.clone()  # IndexError past the last device, as torch's

    def install(self, monkeypatch) -> "SimulatedGenerators":
        for module in (torch.cuda, torch.cuda.random):  # set_rng_state_all looks them up in torch.cuda.random
            monkeypatch.setattr(module, "get_rng_state", self.get_rng_state)
            monkeypatch.setattr(module, "set_rng_state", self.set_rng_state)
            monkeypatch.setattr(module, "device_count", lambda: len(self.states))
            monkeypatch.setattr(module, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        return self


def _cpu_states() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}


def _checkpoint(tmp_path, rng: dict):
    path = tmp_path / "step-0000010"
    path.mkdir()
    (path / "trainer_state.json").write_text(json.dumps({"step": 10, "world": 1}))
    checkpoint.save_plain(rng, path / "rng-0.pt")
    return path


def _trainer():
    """What ``checkpoint.load`` asks of a trainer; the back end's state is not under test here."""
    return SimpleNamespace(world=1, rank=0, device=torch.device("cuda", 0),
                           backend=SimpleNamespace(load_state=lambda path, meta: None))


@pytest.mark.parametrize("local_rank", ["0", "3"])
def test_a_checkpoint_saved_with_8_gpus_generators_resumes_where_a_rank_sees_1_gpu(tmp_path, monkeypatch,
                                                                                  local_rank):
    eight = [torch.full((16,), 100 + i, dtype=torch.uint8) for i in range(8)]  # the old format: a list
    path = _checkpoint(tmp_path, {**_cpu_states(), "cuda": eight})
    one = SimulatedGenerators(1).install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert checkpoint.load(_trainer(), path)["step"] == 10
    assert torch.equal(one.states[0], eight[int(local_rank)])  # the generator of the device it trained on


def test_a_new_checkpoint_keeps_only_the_ranks_own_devices_generator_and_round_trips(tmp_path, monkeypatch):
    gpus = SimulatedGenerators(8).install(monkeypatch)
    state = checkpoint.rng_state(torch.device("cuda", 3))
    assert gpus.read == [3]  # not every visible GPU's
    assert torch.equal(state["cuda"], gpus.states[3])
    path = _checkpoint(tmp_path, state)
    gpus.states[3] = torch.zeros(16, dtype=torch.uint8)  # the generator moves on after the save
    trainer = _trainer()
    trainer.device = torch.device("cuda", 3)
    checkpoint.load(trainer, path)
    assert torch.equal(gpus.states[3], torch.full((16,), 13, dtype=torch.uint8))
    assert all(torch.equal(gpus.states[i], torch.full((16,), 10 + i, dtype=torch.uint8)) for i in range(8) if i != 3)


def test_the_same_new_checkpoint_resumes_where_the_rank_sees_only_its_own_gpu(tmp_path, monkeypatch):
    SimulatedGenerators(8).install(monkeypatch)
    path = _checkpoint(tmp_path, checkpoint.rng_state(torch.device("cuda", 5)))
    one = SimulatedGenerators(1).install(monkeypatch)
    checkpoint.load(_trainer(), path)
    assert torch.equal(one.states[0], torch.full((16,), 15, dtype=torch.uint8))


def test_a_cpu_device_snapshot_touches_no_cuda_generator(monkeypatch):
    """The per-pass snapshot of a CPU run (GradCache's replay) never asks CUDA, even where it is there."""
    gpus = SimulatedGenerators(8).install(monkeypatch)
    state = checkpoint.rng_state(torch.device("cpu"))
    checkpoint.set_rng_state(state, torch.device("cpu"))
    assert "cuda" not in state and gpus.read == []
