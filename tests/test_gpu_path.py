"""The GPU path: which device each processor computes on, and that a run on a device gives
the CPU's values.

The device choice and its plumbing are tested everywhere, with torch's CUDA queries
mocked and the ``meta`` device standing in for a GPU (tensors land on it without a GPU,
and an elementwise op that mixes it with a host tensor raises, as CUDA would). The tests
of values are parametrised by device: each runs its body on the CPU everywhere, and
again on CUDA where torch sees a GPU (two for the multi-GPU ones), so only the device
differs and a CUDA test cannot rot unseen.
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
# every test of values runs on the CPU, and on CUDA where there is a GPU (or two)
ONE_GPU = ["cpu", pytest.param("cuda", marks=cuda)]
TWO_GPUS = ["cpu", pytest.param("cuda", marks=two_gpus)]


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


def _function_modes() -> int:
    """How many torch-function modes are active on this thread: torch's private counter, or
    the length of the mode stack where a torch version lacks the counter."""
    count = getattr(torch._C, "_len_torch_function_stack", None)
    if count is not None:
        return count()
    return len(torch.overrides._get_current_function_mode_stack())


def test_the_mode_count_works_with_and_without_the_private_counter(monkeypatch):
    assert _function_modes() == 0
    with torch.device("meta"):
        assert _function_modes() == 1
    monkeypatch.delattr(torch._C, "_len_torch_function_stack", raising=False)
    assert _function_modes() == 0
    with torch.device("meta"):
        assert _function_modes() == 1


def _inside() -> tuple[int, str, str, str]:
    # a device mode would show as an active mode and would move plain torch factories
    return (_function_modes(), torch.ones(1).device.type, torch.get_default_device().type,
            str(mt.current().device))


def _fake_gpus(monkeypatch) -> dict[int, str]:
    """Thread-processors get the ``meta`` device when asked for CUDA; what each asked for."""
    asked: dict[int, str] = {}

    def fake(spec, comm):
        asked[comm.rank] = spec
        return torch.device("meta")

    monkeypatch.setattr(launch_threads, "resolve_device", fake)
    return asked


def test_no_device_mode_wraps_the_program(monkeypatch):
    """The program runs with no torch-function mode: a processor on a device pays no Python
    per torch call, optimizers keep their step counters on the host, and torch.compile
    sees no mode. Plain torch factories stay where torch puts them."""
    asked = _fake_gpus(monkeypatch)
    assert mt.launch(_inside, mesh="b:2", device="cuda") == [(0, "cpu", "cpu", "meta")] * 2
    assert asked == {0: "cuda", 1: "cuda"}
    assert mt.launch(_inside, mesh="b:1", device="cuda") == [(0, "cpu", "cpu", "meta")]  # no thread
    # the torch backend's processes: checked by test_torch_backend_equals_threads (one spawn)


def _made_on_the_device(positions: str) -> tuple[dict[str, str], str]:
    """Where meshtorch's factories, a Transformer's masks, positions and tables, and a whole
    training step (forward, backward, AdamW) put their tensors."""
    from meshtorch.context import processor_device
    from meshtorch.models import DecoderLM, TransformerConfig
    from meshtorch.models.layers import causal_bias, rotary_tables

    dense = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2))
    made = {
        "zeros": mt.zeros("a:4"), "full": mt.full("a:4", 2.0), "range": mt.range(mt.Dim("a", 4)),
        "normal": mt.random.normal("a:4", seed=1), "bernoulli": mt.random.bernoulli("a:4", seed=1),
        "uniform_whole": mt.random.uniform_whole("a:4", seed=1), "kernel": dense.kernel,
        "bias": dense.bias, "host tensor laid out": mt.from_global(torch.ones(4), "a:4"),
        "causal_bias": causal_bias(4), "rotary": rotary_tables(4, 4, "length")[0],
    }
    cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=8,
                            positions=positions)
    model = DecoderLM(cfg, seed=0)
    ids = mt.from_global(torch.arange(16, device=processor_device()).reshape(2, 8) % 16, "batch:2,length:8")
    made["loss"] = loss = model.loss(ids, ids)  # an elementwise op mixing in a host tensor raises
    loss.backward()
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    made.update({f"grad {n}": p.grad for n, p in model.named_parameters()})
    made.update({f"adam {k}": v for s in opt.state.values() for k, v in s.items() if k != "step"})
    return {k: v.device.type for k, v in made.items()}, processor_device().type


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_factories_put_tensors_on_the_processors_device(monkeypatch, positions):
    """``meta`` stands in for a GPU: everything meshtorch makes lands on it without a device
    mode, and the step runs there (a stray host tensor would fail the step's elementwise ops)."""
    _fake_gpus(monkeypatch)
    for made, here in mt.launch(_made_on_the_device, positions, mesh="b:2,m:2",
                                rules="batch:b; heads:m; vocab:m", device="cuda"):
        assert here == "meta"
        assert made == dict.fromkeys(made, "meta")
    monkeypatch.undo()
    made, here = mt.launch(_made_on_the_device, positions, mesh="b:2", rules="batch:b")[0]
    assert here == "cpu" and made == dict.fromkeys(made, "cpu")


def _trainer_step(**options) -> tuple[str, set[str]]:
    from meshtorch.recipes.lm import TrainConfig
    from meshtorch.recipes.lm.steps import prepare

    base = dict(d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, batch=4, length=8, mesh="b:2",
                rules="batch:b", clip=1.0)
    cfg = TrainConfig.of(**{**base, **options})
    step, batch = prepare(cfg)  # the trainer's own strategy, warmed up by one step
    step.run([batch], 1)
    loss = step.model.loss(*batch)
    return loss.device.type, {p.device.type for p in step.model.parameters()}


# (an MoE model of 2 blocks: --moe-every 2 gives the second its experts)
@pytest.mark.parametrize("options", [{"precision": "bf16"},
                                     {"model": "moe", "optimizer": "adafactor", "layers": 2},
                                     {"model": "seq2seq", "positions": "learned"}])
def test_the_trainers_step_runs_on_the_processors_device(monkeypatch, options):
    """``meshtorch train``'s step (model, autocast, clipping, optimizer) makes no host tensor
    that meets the device's: on the ``meta`` stand-in such a mix raises."""
    _fake_gpus(monkeypatch)
    assert mt.launch(_trainer_step, mesh="b:2", rules="batch:b", device="cuda", **options) == \
        [("meta", {"meta"})] * 2


def _dense_and_adamw():
    model = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2))
    return model, torch.optim.AdamW(model.parameters())


