"""``mt.overlap()`` under the training loops users write (beyond forward, backward, step):
accumulation with zeroed (not freed) gradients and a smaller last micro-batch, frozen and
unfrozen parameters, a branch taken in some steps, weight sharing, two losses or two forwards
in one backward, a retained graph, eval forwards between micro-batches, a forward that raises
or whose loss is dropped, backward after the block, two models (a GAN), ``autograd.grad`` with
respect to activations and inputs.

References: the same loop with ``mt.overlap(enabled=False)`` (the per-use path: bitwise for
data parallel, and for FSDP where each parameter has one use per backward; else to float
addition order) and on one processor (to float rounding): losses, global gradients of every
step, final parameters.
"""

from __future__ import annotations

import functools

import pytest
import torch

import meshtorch as mt

FSDP, DP = "batch:b; d_model:b", "batch:b"
MODES = ("off", "on", "reshard")


class Net(mt.nn.Module):
    def __init__(self):
        super().__init__()
        d, f = mt.Dim("d_model", 8), mt.Dim("d_ff", 16)
        self.l1, self.l2, self.l3, self.l4 = (mt.nn.Dense(d, f), mt.nn.Dense(f, d), mt.nn.Dense(d, f),
                                              mt.nn.Dense(f, d))

    def forward(self, x, branch=True, twice=False):
        y = self.l2(self.l1(x))
        if twice:  # l1 and l2 used twice: weight sharing
            y = self.l2(self.l1(y))
        return y + self.l4(self.l3(y)) if branch else y

    def loss(self, x, **kw):
        return mt.reduce_mean(self(x, **kw) ** 2)


def data(i: int, rows: int = 4) -> mt.MeshTensor:
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(i))
    return mt.from_global(x, f"batch:{rows},d_model:8")


def grads(*models) -> dict:
    return {f"{k}.{n}": None if p.grad is None else p.grad.to_global().clone()
            for k, m in enumerate(models) for n, p in m.named_mesh_parameters()}


def params(*models) -> dict:
    return {f"{k}.{n}": p.to_global() for k, m in enumerate(models) for n, p in m.named_mesh_parameters()}


# -------------------------------------------------------------- the loops (rec: what they log)
def accumulate(net, opt, block, rec):
    """zero_grad(set_to_none=False) (gradients kept, zeroed), micro-batches of 4, 4 and 2 rows."""
    with block():
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            for k, rows in enumerate((4, 4, 2)):
                loss = net.loss(data(10 * step + k, rows)) * (rows / 10)
                loss.backward()
                rec["loss"].append(loss.item())
            rec["grads"].append(grads(net))
            opt.step()


def frozen(net, opt, block, rec):
    """l1 frozen for two steps, then trained."""
    net.l1.requires_grad_(False)
    with block():
        for step in range(4):
            if step == 2:
                net.l1.requires_grad_(True)
            opt.zero_grad()
            loss = net.loss(data(step))
            loss.backward()
            rec["loss"].append(loss.item())
            rec["grads"].append(grads(net))
            opt.step()


def branch(net, opt, block, rec):
    """l3, l4 used on odd steps only (not in the first, whose reads plan the next); l1, l2 twice in
    the last."""
    with block():
        for step in range(4):
            opt.zero_grad()
            loss = net.loss(data(step), branch=step % 2 == 1, twice=step == 3)
            loss.backward()
            rec["loss"].append(loss.item())
            rec["grads"].append(grads(net))
            opt.step()


def two_losses(net, opt, block, rec):
    """Two forwards, one backward of a sum; then a retained graph's backward twice."""
    with block():
        for step in range(3):
            opt.zero_grad()
            if step == 1:
                loss = net.loss(data(step))
                loss.local.backward(retain_graph=True)  # (the local graph: the loss is replicated)
                loss.local.backward()
            else:
                loss = net.loss(data(step))
                (loss + 0.5 * net.loss(data(step + 100))).backward()
            rec["loss"].append(loss.item())
            rec["grads"].append(grads(net))
            opt.step()


def evaluate(net, opt, block, rec):
    """Between micro-batches: a no_grad forward, one in eval mode, one with grad never backwarded."""
    with block():
        for step in range(2):
            opt.zero_grad()
            for k in range(2):
                net.loss(data(10 * step + k)).backward()
                with torch.no_grad():
                    rec["loss"].append(net.loss(data(70 + k)).item())
                net.eval()
                rec["loss"].append(net.loss(data(80 + k)).item())
                net.train()
                rec["loss"].append(net.loss(data(90 + k)).item())
            rec["grads"].append(grads(net))
            opt.step()


class Boom(Exception):
    pass


def skipped(net, opt, block, rec):
    """A forward that raises midway (caught), and a loss dropped before backward (a NaN check)."""
    fail = [False]

    def pre(module, args):
        if fail[0]:
            raise Boom

    net.l3.register_forward_pre_hook(pre)
    with block():
        for step in range(4):
            opt.zero_grad()
            fail[0] = step == 1
            try:
                loss = net.loss(data(step))
            except Boom:
                continue
            if step == 2:
                continue
            loss.backward()
            rec["loss"].append(loss.item())
            rec["grads"].append(grads(net))
            opt.step()


def backward_after(net, opt, block, rec):
    """The forward inside the block, its backward after it."""
    for step in range(3):
        opt.zero_grad()
        with block():
            loss = net.loss(data(step))
        loss.backward()
        rec["loss"].append(loss.item())
        rec["grads"].append(grads(net))
        opt.step()


