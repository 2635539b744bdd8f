"""The GPU path: which device each processor computes on, and (where torch sees GPUs) that
CUDA runs give the CPU's values.

The device choice and its plumbing are tested everywhere, with torch's CUDA queries
mocked and the ``meta`` device standing in for a GPU (tensors land on it without a GPU);
the tests marked ``cuda`` run only where torch sees one (two for the multi-GPU ones).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import meshtorch as mt
from meshtorch.comm import device as comm_device
from meshtorch.comm.base import LocalCommunicator
from meshtorch.context import ProcessorContext, use
from meshtorch.errors import MeshError
from meshtorch.launcher import threads as launch_threads
from meshtorch.launcher.world import init_distributed

CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


# ----------------------------------------------------------- device choice (no GPU needed)
@pytest.mark.parametrize(("gpus", "processors", "want"), [
    (0, 1, "cpu"), (1, 1, "cuda"), (1, 2, "cpu"), (4, 4, "cuda"), (4, 8, "cpu")])
def test_auto_is_cuda_only_with_a_gpu_per_processor(monkeypatch, gpus, processors, want):
    _gpus(monkeypatch, gpus)
    assert comm_device.auto_device(processors) == want
    assert comm_device.threads_device("auto", processors) == want
    assert comm_device.threads_device(None, processors) == "cpu"  # a launch never moves unasked
    assert comm_device.threads_device("cuda:1", processors) == "cuda:1"


def test_bad_device_fails_before_any_processor_starts(monkeypatch):
    started = []
    with pytest.raises(MeshError, match="is not one of"):
        mt.launch(lambda: started.append(1), mesh="b:2", device="tpu")
    assert started == []
    _gpus(monkeypatch, 0)
    with pytest.raises(MeshError, match="no CUDA GPU"):
        mt.launch(lambda: 0, mesh="b:2", device="cuda")


def test_processors_compute_on_their_device(monkeypatch):
    """Each thread-processor gets its own device, and mt's factories, mt.random, layers'
    parameters and from_global put tensors there (``meta`` stands in for the GPUs)."""
    asked = {}

    def fake(spec, comm):
        asked[comm.rank] = spec
        return torch.device("meta")

    monkeypatch.setattr(launch_threads, "resolve_device", fake)

    def f():
        dense = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2))
        return (str(mt.current().device), mt.zeros("a:4").device.type,
                mt.random.normal("a:4", seed=1).device.type, dense.kernel.device.type,
                mt.from_global(torch.ones(4), "a:4").device.type, torch.ones(1).device.type)

    got = mt.launch(f, mesh="b:2", device="cuda")
    assert asked == {0: "cuda", 1: "cuda"}
    assert got == [("meta",) * 6] * 2
    assert torch.ones(1).device.type == "cpu"  # the launch left the caller's default device alone
    monkeypatch.undo()
    assert mt.launch(f, mesh="b:2") == [("cpu",) * 6] * 2


def test_threads_put_processor_i_on_gpu_i(monkeypatch):
    _gpus(monkeypatch, 2)
    current: dict[int, int] = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: current.__setitem__(mt.current().rank, i))
    got = mt.launch(lambda: comm_device.resolve_device("cuda", mt.current().comm), mesh="b:2")
    assert got == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert current == {0: 0, 1: 1}  # each thread's current CUDA device is its own GPU
    with pytest.raises(mt.errors.ProcessorError, match="3 thread processors but 2 CUDA GPUs"):
        mt.launch(lambda: comm_device.resolve_device("cuda", mt.current().comm), mesh="b:3")


def test_torch_backend_device_is_checked_before_joining(monkeypatch):
    _gpus(monkeypatch, 0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(MeshError, match="no CUDA GPU"):
        init_distributed("p:1", device="cuda")
    with pytest.raises(MeshError, match="runs on 'cpu' \\(gloo\\) or 'cuda' \\(NCCL\\)"):
        init_distributed("p:1", device="mps")


def test_autocast_follows_the_processors_device():
    comm = LocalCommunicator()
    assert mt.autocast(torch.bfloat16).device == "cpu"
    comm.device = torch.device("cuda", 0)
    with use(ProcessorContext(comm)), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU-only torch warns that CUDA autocast is off
        assert mt.autocast(torch.bfloat16).device == "cuda"


def test_train_has_a_device_flag():
    from meshtorch.recipes.lm import TrainConfig

    assert TrainConfig().parallelism.device == "auto"
    assert TrainConfig.of(device="cuda").parallelism.device == "cuda"


# ---------------------------------------------------------------- real GPUs
def _mlp_step(rules: str):
    """Loss and the global gradient of a 2-layer MLP on a fixed batch (fp32)."""
    x = mt.from_global(torch.arange(32.0).reshape(8, 4) / 32, "batch:8,d:4")
    l1 = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 8), seed=1)
    l2 = mt.nn.Dense(mt.Dim("h", 8), mt.Dim("o", 2), seed=2)
    loss = mt.reduce_sum(l2(mt.relu(l1(x))) ** 2)
    loss.backward()
    return loss.to_global().item(), l1.kernel.grad.to_global().cpu(), l1.kernel.device.type


@cuda
def test_one_gpu_step_equals_the_cpu():
    want_loss, want_grad, dev = mt.launch(_mlp_step, "", mesh="b:1")[0]
    loss, grad, gdev = mt.launch(_mlp_step, "", mesh="b:1", device="cuda")[0]
    assert (dev, gdev) == ("cpu", "cuda")
    assert loss == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)


@cuda
def test_bf16_autocast_on_cuda():
    def f():
        x = mt.ones("batch:2,d:4")
        with mt.autocast(torch.bfloat16):
            y = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2), seed=0)(x)
        return y.dtype, y.device.type

    assert mt.launch(f, mesh="b:1", device="cuda") == [(torch.bfloat16, "cuda")]


@two_gpus
@pytest.mark.parametrize("rules", ["batch:b", "h:b", "batch:b; h:b"])
def test_threads_across_gpus_equal_the_cpu(rules):
    """Collectives between thread-processors on different GPUs (all_reduce, all_gather,
    reduce_scatter) move the data across devices and give the CPU's values."""
    cpu = mt.launch(_mlp_step, rules, mesh="b:2", rules=rules)
    gpu = mt.launch(_mlp_step, rules, mesh="b:2", rules=rules, device="cuda")
    for (wl, wg, _), (gl, gg, dev) in zip(cpu, gpu):
        assert dev == "cuda"
        assert gl == pytest.approx(wl, rel=1e-5)
        torch.testing.assert_close(gg, wg, rtol=1e-5, atol=1e-6)