def test_a_checkpoint_loads_onto_the_processors_device(monkeypatch, tmp_path):
    """Saved from CPU processors, loaded by processors on a device: the parameters and the
    optimizer's moments land there; AdamW's step counter stays on the host, where
    torch.optim keeps it (a counter on the GPU would cost a host sync per parameter)."""
    path = str(tmp_path / "ckpt")

    def save():
        model, opt = _dense_and_adamw()
        mt.reduce_sum(model(mt.ones("batch:2,d:4"))).backward()
        opt.step()
        mt.save(path, model=model, optimizer=opt, step=1)

    def load():
        model, opt = _dense_and_adamw()
        mt.load(path, model=model, optimizer=opt)
        return {p.device.type for p in model.parameters()}, \
            {k: v.device.type for s in opt.state.values() for k, v in s.items()}

    mt.launch(save, mesh="b:2", rules="h:b")
    _fake_gpus(monkeypatch)
    assert mt.launch(load, mesh="b:2", rules="h:b", device="cuda") == \
        [({"meta"}, {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"})] * 2


def test_launch_leaves_the_callers_default_device_alone(monkeypatch):
    _fake_gpus(monkeypatch)
    mt.launch(lambda: mt.zeros("a:2"), mesh="b:2", device="cuda")
    assert torch.ones(1).device.type == "cpu" and torch.get_default_device().type == "cpu"


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


# ------------------------------------------- values: on the CPU everywhere, on CUDA where there is one
def _mlp_step(rules: str):
    """Loss and the global gradient of a 2-layer MLP on a fixed batch (fp32)."""
    x = mt.from_global(torch.arange(32.0).reshape(8, 4) / 32, "batch:8,d:4")  # a host batch, moved
    l1 = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 8)).reset_parameters(seed=1)
    l2 = mt.nn.Dense(mt.Dim("h", 8), mt.Dim("o", 2)).reset_parameters(seed=2)
    loss = mt.reduce_sum(l2(mt.relu(l1(x))) ** 2)
    loss.backward()
    return loss.to_global().item(), l1.kernel.mesh_tensor.grad.to_global().cpu(), l1.kernel.device.type


@pytest.mark.parametrize("device", ONE_GPU)
def test_one_processor_step_equals_the_cpu(device):
    want_loss, want_grad, dev = mt.launch(_mlp_step, "", mesh="b:1")[0]
    loss, grad, gdev = mt.launch(_mlp_step, "", mesh="b:1", device=device)[0]
    assert (dev, gdev) == ("cpu", device)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ONE_GPU)
