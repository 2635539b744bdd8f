"""CUDA/MPS code paths of the Replicator, exercised with torch's device queries mocked
(no GPU here): device choice per replica, and which buckets may go out asynchronously."""

from __future__ import annotations

import pytest
import torch

import meshtorch as mt
from meshtorch.comm import device as comm_device
from meshtorch.comm.stats import CommStats
from meshtorch.errors import MeshError
from meshtorch.mesh import Mesh
from meshtorch.replicator import device as dev
from meshtorch.replicator.channel import Channel
from meshtorch.replicator.optimizer import GradientSync


@pytest.fixture
def two_gpus(monkeypatch):
    current: dict[str, int] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # set_device is per thread in CUDA; record it per replica thread
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda i: current.__setitem__(mt.current().rank, i))
    return current


class FakeTorchComm:
    """What GradientSync and resolve_device read of a TorchCommunicator."""

    backend = "torch"

    def __init__(self, rank=0, size=2, device="cpu", check=False):
        self.mesh, self.rank, self.check = Mesh(f"replica:{size}"), rank, check
        self.device = torch.device(device)
        self.stats = CommStats()
        self.group_handle = object()

    def group(self, axes):
        return tuple(range(self.mesh.size))

    def process_group(self, axes):
        return self.group_handle


def test_cuda_threads_one_gpu_per_replica(two_gpus):
    got = mt.launch(lambda: dev.resolve_device("cuda", mt.current().comm), mesh="replica:2")
    assert got == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert two_gpus == {0: 0, 1: 1}                      # each thread's current device is its GPU
    assert mt.launch(lambda: dev.resolve_device("auto", mt.current().comm).type, mesh="replica:2") == \
        ["cuda", "cuda"]
    with pytest.raises(mt.errors.ProcessorError, match="3 thread processors but 2 CUDA GPUs"):
        mt.launch(lambda: dev.resolve_device("cuda", mt.current().comm), mesh="replica:3")
    with pytest.raises(mt.errors.ProcessorError, match="all 2 thread processors on one GPU"):
        mt.launch(lambda: dev.resolve_device("cuda:1", mt.current().comm), mesh="replica:2")


def test_cuda_torch_backend_uses_local_rank(two_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: two_gpus.__setitem__("proc", i))
    monkeypatch.setenv("LOCAL_RANK", "1")
    # global rank 2 on the second node is local GPU 1
    assert dev.resolve_device("cuda", FakeTorchComm(rank=2, size=4)) == torch.device("cuda", 1)
    assert two_gpus["proc"] == 1
    assert dev.resolve_device(torch.device("cuda"), FakeTorchComm(rank=2, size=4)) == torch.device("cuda", 1)
    assert dev.resolve_device("cuda:0", FakeTorchComm(rank=2, size=4)) == torch.device("cuda", 0)
    with pytest.raises(MeshError, match="sees 2 CUDA GPUs"):
        dev.resolve_device("cuda:2", FakeTorchComm())


def test_device_errors_name_the_fix(monkeypatch):
    comm = FakeTorchComm()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MeshError, match="no CUDA GPU; use device='auto'"):
        dev.resolve_device("cuda", comm)
    for bad in ("tpu", "cuda:x", "auto:1", torch.device("meta")):
        with pytest.raises(MeshError, match="is not one of"):
            dev.resolve_device(bad, comm)
    monkeypatch.setattr(comm_device, "mps_available", lambda: True)
    assert dev.resolve_device("auto", comm) == torch.device("mps")
    with pytest.raises(mt.errors.ProcessorError, match="cannot share the one MPS device"):
        mt.launch(lambda: dev.resolve_device("mps", mt.current().comm), mesh="replica:2")


@pytest.mark.parametrize(("comm_device", "check", "async_ok"), [
    ("cpu", False, True),       # gloo: CPU buckets go straight to torch.distributed
    ("cuda:0", False, False),   # NCCL wants buckets on cuda:<local rank>; CPU ones take the channel
    ("cpu", True, False),       # check=True compares each collective first, synchronously
])
def test_which_buckets_go_out_asynchronously(comm_device, check, async_ok):
    comm = FakeTorchComm(device=comm_device, check=check)
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, dtype=torch.float64))]
    sync = GradientSync(torch.optim.SGD(params, lr=1.0), Channel(comm), ("replica",), bucket_mb=1.0)
    # one bucket per dtype, in reverse parameter order, each with its own flat buffer
    assert [b.buffer.dtype for b in sync.buckets] == [torch.float64, torch.float32]
    assert [b.buffer.numel() for b in sync.buckets] == [2 + 1, 3 + 1]
    assert [b.async_ok for b in sync.buckets] == [async_ok, async_ok]
    assert (sync._group is comm.group_handle) == async_ok
    sync.remove()


def test_a_model_built_for_a_device_draws_the_cpus_weights(monkeypatch):
    """Inside ``repl.context()`` on a device, the initial weights come from the CPU generator in
    the CPU's order (``meta`` stands in for a GPU: the generator's state after the build shows
    which draws were made), and only the build runs under a device mode."""
    from meshtorch.replicator import replicator as repl_mod

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Conv1d(3, 2, 3), torch.nn.Embedding(5, 2))

    build()
    after_cpu = torch.get_rng_state()
    monkeypatch.setattr(repl_mod, "resolve_device", lambda spec, comm: torch.device("meta"))
    # the start-up broadcast would stage meta tensors through the host: nothing to send here
    monkeypatch.setattr(repl_mod.Replicator, "_broadcast_params", lambda self, params: None)

    def f():
        repl = mt.Replicator(device="cuda")
        with repl.context():
            model = build()
            state = torch.get_rng_state()
        modes = torch._C._len_torch_function_stack() if hasattr(torch._C, "_len_torch_function_stack") \
            else len(torch.overrides._get_current_function_mode_stack())
        return {p.device.type for p in model.parameters()}, torch.equal(state, after_cpu), modes

    assert mt.launch(f, mesh="replica:1") == [({"meta"}, True, 0)]