def _collectives():
    comm = mt.current().comm
    t = torch.arange(4.0).reshape(2, 2) + 10 * comm.rank
    checked = True
    try:  # the mismatch check gathers its digests on the GPU too
        comm.all_reduce(torch.ones(2 + comm.rank), "b")
        checked = False
    except mt.errors.CommError:
        pass
    return (comm.all_reduce(t, "b").cpu(), comm.all_gather(t, "b", 0).cpu(),
            comm.all_to_all(t, "b", 0, 1).cpu(), comm.shift(t, "b", 1, wrap=True).cpu(), checked,
            t.device.type)


@two_gpus
def test_torch_backend_nccl_equals_threads():
    want = mt.launch(_collectives, mesh="b:2", check=True)
    got = mt.launch(_collectives, mesh="b:2", check=True, backend="torch", device="cuda")
    for w, g in zip(want, got):
        for a, b in zip(w[:4], g[:4]):
            torch.testing.assert_close(b, a)
        assert g[4:] == (True, "cuda")


@cuda
def test_replicator_on_cuda_equals_the_cpu():
    def step(device):
        repl = mt.Replicator(device=device)
        with repl.context():
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
        opt = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.arange(8.0).reshape(2, 4) / 8
        repl.run(lambda b: model(b).pow(2).sum().backward(), lambda ctx: x)
        opt.step()
        return model.weight.detach().cpu(), model.weight.device.type

    (w_cpu, d_cpu), = mt.replicator.launch_replicas(step, "cpu", num_replicas=1)
    (w_gpu, d_gpu), = mt.replicator.launch_replicas(step, "cuda", num_replicas=1)
    assert (d_cpu, d_gpu) == ("cpu", "cuda")
    torch.testing.assert_close(w_gpu, w_cpu, rtol=1e-5, atol=1e-6)


@cuda
def test_meshtorch_train_on_cuda(tmp_path):
    from meshtorch.recipes.lm import TrainConfig, train

    data = tmp_path / "data.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 400)
    opts = dict(d_model=32, heads=2, d_kv=16, d_ff=64, layers=1, batch=4, length=16, steps=3, log_every=3,
                eval_batches=1, sample_tokens=4, mesh="b:1", rules="", data=str(data), progress=False)
    cpu = train(TrainConfig.of(**opts, device="cpu", out=str(tmp_path / "cpu")))
    gpu = train(TrainConfig.of(**opts, device="cuda", out=str(tmp_path / "gpu")))
    assert (cpu["device"], gpu["device"]) == ("cpu", "cuda:0")
    assert gpu["final_loss"] == pytest.approx(cpu["final_loss"], rel=1e-3)