def test_bf16_autocast_on_the_device(device):
    def f():
        x = mt.ones("batch:2,d:4")
        with mt.autocast(torch.bfloat16):
            y = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2))(x)
        return y.dtype, y.device.type

    assert mt.launch(f, mesh="b:1", device=device) == [(torch.bfloat16, device)]


def _float32_loss(ignore: int):
    """Mean ``mt.cross_entropy`` of float32 logits [48, 1000] (a few ids ``ignore``d), its gradient
    (on the host), and how many calls the loss's generated kernels answered."""
    from meshtorch.ops.cross_entropy_rows import _Kernels

    before = _Kernels.compiled_calls
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 1000, generator=g) * 3
    ids = torch.randint(0, 1000, (48,), generator=g)
    ids[::7] = ignore
    logits = mt.from_global(x, "batch:48,vocab:1000").requires_grad_()
    loss = mt.reduce_mean(mt.cross_entropy(logits, mt.from_global(ids, "batch:48"), ignore_index=ignore,
                                           reduction="none"))
    loss.backward()
    return loss.item(), logits.grad.to_global().cpu(), _Kernels.compiled_calls - before, x, ids


@pytest.mark.parametrize("device", ONE_GPU)
def test_float32_loss_on_the_device_is_torchs(device):
    """Float32 logits take ``cross_entropy_rows`` on the CPU (chunks) and on CUDA (the generated
    kernels, forward and backward: measured 2x faster there than log_softmax and gather, with a
    third of the memory): loss and gradient are float64 torch's to float32 rounding on either."""
    loss, grad, kernel_calls, x, ids = mt.launch(_float32_loss, -100, mesh="b:1", device=device)[0]
    x64 = x.double().requires_grad_()
    valid = ids != -100
    want = torch.nn.functional.cross_entropy(x64, ids, ignore_index=-100, reduction="none").sum() / 48
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(grad.double(), x64.grad, rtol=1e-5, atol=1e-7)
    assert valid.sum() < 48 and kernel_calls == (2 if device == "cuda" else 0)


@pytest.mark.parametrize("device", TWO_GPUS)
@pytest.mark.parametrize("rules", ["batch:b", "h:b", "batch:b; h:b"])
def test_threads_across_devices_equal_one_cpu(device, rules):
    """Collectives between thread-processors on different devices (all_reduce, all_gather,
    reduce_scatter) move the data across devices and give one CPU processor's values."""
    want_loss, want_grad, _ = mt.launch(_mlp_step, "", mesh="b:1")[0]
    for loss, grad, dev in mt.launch(_mlp_step, rules, mesh="b:2", rules=rules, device=device):
        assert dev == device
        assert loss == pytest.approx(want_loss, rel=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)


def _collectives():
    comm = mt.current().comm
    here = mt.current().device
    t = torch.arange(4.0, device=here).reshape(2, 2) + 10 * comm.rank
    checked = True
    try:  # the mismatch check gathers its digests on the device too
        comm.all_reduce(torch.ones(2 + comm.rank, device=here), "b")
        checked = False
    except mt.errors.CommError:
        pass
    return (comm.all_reduce(t, "b").cpu(), comm.all_gather(t, "b", 0).cpu(),
            comm.all_to_all(t, "b", 0, 1).cpu(), comm.shift(t, "b", 1, wrap=True).cpu(), checked,
            t.device.type, _inside())


@pytest.mark.parametrize("device", TWO_GPUS)
def test_torch_backend_equals_threads(device):
    """gloo on the CPU, NCCL on CUDA, against the threads backend on the CPU; the torch
    backend's processors run their program with no device mode either."""
    want = mt.launch(_collectives, mesh="b:2", check=True)
    got = mt.launch(_collectives, mesh="b:2", check=True, backend="torch", device=device)
    here = "cpu" if device == "cpu" else "cuda:"
    for rank, (w, g) in enumerate(zip(want, got)):
        for a, b in zip(w[:4], g[:4]):
            torch.testing.assert_close(b, a)
        assert g[4:6] == (True, device)
        assert g[6] == (0, "cpu", "cpu", here + ("" if device == "cpu" else str(rank)))


