"""Quickstart: one SPMD program, run on 1 processor and on a 2x2 mesh.

Run it:  python examples/quickstart.py

The program is written once, from one processor's view. Layout rules say
which named dims are split over which mesh axes; the values (and gradients)
are the same on any mesh, only the communication differs.
"""

import torch

import meshtorch as mt


def step():
    batch, d_model, d_ff = mt.Dim("batch", 8), mt.Dim("d_model", 16), mt.Dim("d_ff", 32)
    x = mt.from_global(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)), [batch, d_model])
    w = mt.random.normal([d_model, d_ff], seed=1, requires_grad=True)  # same values on any mesh
    y = mt.relu(mt.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w))
    loss = mt.reduce_sum(y * y)  # a replicated scalar
    mt.reset_comm_stats()
    loss.backward()
    stats = mt.comm_stats().copy()
    return loss.item(), w.grad.to_global(), stats


def main() -> None:
    (loss1, grad1, _), = mt.launch(step)  # one processor
    outs = mt.launch(step, mesh="b:2,m:2", rules="batch:b; d_ff:m")  # data x model parallel
    loss4, grad4, stats = outs[0]
    print(f"loss on 1 processor: {loss1:.6f}   on mesh b:2,m:2: {loss4:.6f}")
    print(f"max |grad difference|: {(grad1 - grad4).abs().max().item():.2e}")
    print("backward collectives on processor 0 (the weight gradient summed over the batch axis):")
    print(stats)


if __name__ == "__main__":
    main()
