"""``meshtorch train --backend torch`` on several nodes: what the processes check once they have joined.

``meshtorch train --backend torch --nnodes N --node-rank R --master-addr A --master-port P`` runs on each
node the processors ``R·k .. R·k + k - 1`` of the mesh (``k`` = mesh size / N) through torchrun's
machinery (:func:`meshtorch.launcher.elastic.run_elastic`, as ``meshtorch launch`` does). One run has one
``--out``: processor 0 (on node 0) holds it, writes ``metrics.jsonl``, ``summary.json``, ``tokenizer/``
and the checkpoint's index, and every processor writes its own slices of the checkpoint into the same
directory (:func:`meshtorch.checkpoint.save`), and reads ``tokenizer/`` from it. So ``--out`` is a
directory on a filesystem every node mounts at that path, which :func:`check_shared_out` verifies before
anything is written; and every node must be given the same options (only ``--node-rank`` differs),
which :func:`agree_on_options` verifies, naming the flag that differs.

Example:
    >>> from meshtorch.recipes.lm.config import TrainConfig
    >>> from meshtorch.recipes.lm.nodes import differing_options
    >>> a = TrainConfig.of(steps=4, node_rank=0).options()
    >>> b = TrainConfig.of(steps=6, node_rank=1).options()
    >>> differing_options([a, b])
    ['steps']
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any

from meshtorch.errors import ArgumentError, TrainingError
from meshtorch.files import write_atomic

# the options that differ from node to node: where this node is in the run
PER_NODE = ("node_rank",)
_PROBE = ".meshtorch-shared-"  # a file processor 0 writes in --out, which every processor must see


def differing_options(options: list[dict[str, Any]]) -> list[str]:
    """The names of the options (but :data:`PER_NODE`) whose values differ among ``options`` (one dict
    of flag name -> value per process)."""
    names = sorted(set().union(*options))
    return [n for n in names if n not in PER_NODE and len({repr(o.get(n)) for o in options}) > 1]


def _gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    return got


def agree_on_options(options: dict[str, Any]) -> None:
    """Raise :class:`ArgumentError` on every process of the ``torch.distributed`` world unless all of
    them were given the same ``options`` (flag name -> value; :data:`PER_NODE` aside), naming each flag
    that differs and its value on each node (every process calls it)."""
    every = _gather({**options, "node_rank": options.get("node_rank", 0)})
    names = differing_options(every)
    if not names:
        return
    first = {}  # value -> the node that first had it, per flag
    for name in names:
        seen: dict[str, int] = {}
        for o in every:
            seen.setdefault(repr(o.get(name)), o["node_rank"])
        first[name] = ", ".join(f"{v} on node {node}" for v, node in seen.items())
    what = "; ".join(f"--{n.replace('_', '-')}: {first[n]}" for n in names)
    raise ArgumentError(f"the nodes of this run were given different options ({what}); pass the same "
                        "options on every node (only --node-rank differs)")


def check_shared_out(out: str) -> None:
    """Raise :class:`TrainingError` on every process of the ``torch.distributed`` world unless each of
    them sees, in ``out``, the file processor 0 has just written there: ``out`` must be one directory for
    the whole run (every processor writes its slices of the checkpoint into it). Every process calls it,
    processor 0 once it holds ``out``; processor 0 removes the file again."""
    import torch.distributed as dist

    rank = dist.get_rank()
    token = [None]
    if rank == 0:
        token[0] = _PROBE + secrets.token_hex(8)
        write_atomic(os.path.join(out, token[0]), socket.gethostname().encode())
    dist.broadcast_object_list(token, src=0)
    probe = os.path.join(out, token[0])
    seen = _gather((os.path.exists(probe), socket.gethostname()))
    if rank == 0:
        os.remove(probe)
    blind = [(r, host) for r, (ok, host) in enumerate(seen) if not ok]
    if blind:
        hosts = sorted({host for _, host in blind})
        raise TrainingError(
            f"--out {out!r} is not one directory for the whole run: processor(s) "
            f"{', '.join(str(r) for r, _ in blind)} (on {', '.join(hosts)}) do not see the file processor 0 "
            f"wrote there (on {seen[0][1]}). Every processor writes its slices of the checkpoint into --out: "
            "pass a directory on a filesystem every node mounts at the same path (e.g. NFS)")