def logged(net, opt, block, rec):
    """The loss read before backward, its detached copy logged after, the gradients clipped."""
    with block():
        for step in range(3):
            opt.zero_grad()
            loss = net.loss(data(step))
            rec["loss"].append(loss.item())
            kept = loss.detach()
            loss.backward()
            rec["loss"].append(kept.item())
            rec["loss"].append(mt.optim.clip_grad_norm_(net, 0.05).item())
            rec["grads"].append(grads(net))
            opt.step()


def gan(net, opt, block, rec):
    """Two models: D's step on G's detached output, then G's through D (D's gradients dropped)."""
    torch.manual_seed(1)
    d = Net()
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    with block():
        for step in range(3):
            fake = net(data(step))
            opt_d.zero_grad()
            loss_d = mt.reduce_mean(d(fake.detach()) ** 2) + mt.reduce_mean((d(data(50 + step)) - 1) ** 2)
            loss_d.backward()
            opt_d.step()
            opt.zero_grad()
            loss_g = mt.reduce_mean((d(fake) - 1) ** 2)
            loss_g.backward()
            opt.step()
            rec["loss"] += [loss_d.item(), loss_g.item()]
            rec["grads"].append(grads(net, d))
    rec["d"] = params(d)


def hidden_gradient(net, opt, block, rec):
    """torch.autograd.grad of the loss with respect to an activation, then backward of the same graph."""
    with block():
        for step in range(3):
            opt.zero_grad()
            h = net.l1(data(step))
            loss = mt.reduce_mean(net.l4(net.l3(net.l2(h))) ** 2)
            (g,) = torch.autograd.grad(loss.local, h.local, retain_graph=True)
            rec["loss"].append(mt.MeshTensor(g, h.shape, h.layout).to_global())
            loss.backward()
            rec["loss"].append(loss.item())
            rec["grads"].append(grads(net))
            opt.step()


def penalty(net, opt, block, rec):
    """A gradient penalty: the input's gradient (create_graph=True) in the loss."""
    with block():
        for step in range(3):
            opt.zero_grad()
            x = data(step).requires_grad_(True)
            (g,) = torch.autograd.grad(mt.reduce_sum(net(x)).local, x.local, create_graph=True)
            loss = net.loss(data(step + 50)) + mt.reduce_mean((mt.MeshTensor(g, x.shape, x.layout) - 1) ** 2)
            loss.backward()
            rec["loss"].append(loss.item())
            rec["grads"].append(grads(net))
            opt.step()


LOOPS = {f.__name__: f for f in (accumulate, frozen, branch, two_losses, evaluate, skipped, backward_after,
                                 logged, gan, hidden_gradient, penalty)}
# a parameter used twice in one backward: its local gradients summed before one reduce_scatter
# (FSDP), not after two: equal to float addition order
SHARED = {"branch", "two_losses", "gan"}


def run(loop: str, modes=MODES) -> dict:
    """Each mode's log of ``loop`` (the same model and data each time)."""
    out = {}
    for mode in modes:
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        block = functools.partial(mt.overlap, enabled=mode != "off", reshard_after_forward=mode == "reshard",
                                  bucket_mb=1e-5, gather_mb=1e-5)  # (a bucket per parameter)
        rec: dict = {"loss": [], "grads": []}
        LOOPS[loop](net, opt, block, rec)
        rec["params"] = params(net)
        out[mode] = rec
    return out


def same(a, b, exact: bool, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], exact, f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, exact, f"{where}[{i}]")
    elif a is None or b is None:
        assert a is None and b is None, where
    elif exact:
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), where
    else:
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-4, atol=1e-5, msg=where)


@functools.cache
def dense(loop: str) -> dict:
    return mt.launch(run, loop, ("off",))[0]["off"]


CASES = [(loop, rules) for loop in LOOPS for rules in (DP, FSDP)]


@pytest.mark.parametrize("loop,rules", CASES)
def test_a_users_loop_has_the_per_use_and_one_processor_values(loop, rules):
    logs = mt.launch(run, loop, mesh="b:2", rules=rules, timeout=60)[0]
    for mode in ("on", "reshard"):
        same(logs[mode], logs["off"], exact=rules == DP or loop not in SHARED, where=mode)
        same(logs[mode], dense(loop), exact=False, where=f"{mode} vs one processor")


def parameter_gradients(on: bool) -> list:
    torch.manual_seed(0)
    net = Net()
    with mt.overlap(enabled=on):
        loss = net.loss(data(0))
        return [None if g is None else g.clone()
                for g in torch.autograd.grad(loss.local, list(net.parameters()), allow_unused=True)]


def test_autograd_grad_with_respect_to_parameters_sees_no_overlapped_gradient():
    """Inside ``mt.overlap()`` an op reads a leaf of its own, not the parameter: ``torch.autograd.grad``
    with respect to parameters finds them unused (None with allow_unused=True, as the docs say);
    outside, the per-use path gives the one-processor gradients."""
    (ref,) = mt.launch(parameter_gradients, False)
    for off, on in zip(*(mt.launch(parameter_gradients, on, mesh="b:2", rules=DP) for on in (False, True))):
        assert on == [None] * len(ref)
        same(off, ref, exact=False)
