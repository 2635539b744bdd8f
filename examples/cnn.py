"""A small CNN with its images split by height over one mesh axis and by batch over another.

Run it:  python examples/cnn.py

Mesh-TF's spatial partitioning: with the rules ``"batch:d; h:s"`` on the mesh ``d:2,s:2``, each
processor holds half the images and half of every image's rows. A 3x3 convolution then needs one
row from each neighbour along ``s`` (the halo exchange), the 2x2 max pool none (its windows fall
within a slice), and the weights' gradients are summed over both axes. The losses are those of
the one-processor run, step for step.

The images are scikit-learn's 8x8 digits when scikit-learn is installed, else synthetic 8x8
images of four stroke patterns with noise.
"""

from __future__ import annotations

import torch

import meshtorch as mt

BATCH, SIDE, CLASSES = 32, 8, 10


def load_images(n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images ``[n, 8, 8, 1]`` scaled to about [0, 1], and their labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return _synthetic(n)
    digits = load_digits()
    images = torch.tensor(digits.images[:n], dtype=torch.float32).unsqueeze(-1) / 16.0
    return images, torch.tensor(digits.target[:n], dtype=torch.int64)


def _synthetic(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(n) % 4
    rows, cols = torch.meshgrid(torch.arange(SIDE), torch.arange(SIDE), indexing="ij")
    patterns = torch.stack([(rows % 3 == 0), (cols % 3 == 0), (rows == cols) | (rows == SIDE - 1 - cols),
                            (rows + cols) % 2 == 0]).float()
    images = patterns[labels] + 0.3 * torch.randn(n, SIDE, SIDE, generator=g)
    return images.unsqueeze(-1), labels


class SmallCNN(mt.nn.Module):
    """conv 3x3 (1 -> 8) -> relu -> max pool 2x2 -> conv 3x3 (8 -> 16) -> relu -> mean over the
    image -> dense to the classes."""

    def __init__(self):
        super().__init__()
        self.conv1 = mt.nn.MeshParameter("kh:3,kw:3,c:1,f1:8", "normal", std=0.5)
        self.conv2 = mt.nn.MeshParameter("kh:3,kw:3,f1:8,f2:16", "normal", std=0.15)
        self.head = mt.nn.Dense(mt.Dim("f2", 16), mt.Dim("classes", CLASSES))

    def forward(self, x: mt.MeshTensor) -> mt.MeshTensor:
        y = mt.relu(mt.conv2d(x, self.conv1.mesh_tensor))
        y = mt.max_pool(y, ("h", "w"), 2)
        y = mt.relu(mt.conv2d(y, self.conv2.mesh_tensor))
        return self.head(mt.reduce_mean(y, dims=["h", "w"]))


def train(steps: int = 20, lr: float = 0.1) -> list[float]:
    """Train ``steps`` SGD steps on one batch; the loss of each step (the same on every mesh)."""
    images, labels = load_images()
    x = mt.from_global(images, f"batch:{BATCH},h:{SIDE},w:{SIDE},c:1")
    y = mt.from_global(labels, f"batch:{BATCH}")
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = mt.cross_entropy(model(x), y, "classes", reduction="mean")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    one = mt.launch(train)[0]
    split = mt.launch(train, mesh="d:2,s:2", rules="batch:d; h:s")[0]
    for step in (0, len(one) // 2, len(one) - 1):
        print(f"step {step:2d}: loss {one[step]:.5f} on 1 processor, {split[step]:.5f} on d:2,s:2 "
              "(batch over d, image height over s)")
    print(f"largest difference over {len(one)} steps: {max(abs(a - b) for a, b in zip(one, split)):.2e}")


if __name__ == "__main__":
    main()
