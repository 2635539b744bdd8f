"""bf16 planning: the meta backend's autocast casts as CPU autocast does, op by op, and a planned
bf16 training step has the collectives, FLOPs and memory of a real bf16 step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import meshtorch as mt
from meshtorch.meta_autocast import MetaAutocast, autocast_enabled
from meshtorch.plan import trace
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import prepare, training_step

IDS = torch.tensor([1, 2, 0, 3])

# (op, inputs as shapes): matmuls, losses, promotion, and ops autocast leaves alone
OPS = {
    "mm": (torch.mm, [(4, 4), (4, 4)]),
    "bmm": (torch.bmm, [(2, 4, 4), (2, 4, 4)]),
    "matmul": (lambda a, b: a @ b, [(4, 4), (4, 4)]),
    "linear": (F.linear, [(4, 4), (4, 4)]),
    "addmm": (torch.addmm, [(4, 4), (4, 4), (4, 4)]),
    "baddbmm": (torch.baddbmm, [(2, 4, 4), (2, 4, 4), (2, 4, 4)]),
    "einsum": (lambda a, b: torch.einsum("ij,jk->ik", a, b), [(4, 4), (4, 4)]),
    "tensordot": (lambda a, b: torch.tensordot(a, b, 1), [(4, 4), (4, 4)]),
    "sdpa": (F.scaled_dot_product_attention, [(2, 4, 4), (2, 4, 4), (2, 4, 4)]),
    "cross_entropy": (lambda a: F.cross_entropy(a, IDS.to(a.device)), [(4, 4)]),
    "mse_loss": (F.mse_loss, [(4, 4), (4, 4)]),
    "prod": (torch.prod, [(4, 4)]),
    "cat": (lambda a, b: torch.cat([a, b]), [(4, 4), (4, 4)]),
    "stack": (lambda a, b: torch.stack([a, b]), [(4, 4), (4, 4)]),
    "add": (torch.add, [(4, 4), (4, 4)]),
    "softmax": (lambda a: a.softmax(-1), [(4, 4)]),
    "layer_norm": (lambda a: F.layer_norm(a, (4,)), [(4, 4)]),
    "logsumexp": (lambda a: a.logsumexp(-1), [(4, 4)]),
    "gelu": (F.gelu, [(4, 4)]),
}
DTYPES = [torch.float32, torch.bfloat16]


def run(op: str, dtypes: list[torch.dtype], device: str):
    """The output dtype and the inputs' gradient dtypes of ``op`` under autocast on ``device``
    (or the error it raises)."""
    fn, shapes = OPS[op]
    xs = [torch.randn(s, device=device, dtype=d, requires_grad=True) for s, d in zip(shapes, dtypes)]
    ctx = MetaAutocast(torch.bfloat16) if device == "meta" else torch.autocast("cpu", dtype=torch.bfloat16)
    try:
        with ctx:
            y = fn(*xs)
    except RuntimeError as e:  # tensordot of mixed dtypes
        return "raises", str(e)
    y.float().sum().backward()
    return y.dtype, [x.grad.dtype for x in xs]


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("first", DTYPES)
@pytest.mark.parametrize("rest", DTYPES)
def test_dtypes_forward_and_backward_equal_cpu_autocast(op, first, rest):
    dtypes = [first] + [rest] * (len(OPS[op][1]) - 1)
    assert run(op, dtypes, "meta") == run(op, dtypes, "cpu")


class CountCasts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_parameter_used_twice_is_cast_once(device):
    w = torch.nn.Parameter(torch.randn(4, 4, device=device))
    x = torch.randn(2, 4, device=device)
    ctx = MetaAutocast(torch.bfloat16) if device == "meta" else torch.autocast("cpu", dtype=torch.bfloat16)
    with CountCasts() as count, ctx:
        x @ w
        x @ w          # cached: no second cast of w
        x @ w.t()      # a view of w is not cached
    assert count.casts == 1 + 1 + 1 + 2  # w once, x three times, w.t() once
    assert autocast_enabled("meta") is False


VOCAB = 16
BASE = TrainConfig.of(batch=4, length=8, d_model=8, heads=4, d_kv=4, d_ff=16, layers=2, encoder_layers=1,
                      experts=4, top_k=2, precision="bf16", optimizer="adamw")
CASES = [("lm", "b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m"),
         ("moe", "b:2,m:2", "batch:b; experts:b; d_ff:m"),
         ("seq2seq", "b:4", "batch:b; d_model:b")]


def real_step(cfg: TrainConfig, mesh: str, rules: str) -> tuple[dict, int]:
    """A real bf16 step on the threads backend, without the planner's tracer: its collectives as
    the communicator counts them, and its FLOPs as torch's FlopCounterMode counts them."""

    def program():
        step, batch = prepare(cfg, VOCAB)
        before = mt.comm_stats().copy()
        with FlopCounterMode(display=False) as flops:
            step.run([batch], 1)
        return (mt.comm_stats() - before).as_dict(), flops.get_total_flops()

    return mt.launch(program, mesh=mesh, rules=rules, backend="threads")[0]


@pytest.mark.parametrize("model, mesh, rules", CASES)
def test_a_planned_bf16_step_is_a_real_bf16_step(model, mesh, rules):
    cfg = BASE.replace(model=model)
    comm, flops = real_step(cfg, mesh, rules)
    planned = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules)
    assert planned.comm.as_dict() == comm
    # every matmul runs in bf16, the same FLOPs as in fp32
    fp32 = trace(training_step(cfg.replace(precision="fp32"), VOCAB), mesh=mesh, rules=rules)
    assert planned.flops_by_dtype == {"bfloat16": flops} and fp32.flops_by_dtype == {"float32": flops}
    # bf16 activations: fewer bytes moved and held than in fp32, parameters and their state the same;
    # the FSDP case communicates only fp32 parameters, their gradients and the (fp32) loss: same bytes
    if "d_model:b" in rules:
        assert planned.comm.bytes() == fp32.comm.bytes()
    else:
        assert planned.comm.bytes() < fp32.comm.bytes()
    assert planned.peak_bytes < fp32.peak_bytes
    measured = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules, backend="threads")
    assert planned.peak_by_kind == measured.peak_by_kind and planned.peak_bytes == measured.peak_bytes
    # (gradients are not compared: under mt.overlap, the default, the bf16 step's peak may come at
    # another moment than the fp32 one's, when other gradients are alive)
    for kind in ("parameters", "optimizer"):
        assert planned.peak_by_kind[kind] == fp32.peak_by_kind[kind]