def _replicated_linear(device: str):
    repl = mt.Replicator(device=device)
    with repl.context():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)  # on the device, its weights drawn from the CPU generator
    opt = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.arange(8.0).reshape(2, 4) / 8
    repl.run(lambda b: model(b).pow(2).sum().backward(), lambda ctx: x)
    opt.step()
    return model.weight.detach().cpu(), model.weight.device.type


@pytest.mark.parametrize("device", ONE_GPU)
def test_replicator_on_the_device_equals_the_cpu(device):
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 1)  # the reference: plain PyTorch on the CPU, one replica
    x = torch.arange(8.0).reshape(2, 4) / 8
    plain(x).pow(2).sum().backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    (w, dev), = mt.replicator.launch_replicas(_replicated_linear, device, num_replicas=1)
    assert dev == device
    torch.testing.assert_close(w, plain.weight.detach(), rtol=1e-5, atol=1e-6)


def _decode():
    from meshtorch.models import DecoderLM, TransformerConfig, beam_search, generate

    cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=10)
    model = DecoderLM(cfg, seed=5)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    greedy = generate(model, prompts, 5)
    eos = [greedy[0][1], greedy[2][3]]  # beams that end at different steps
    return (greedy, generate(model, prompts, 5, temperature=1.0, top_k=6, seed=2),
            beam_search(model, prompts, 3, beams=2), beam_search(model, prompts, 5, beams=2, eos=eos))


@pytest.mark.parametrize("device", ONE_GPU)
def test_decoding_on_the_device_equals_the_cpu(device):
    """Greedy, sampled and beam-search decoding (with eos ids too) run on the device (sampling draws
    its noise from mt.random, not a device generator) and pick the CPU's tokens."""
    want = mt.launch(_decode)[0]
    assert mt.launch(_decode, mesh="b:1", device=device) == [want]
    assert want[1] != want[0]  # the sampled tokens are not the greedy ones at this seed


@pytest.mark.parametrize("device", TWO_GPUS)
def test_split_decoding_on_the_devices_equals_the_cpu(device):
    """The same decoding with the batch and the vocabulary split over two processors (two GPUs:
    the threads backend puts one processor on each) picks the one-processor CPU tokens."""
    want = mt.launch(_decode)[0]
    assert mt.launch(_decode, mesh="b:2", rules="batch:b; vocab:b", device=device) == [want] * 2


@pytest.mark.parametrize("device", ONE_GPU)
def test_pick_is_gumbel_max_of_mt_random_noise(device):
    """Sampling is the argmax of logits + temperature * Gumbel(u) for u = mt.random's uniform
    numbers over [batch, vocab]; row i's noise does not depend on how many rows there are."""
    from meshtorch.models.decode import pick

    logits = torch.linspace(-2.0, 2.0, 3 * 7).reshape(3, 7)
    u = mt.random.uniform("batch:3,vocab:7", seed=4, stream=1, dtype=torch.float64).to_global()
    want = (logits.double() - 0.8 * torch.log(-torch.log(u))).argmax(-1)
    got = pick(logits.to(device), 0.8, seed=4, stream=1)
    assert got.device.type == device
    assert torch.equal(got.cpu(), want)
    assert torch.equal(pick(logits[:2].to(device), 0.8, seed=4, stream=1).cpu(), want[:2])


@pytest.mark.parametrize("device", ONE_GPU)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_meshtorch_train_on_the_device(tmp_path, device, compiled):
    """``meshtorch train`` end to end (steps, held-out loss, sampling) on the device, with and without
    ``--compile``, bf16: the CPU's eager run's losses."""
    from meshtorch.recipes.lm import TrainConfig, train

    data = tmp_path / "data.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 400)
    opts = dict(d_model=32, heads=2, d_kv=16, d_ff=64, layers=1, batch=4, length=16, steps=3, log_every=3,
                eval_batches=1, sample_tokens=4, mesh="b:1", rules="", data=str(data), progress=False,
                precision="bf16")
    cpu = train(TrainConfig.of(**opts, device="cpu", out=str(tmp_path / "reference")))
    # on the CPU the eager reference is the eager run (a second one would only cost the suite time)
    same = device == "cpu" and not compiled
    run = str(tmp_path / "run")
    got = cpu if same else train(TrainConfig.of(**opts, device=device, compile=compiled, out=run))
    assert (cpu["device"], got["device"]) == ("cpu", "cpu" if device == "cpu" else "cuda:0")
    assert got["final_loss"] == pytest.approx(cpu["final_loss"], rel=1e-2 if device == "cuda" else 1e-3)
    assert got.get("sample"), got.keys()

