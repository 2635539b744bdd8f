"""distribute(): disjoint shares, padding masked, every example counted once per epoch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.replicator.data import ReplicaLoader


@settings(max_examples=25, deadline=None)
@given(n_examples=st.integers(1, 60), replicas=st.sampled_from([1, 2, 3, 4]), per=st.integers(1, 5),
       shuffle=st.booleans())
def test_every_example_once_per_epoch(n_examples, replicas, per, shuffle):
    data = torch.arange(n_examples) * 10
    loaders = [ReplicaLoader(data, per * replicas, r, replicas, shuffle=shuffle, seed=7)
               for r in range(replicas)]
    counted: Counter = Counter()
    for loader in loaders:
        assert len(loader) == -(-n_examples // (per * replicas))
        batches = list(loader)
        assert len(batches) == len(loader)        # every replica takes the same number of steps
        for x, mask in batches:
            assert x.shape == (per,) and mask.shape == (per,)
            for v, m in zip(x.tolist(), mask.tolist()):
                counted[v] += m
    assert counted == Counter({10 * i: 1.0 for i in range(n_examples)})


def test_shuffle_changes_per_epoch_and_agrees_between_replicas():
    data = torch.arange(12)
    a, b = ReplicaLoader(data, 4, 0, 2, shuffle=True), ReplicaLoader(data, 4, 1, 2, shuffle=True)
    e0 = [x.tolist() for x, _ in a] + [x.tolist() for x, _ in b]
    e1 = [x.tolist() for x, _ in a] + [x.tolist() for x, _ in b]
    assert sorted(sum(e0, [])) == list(range(12)) and e0 != e1


def test_map_style_dataset_and_tuple_of_tensors():
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return {"x": torch.tensor(float(i)), "y": i * i}

    (batch, mask), *_ = ReplicaLoader(Squares(), 4, 1, 2)
    assert batch["x"].tolist() == [2.0, 3.0] and batch["y"].tolist() == [4, 9] and mask.tolist() == [1, 1]
    (x, y), _ = next(iter(ReplicaLoader((torch.arange(3), -torch.arange(3)), 2, 1, 2)))
    assert x.tolist() == [1] and y.tolist() == [-1]


def test_errors():
    with pytest.raises(mt.errors.MeshError, match="multiple of the 3 replicas"):
        ReplicaLoader(torch.arange(4), 4, 0, 3)
    with pytest.raises(mt.errors.MeshError, match="different first sizes"):
        ReplicaLoader((torch.arange(4), torch.arange(3)), 2)
    with pytest.raises(mt.errors.MeshError, match="sized dataset"):
        ReplicaLoader(iter(range(3)), 2)


def test_epoch_accuracy_over_replicas_counts_every_example_once():
    """37 examples, global batch 8 (5 steps, 3 padded): accuracy and loss over an epoch from
    repl.reduce equal those of one process over the whole dataset."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(37, 4, generator=g), torch.randint(0, 3, (37,), generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        logits = model(x)
    expect_acc = (logits.argmax(1) == y).double().mean().item()
    expect_loss = torch.nn.functional.cross_entropy(logits, y).item()

    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            net = torch.nn.Linear(4, 3)
        loader = repl.distribute((x, y), global_batch_size=8)
        correct = count = loss = 0.0

        def eval_step(batch):
            (xb, yb), mask = batch
            with torch.no_grad():
                out = net(xb)
            per_example = torch.nn.functional.cross_entropy(out, yb, reduction="none")
            return ((out.argmax(1) == yb).float() * mask).sum(), (per_example * mask).sum(), mask.sum()

        it = iter(loader)
        for _ in range(len(loader)):
            c, l, m = repl.reduce("sum", repl.run(eval_step, it))
            correct, loss, count = correct + c.item(), loss + l.item(), count + m.item()
        return correct / count, loss / count, count

    for acc, loss, count in mt.replicator.launch_replicas(prog, num_replicas=4):
        assert count == 37
        assert acc == pytest.approx(expect_acc, abs=1e-12)
        assert loss == pytest.approx(expect_loss, rel=1e-5)
