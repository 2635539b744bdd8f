"""Train a small CNN data-parallel with the Replicator on a generated image dataset.

The dataset is made here (no download): ten classes of 16x16 grey images, each
class a fixed random stroke pattern, shown at a random offset under noise.
Every replica builds the same plain ``torch.nn`` model, takes its share of
each global batch, and the Replicator averages gradients and BatchNorm
statistics over the replicas.

Run it:
    python examples/replicator_cnn.py                 # 2 thread replicas (or one per GPU)
    python examples/replicator_cnn.py --replicas 4
    meshtorch launch -n 2 --mesh replica:2 --backend torch examples/replicator_cnn.py  # a process each
    torchrun --nproc-per-node 2 examples/replicator_cnn.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import meshtorch as mt


def make_dataset(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy, shifted 16x16 images of ten class patterns, and their labels."""
    templates = (torch.rand(10, 12, 12, generator=torch.Generator().manual_seed(0)) > 0.7).float()
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.zeros(n, 1, 16, 16)
    offsets = torch.randint(0, 5, (n, 2), generator=g)
    for i in range(n):
        r, c = offsets[i].tolist()
        images[i, 0, r:r + 12, c:c + 12] = templates[labels[i]]
    images += 0.5 * torch.randn(images.shape, generator=g)
    return images, labels


class Net(torch.nn.Module):
    """A plain torch CNN: nothing in it knows about replicas."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(32)
        self.fc = torch.nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def main(epochs: int = 4, global_batch: int = 64) -> float:
    repl = mt.Replicator(device="auto")
    with repl.context():
        model = repl.convert_sync_batchnorm(Net())
        opt = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=3e-3))
    train = repl.distribute(make_dataset(2000, seed=1), global_batch, shuffle=True)
    test = repl.distribute(make_dataset(500, seed=2), 100)   # 500 = 5 x 100: no padding needed

    def train_step(batch):
        (x, y), mask = batch
        model.train()
        per_example = F.cross_entropy(model(x), y, reduction="none")
        # padded examples weigh 0; dividing by the global count makes the replicas' mean
        # the mean over the real examples of the global batch
        count = repl.reduce("sum", mask.sum())
        loss = (per_example * mask).sum() * repl.num_replicas / count
        opt.zero_grad()
        loss.backward()
        opt.step()
        return (per_example.detach() * mask).sum()

    def eval_step(batch):
        (x, y), mask = batch
        model.eval()
        with torch.no_grad():
            hits = (model(x).argmax(1) == y).float()
        return (hits * mask).sum(), mask.sum()

    accuracy = 0.0
    for epoch in range(epochs):
        it = iter(train)
        loss_sum = sum(repl.reduce("sum", repl.run(train_step, it)).item() for _ in range(len(train)))
        it = iter(test)
        hits = total = 0.0
        for _ in range(len(test)):
            h, n = repl.reduce("sum", repl.run(eval_step, it))
            hits, total = hits + h.item(), total + n.item()
        accuracy = hits / total
        if repl.replica_id == 0:
            print(f"epoch {epoch + 1}: train loss {loss_sum / train.num_examples:.3f}  "
                  f"test accuracy {accuracy:.3f}  ({repl.num_replicas} replicas on {repl.device})",
                  flush=True)
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=None, help="default: one per GPU, else 2")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    n = args.replicas or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    mt.replicator.launch_replicas(main, args.epochs, num_replicas=n)
