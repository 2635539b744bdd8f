"""The ``meta`` backend: one representative processor; collectives are
recorded and shaped, never run (see docs/design.md, backends).

The program runs once, as processor 0 of the mesh, with tensors on PyTorch's
``meta`` device (shapes and dtypes, no storage), so a step of a 512-processor
mesh can be traced on a laptop. Every collective is counted exactly as
processor 0 of a real run counts it, and returns a tensor of the shape the
real collective would return.

The transient memory of a collective depends on the backend that will run
it, and the plan must hold what that backend holds (``staging``):

- ``"none"``: only the result. The ``threads`` backend's private copies in
  its hub are made unseen by a tracer (``comm/threads.py``, ``ThreadsCommunicator._stage``).
- ``"torch"``: the copies ``comm/torch.py`` makes around every
  ``torch.distributed`` call: a contiguous copy of an input that is not
  contiguous along the gathered/scattered dim, the output buffer a
  reduce_scatter or all_to_all fills before it is reshaped into the result.
- ``"gloo"``: those, plus the buffers gloo allocates inside a call, measured
  with the allocator (``tests/test_plan_memory.py``): an all_gather fills a
  flat buffer of the whole output before copying it into the result, a
  reduce_scatter reduces a copy of the whole input; all_reduce, broadcast,
  all_to_all and point-to-point work in place. A send is asynchronous there:
  ``comm/torch.py`` keeps the sent tensor and a header of its shape alive until
  the send is done, planned as until the next send or ``wait_sends``.

Example:
    >>> import meshtorch as mt
    >>> def step():
    ...     w = mt.random.normal("d_model:1024,d_ff:4096", seed=0, requires_grad=True)
    ...     x = mt.random.normal("batch:512,d_model:1024", seed=1)
    ...     mt.reduce_sum(mt.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w)).backward()
    ...     return w.local.device.type, mt.comm_stats().bytes("b", "all_reduce")
    >>> mt.launch(step, mesh="b:64,m:8", rules="batch:b; d_ff:m", backend="meta")
    [('meta', 2097152)]
    >>> 1024 * (4096 // 8) * 4   # w's gradient slice in float32 (the loss is summed over (b,m))
    2097152
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from meshtorch.comm.base import Communicator
from meshtorch.comm.grouped import Handle
from meshtorch.errors import CommError
from meshtorch.mesh import Mesh

# what a planner hands a processor it traces alone, for each recv: (axes, src, tag) -> the tensor
Inbox = Callable[[tuple[str, ...], int, int], torch.Tensor]
STAGING = ("none", "torch", "gloo")


class MetaCommunicator(Communicator):
    """Processor ``rank``'s communicator on a mesh nobody else is running; ``staging``
    (one of :data:`STAGING`) is the transient memory of the backend being planned."""

    backend = "meta"

    def __init__(self, mesh: Mesh, rank: int = 0, check: bool = False, staging: str = "none"):
        super().__init__(mesh, rank, check)
        # point-to-point: nobody else runs, so a planner that knows what the peers send (a
        # pipeline's activations) answers each recv (``inbox``), and every send is kept in
        # ``sent`` as ``(axes, dst, tag, stand-in)``: a host tensor's copy, or an empty
        # meta tensor of the same shape and dtype
        self.inbox: Inbox | None = None
        self.sent: list[tuple[tuple[str, ...], int, int, torch.Tensor]] = []
        self.in_flight: list[torch.Tensor] = []
        self.staging = staging
        self._keep: list[torch.Tensor] | None = None  # gloo's buffers of the call being started

    @property
    def staging(self) -> str:
        return self._staging

    @staging.setter
    def staging(self, value: str) -> None:
        if value not in STAGING:
            raise CommError(f"staging {value!r} is not one of {STAGING} (the backend whose collective "
                            "buffers a plan holds: 'none' for threads, 'gloo' for torch on CPU)")
        self._staging = value

    def _copy(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``t`` with ``dim`` first, as comm/torch.py hands it to torch.distributed (a copy
        when that is not contiguous)."""
        t = t.movedim(dim, 0)
        return t.contiguous() if self._staging != "none" else t

    def _all_reduce(self, t, axes, group, op, call):
        return self._copy(t).clone()

    def _start_all_reduce(self, flat, axes, group, op, call, unpack):
        if self._staging == "none":  # the threads backend reduces into a new tensor
            return super()._start_all_reduce(flat, axes, group, op, call, unpack)
        return Handle(lambda: unpack(flat))  # comm/torch.py reduces the packed buffer in place

    # comm/torch.py's asynchronous work holds its packed input until waited on, and a
    # reduce_scatter's work gloo's copy of it (the threads backend completes at once and lets go
    # of them; gloo's all_gather lets go of its staging buffer by the time the call returns: the
    # allocator's peaks of issue 27's LMs on gloo show each)
    def _start_all_gather(self, flat, axes, group, call, unpack):
        return self._held([flat], super()._start_all_gather(flat, axes, group, call, unpack))

    def _start_reduce_scatter(self, buf, axes, group, op, call, unpack):
        with self._staged() as staged:
            work = super()._start_reduce_scatter(buf, axes, group, op, call, unpack)
        return self._held([buf, *staged], work)

    @contextlib.contextmanager
    def _staged(self) -> Iterator[list[torch.Tensor]]:
        """Inside, gloo's staging buffers are kept in the list given, not let go at once."""
        self._keep = []
        try:
            yield self._keep
        finally:
            self._keep = None

    def _stage(self, like: torch.Tensor) -> None:
        """gloo's buffer of ``like``'s size: at once let go of, or, inside :meth:`_staged`, kept
        until the call is waited on."""
        buf = torch.empty_like(like)
        if self._keep is not None:
            self._keep.append(buf)

    def _held(self, packed: list[torch.Tensor], work: Handle) -> Handle:
        if self._staging == "none":
            return work

        def finish() -> list[torch.Tensor]:
            packed.clear()  # comm/torch.py lets go of the input when the call is done, before unpacking
            return work.wait()

        return Handle(finish)

    def _all_gather(self, t, axes, group, dim, call):
        if self._staging == "none":
            # the threads backend concatenates along dim: a new contiguous tensor. (comm/torch.py's
            # result is a view with dim moved back; a weight's gradient then comes out in that
            # layout too and costs a contiguous copy before its reduce_scatter, which threads has not)
            return torch.empty(_scaled(t.shape, dim, len(group), 1), dtype=t.dtype, device=t.device)
        x = self._copy(t, dim)
        out = torch.empty((len(group) * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        if self._staging == "gloo":
            self._stage(out)  # gloo gathers into a flat buffer, then copies it out
        del x
        return out.movedim(0, dim)

    def _reduce_scatter(self, t, axes, group, dim, op, call):
        if self._staging == "none":  # the threads backend reduces the chunks into a new contiguous tensor
            return torch.empty(_scaled(t.shape, dim, 1, len(group)), dtype=t.dtype, device=t.device)
        x = self._copy(t, dim)
        out = torch.empty((x.shape[0] // len(group),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        if self._staging == "gloo":
            self._stage(x)  # gloo reduces a copy of the whole input
        del x
        return out.movedim(0, dim).contiguous()

    def _all_to_all(self, t, axes, group, split_dim, concat_dim, call):
        n = len(group)
        x = self._copy(t, split_dim)
        out = torch.empty_like(x) if self._staging != "none" else x
        if not out.is_contiguous():
            return torch.cat([p.movedim(0, split_dim) for p in out.chunk(n, 0)], concat_dim)
        # the torch backend's ops (comm/torch.py, _blocks): one permute and one unbind
        pieces = out.view(n, x.shape[0] // n, *x.shape[1:])
        return torch.cat(pieces.movedim(1, split_dim + 1).unbind(0), concat_dim)

    def _permute(self, t, axes, group, sources, call):
        return self._copy(t).clone()

    def _send(self, t, axes, group, dst, tag):
        with self.unseen():  # a record of the program's send, no memory of the program (base.unseen)
            kept = t.detach().clone() if t.device.type != "meta" else torch.empty(
                t.shape, dtype=t.dtype, device="meta")
        self.sent.append((axes, dst, tag, kept))
        if self._staging != "none":
            # comm/torch.py holds an isend's tensor and its shape header until it is delivered
            self.in_flight = [t, torch.zeros(10, dtype=torch.int64, device=t.device)]

    def wait_sends(self) -> None:
        self.in_flight = []

    def _recv(self, axes, group, src, tag):
        if self.inbox is None:
            raise CommError(f"recv along {axes}: the meta backend runs processor {self.rank} alone, so "
                            "nothing arrives; plan pipelines with meshtorch.plan.pipeline (it answers "
                            "each stage's recvs with what the neighbouring stages send)")
        return self.inbox(axes, src, tag)

    def _broadcast(self, t, axes, group, src, call):
        return self._copy(t).clone()

    def _barrier(self, call):
        return None


def _scaled(shape: torch.Size, dim: int, times: int, over: int) -> list[int]:
    """``shape`` with dim ``dim``'s extent times ``times`` over ``over``."""
    out = list(shape)
    out[dim] = out[dim] * times // over
    return out
