"""The torch backend on gloo where a single-tensor collective is missing or not supported: the
communicator tries it once, then runs the list form (remembered), with the same values; any other
error of the single form is raised, not taken for a missing one.

Reference: each processor's tensor is known in closed form (its rank), so the gathered, reduced and
exchanged values are written out by hand.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import meshtorch as mt
from meshtorch.comm.torch import single_collective

N = 2
# every single-tensor spelling torch has had: the patched process has none that works
SINGLE = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
          "all_to_all_single")


def mine(rank: int) -> torch.Tensor:
    return torch.arange(8.0).reshape(4, 2) + 100 * rank


def three_collectives(comm) -> list[torch.Tensor]:
    x = mine(comm.rank)
    return [comm.all_gather(x, "b", 0), comm.reduce_scatter(x, "b", 0), comm.all_to_all(x, "b", 0, 1)]


def without_single_collectives() -> dict:
    """On each processor: the three collectives with the single forms working, then (twice) with every
    single form raising gloo's kind of 'not supported', then with the single form failing otherwise."""
    comm = mt.current().comm
    real = {name: getattr(dist, name) for name in SINGLE if hasattr(dist, name)}
    plain = three_collectives(comm)
    tried: dict[str, int] = {}  # by the communicator that falls back

    def failing(name: str, text: str, count: bool = False):
        def call(*args, **kwargs):
            if count:
                tried[name] = tried.get(name, 0) + 1
            raise RuntimeError(f"{text} (injected in {name})")
        return call

    fresh = type(comm)(comm.mesh)  # remembers nothing missing yet
    try:
        for name in real:
            setattr(dist, name, failing(name, "ProcessGroupGloo does not support this: not supported", True))
        fallback = [three_collectives(fresh) for _ in range(2)]
        for name in real:
            setattr(dist, name, failing(name, "Connection reset by peer"))
        other = type(comm)(comm.mesh)
        try:
            other.all_gather(mine(comm.rank), "b", 0)
            raised = None
        except Exception as e:  # noqa: BLE001 - returned to the test
            raised = f"{type(e).__name__}: {e}"
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"plain": plain, "fallback": fallback, "tried": tried, "raised": raised,
            "single": single_collective("all_gather") is not None}


def test_a_missing_single_collective_is_tried_once_then_the_list_form_gives_the_same_values():
    results = mt.launch(without_single_collectives, mesh=f"b:{N}", backend="torch", timeout=60)
    every = [mine(r) for r in range(N)]
    total = sum(every)
    preferred = [next(name for name in names if hasattr(dist, name)) for names in (SINGLE[0:2], SINGLE[2:4])]
    for rank, got in enumerate(results):
        expected = [torch.cat(every, 0),  # all_gather along dim 0
                    total.chunk(N, 0)[rank],  # reduce_scatter: the sum, this processor's block
                    torch.cat([every[j].chunk(N, 0)[rank] for j in range(N)], 1)]  # all_to_all 0 -> 1
        for values in [got["plain"], *got["fallback"]]:
            for value, want in zip(values, expected):
                torch.testing.assert_close(value, want)
        # the first round tried one spelling per collective, the installed torch's first (torch 2.13
        # added all_gather_single and reduce_scatter_single; 2.11 has only the *_tensor names), and
        # then remembered it missing
        assert sorted(got["tried"]) == sorted([*preferred, "all_to_all_single"])
        assert set(got["tried"].values()) == {1}, got["tried"]
        assert got["raised"] is not None and "Connection reset by peer" in got["raised"], got["raised"]
        assert got["single"]
