"""Data parallel's gradients under ``mt.overlap()`` are views of their bucket's all-reduced flat
buffer (on gloo, which reduces in place, the buffer the gradients were packed into; DDP's
``gradient_as_bucket_view``): whatever the user does with them (keeps them, a view of them,
saves them, clips them in place, zeroes them, accumulates into them, runs backward twice,
changes the model's dtype, sets some gradients) sees the values of the per-use path, bitwise, and
a gradient held from an earlier step keeps its values (no buffer is used again under it).

Reference: the same steps with ``mt.overlap(enabled=False)`` (the per-use path, whose equivalence
with one processor other tests hold), and the values a held gradient had when it was taken.
"""

from __future__ import annotations

import functools
import io

import pytest
import torch

import meshtorch as mt
from meshtorch.lowering import overlap_buckets
from meshtorch.models import DecoderLM, TransformerConfig

BATCH, LENGTH, STEPS = 4, 6, 4
# one xdist worker runs the module: its fixture launches gloo processes once
pytestmark = pytest.mark.xdist_group("test_overlap_aliasing")
CASES = ("plain", "keep", "view", "clip", "zeros", "accumulate", "twice", "double", "some")


def config() -> TransformerConfig:
    return TransformerConfig(vocab=32, d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, max_length=LENGTH,
                             tie_embeddings=True, positions="rotary")


def batch(seed: int):
    data = torch.randint(0, 32, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(seed))
    shape = f"batch:{BATCH},length:{LENGTH}"
    return mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape)


def steps(on: bool, case: str) -> dict:
    """``STEPS`` SGD steps of data parallel, the user doing ``case`` with the gradients: every
    step's local gradients (copies taken right after its backward), the gradients held from
    step 1 as they are at the end, as they were when taken and as saved then."""
    model = DecoderLM(config(), seed=0)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    seen, held, taken, saved = [], [], [], None
    for step in range(STEPS):
        if case == "zeros":
            opt.zero_grad(set_to_none=False)
        elif case != "accumulate" or step % 2 == 0:  # accumulate: two backwards a step
            opt.zero_grad(set_to_none=True)
        if case == "some":  # one parameter's gradient set (zeros), its bucket's others None
            params[len(params) // 2].grad = torch.zeros_like(params[len(params) // 2])
        if case == "double" and step == 2:
            model.double()  # `p.data = ...`: new storages, new leaves, a new cut
        with mt.overlap(enabled=on):
            loss = model.loss(*batch(step))
            if case == "twice":
                loss.local.backward(retain_graph=True)
            loss.local.backward()
        if step == 1 and case in ("keep", "view"):
            held = [p.grad if case == "keep" else p.grad.view(-1)[:3] for p in params]
            taken = [g.clone() for g in held]
            buffer = io.BytesIO()
            torch.save(held, buffer)
            saved = buffer.getvalue()
        if case == "clip":
            torch.nn.utils.clip_grad_norm_(params, 0.01)  # in place, into the buffer's views
        seen.append([p.grad.clone() for p in params])
        if case != "accumulate" or step % 2 == 1:
            opt.step()
    loaded = torch.load(io.BytesIO(saved)) if saved is not None else []
    return {"seen": seen, "held": [g.clone() for g in held], "taken": taken, "loaded": loaded}


def _all(on: bool) -> dict:
    return {case: steps(on, case) for case in CASES}


@pytest.fixture(scope="module")
def gloo() -> dict:
    """Every case on gloo (in place: the gradients are views of the packed buffers), per-use and
    overlapped, processor 0's."""
    return {on: mt.launch(functools.partial(_all, on), mesh="b:2", rules="batch:b", backend="torch",
                          timeout=120)[0] for on in (False, True)}


@pytest.mark.parametrize("case", CASES)
def test_gradients_viewing_the_bucket_are_the_per_use_ones_whatever_the_user_does(gloo, case):
    off, on = gloo[False][case], gloo[True][case]
    for step, (a, b) in enumerate(zip(on["seen"], off["seen"])):
        assert len(a) == len(b) > 0
        for i, (x, y) in enumerate(zip(a, b)):
            assert x.dtype == y.dtype and torch.equal(x, y), (case, step, i)
    # a gradient held from step 1 keeps its values: its buffer is not used again under it
    for held, taken, loaded in zip(on["held"], on["taken"], on["loaded"], strict=True):
        assert torch.equal(held, taken) and torch.equal(loaded, taken), case


def test_without_torchs_unflatten_the_gradients_are_the_same(monkeypatch):
    """Without the private ``torch._C._nn.unflatten_dense_tensors`` a bucket's result is split
    and viewed piece by piece: the same gradients, bitwise."""
    off = mt.launch(functools.partial(steps, False, "plain"), mesh="b:2", rules="batch:b")[0]
    on = mt.launch(functools.partial(steps, True, "plain"), mesh="b:2", rules="batch:b")[0]
    monkeypatch.setattr(overlap_buckets, "_unflatten", None)  # (threads: this process's module)
    bare = mt.launch(functools.partial(steps, True, "plain"), mesh="b:2", rules="batch:b")[0]
    for a, b, c in zip(off["seen"], on["seen"], bare["seen"], strict=True):
        for x, y, z in zip(a, b, c, strict=True):
            assert torch.equal(x, y) and torch.equal(x, z) and x.shape == z.shape
