"""The ``torch`` backend: one process per processor over ``torch.distributed``.

Mesh rank ``r`` is ``torch.distributed`` rank ``r``. A collective over a set of
axes runs on one process group per group of processors (``Mesh.groups``);
those groups are created once and cached. ``dist.new_group`` is collective
over the whole world, so every rank must create the same groups in the same
order: for meshes of up to :data:`EAGER_AXES` axes we create the groups of
every subset of axes eagerly, at construction, when all ranks are known to be
in step. Creating lazily on first use would also be collective (SPMD code asks
for the same axes in the same order), but a processor that skipped a
collective would then also skip a ``new_group`` and turn a clean check-mode
error into a hang, so lazy creation is kept for larger meshes only, where
``2**axes`` group sets would be wasteful.

gloo (CPU) and NCCL (GPU) both run every collective; where the installed
``torch.distributed`` lacks a single-tensor spelling (``all_gather_single``,
``reduce_scatter_single``, ``all_to_all_single``) the communicator falls back
to the list forms, once, and remembers. With NCCL, tensors are moved to
``cuda:<local rank>`` for the collective and back to where they came from.

Under ``torch.compile`` the collectives are ``torch.distributed``'s functional
collectives (``torch.distributed._functional_collectives``): ops of the traced
graph, which the compiler can schedule and overlap with the local work, instead of
calls it cannot trace; ``check`` is not applied to them (the trace fixes every
call, so a mismatch shows in an eager run of the same step).

With ``check=True`` the members of a group first all-gather a 64-bit hash of
the call's description (kind, axes, reduce op, dims, source, dtype, shape:
``meshtorch.comm.base.CALL_FIELDS``); if the hashes differ they exchange the
full descriptions, call sites included, and every member raises the same
:class:`~meshtorch.errors.CommError` from ``compare_calls`` (the check every
backend shares), naming the differing argument and both call sites, before
any payload is sent, so the process group is still usable afterwards. A collective that does
not complete within the process-group timeout raises a ``CommError`` naming the
collective and the user's call site.

Example (needs an initialised process group; see ``mt.launch(..., backend="torch")``):
    >>> import torch, meshtorch as mt
    >>> def f():
    ...     comm = mt.current().comm
    ...     return comm.all_reduce(torch.tensor([1.0 + comm.rank]), "b").item()
    >>> mt.launch(f, mesh="b:2", backend="torch")  # doctest: +SKIP
    [3.0, 3.0]
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from meshtorch.comm.absent import diagnose
from meshtorch.comm.base import (
    CALL_FIELDS,
    Communicator,
    as_axes,
    check_timeout,
    compare_calls,
    user_call_site,
)
from meshtorch.comm.grouped import Handle
from meshtorch.errors import CommError, MeshError
from meshtorch.mesh import Mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# meshes with at most this many axes get the groups of every axis subset at construction
EAGER_AXES = 4

# point-to-point tensors carry a header of (dtype index, dims, sizes) so the receiver can allocate
_P2P_MAX_DIMS = 8
_P2P_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool)

_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def peer_left(e: BaseException) -> bool:
    """Whether ``e``, raised by ``torch.distributed`` (a collective, ``new_group``,
    ``init_process_group``), says that the other end of a connection went away: a processor
    exited or crashed. gloo says so in words only ("Connection closed by peer", "Connection reset
    by peer"): its errors reach Python as plain ``RuntimeError``s (torch 2.13, seen), none of
    ``torch.distributed``'s ``DistError`` types; and the type that exists for connections,
    ``DistNetworkError``, is the rendezvous store's, raised also for a host that cannot be
    reached at all, which is no processor leaving. So the words decide, for any of these types.

    Example:
        >>> from meshtorch.comm.torch import peer_left
        >>> peer_left(RuntimeError("[pair.cc:553] Connection closed by peer [10.0.0.2]:3227"))
        True
        >>> peer_left(RuntimeError("Socket Timeout"))
        False
    """
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("closed" in text or "reset" in text)


def _digest(call: dict) -> int:
    # python's hash() is salted per process; processors need the same number
    text = repr(tuple(call.get(f) for f in CALL_FIELDS))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


# Two registries, as they must hold their communicators differently (one cannot do both):
# - _sending: the communicators of this process with point-to-point sends that may still be in
#   flight, by id, held STRONGLY (with the tensors they send) until wait_sends: a communicator
#   its program dropped must outlive it while a send runs, since its last reference going
#   destroys its gloo process groups, and destroying one under a send it still runs aborts the
#   interpreter; leaving the world (launcher/world.shutdown) waits for them all first.
# - _communicators: every torch communicator of this process, WEAKLY, for leave_groups: a
#   strong set would keep every dropped communicator and its process groups alive until the
#   world is left (tests/test_launch_processes.py checks that a dropped one is collected).
_sending: dict[int, TorchCommunicator] = {}
_communicators: weakref.WeakSet = weakref.WeakSet()


def leave_groups() -> None:
    """Let go of every process group this process's torch communicators hold, after
    ``dist.destroy_process_group()`` (see :func:`meshtorch.launcher.world.shutdown`).

    The last reference to a gloo group destroys it: its worker threads are joined, with the
    GIL released, so whatever work they still hold is freed now. A group that lived on into
    the interpreter's exit had its worker free a finished collective's tensors then, taking the
    GIL, and Python ended that thread with ``pthread_exit`` inside a C++ destructor: the process
    aborted, "terminate called without an active exception" (seen in gdb on a torchrun run's
    core: ``~AsyncAllgatherWork`` in ``ProcessGroupGloo::runLoop``). A communicator used after
    this raises ``CommError``.

    Example:
        >>> from meshtorch.comm.torch import leave_groups
        >>> leave_groups()  # no torch communicator: nothing to let go of
    """
    for comm in list(_communicators):
        comm._left = True
        comm._groups.clear()
        comm._by_members.clear()
        comm._sends = []
        comm._device_mesh = None


def wait_all_sends() -> None:
    """Wait until every point-to-point send of every torch communicator of this process has
    been delivered (a program may end with sends it never waited for).

    Example:
        >>> from meshtorch.comm.torch import wait_all_sends
        >>> wait_all_sends()  # nothing sent: returns at once
    """
    for comm in list(_sending.values()):
        comm.wait_sends()


class TorchCommunicator(Communicator):
    """This process's communicator over an initialised ``torch.distributed`` world.

    Args:
        mesh: the processor mesh; its size must equal the world size.
        check: compare each collective across its group before running it.
        timeout: seconds a collective may wait before it raises ``CommError``
            (the timeout of the process groups this communicator creates); positive,
            or ``None`` for torch's default.
        device: where collectives run; default ``cuda:<LOCAL_RANK>`` on NCCL,
            otherwise the CPU.

    Raises:
        ArgumentError: ``timeout`` is zero, negative or not a number.
        MeshError: the mesh does not have one processor per process.
        CommError: ``torch.distributed`` is not initialised.
    """

    backend = "torch"
    traceable = True

    def __init__(self, mesh: Mesh | str, check: bool = False, timeout: float | None = None,
                 device: torch.device | str | None = None):
        mesh = Mesh(mesh)
        timeout = check_timeout(timeout, allow_none=True)
        if not dist.is_available() or not dist.is_initialized():
            raise CommError(
                "the torch backend needs an initialised torch.distributed process group; start the "
                "program with `meshtorch launch --backend torch`, `torchrun` + mt.init_distributed(), "
                "or mt.launch(fn, backend='torch')"
            )
        world = dist.get_world_size()
        if mesh.size != world:
            raise MeshError(
                f"mesh '{mesh}' has {mesh.size} processors but torch.distributed has {world} "
                f"processes; start {mesh.size} processes or use a mesh of {world} processors"
            )
        super().__init__(mesh, dist.get_rank(), check)
        self.timeout = timeout
        self.dist_backend = dist.get_backend()
        if device is None:
            nccl = self.dist_backend == "nccl"
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if nccl else "cpu"
        self.device = torch.device(device)
        self._groups: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self._by_members: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._missing: set[str] = set()
        self._sends: list[tuple] = []  # (work, tensor, axes, group) of point-to-point sends in flight
        self._device_mesh: DeviceMesh | None = None
        self._left = False  # leave_groups() let go of the groups: the world was left
        _communicators.add(self)
        if len(mesh.axis_names) <= EAGER_AXES:
            names = mesh.axis_names
            for k in range(1, len(names) + 1):
                for axes in itertools.combinations(names, k):
                    self._process_group(axes)

    # ------------------------------------------------------------- groups
    def _key(self, axes) -> tuple[str, ...]:
        order = self.mesh.axis_names
        return tuple(sorted(as_axes(axes), key=order.index))

    def _process_group(self, axes) -> dist.ProcessGroup:
        """This rank's process group over ``axes``; creates all groups of that axes set
        (collectively, in a fixed order) the first time."""
        key = self._key(axes)
        pg = self._groups.get(key)
        if pg is not None:
            return pg
        if self._left:
            raise CommError(f"a collective over axes {key} after this process left the torch.distributed "
                            "world (meshtorch.launcher.world.shutdown); collectives belong before it")
        mine = self.mesh.group(self.rank, key)
        # our own groups, even for the whole world: they carry the collective timeout,
        # while the default group keeps the longer one it needed for the rendezvous
        kw = {"timeout": datetime.timedelta(seconds=self.timeout)} if self.timeout else {}
        for members in self.mesh.groups(key):
            if len(members) == 1:
                continue
            # axes of size 1 make different axes sets with the same members: one group serves both
            made = self._by_members.get(members)
            if made is None:
                # gloo connects the members now: a processor that already left (exited, crashed)
                # is a CommError here, as in any collective, not the root of the failure
                made = self._by_members[members] = self._run(
                    "new_group", key, members, lambda m=members: dist.new_group(list(m), **kw))
            if members == mine:
                pg = made
        self._groups[key] = pg
        return pg

    def process_group(self, axes) -> dist.ProcessGroup | None:
        """The ``torch.distributed`` process group of this processor's group over
        ``axes`` (``None`` for a group of one). For interop with torch code."""
        if len(self.group(axes)) == 1:
            return None
        return self._process_group(axes)

    def device_mesh(self) -> DeviceMesh:
        """This mesh as a torch ``DeviceMesh`` (same axis names, same row-major rank order),
        made on the first call and then kept. The first call is collective: every processor
        makes it (SPMD).

        Example (inside a torch-backend launch):
            >>> mt.current().comm.device_mesh().mesh_dim_names  # doctest: +SKIP
            ('b', 'm')
        """
        if self._device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = self.mesh
            ranks = torch.arange(mesh.size).reshape(mesh.shape) if mesh.axes else torch.arange(1)
            self._device_mesh = DeviceMesh(self.device.type, ranks, mesh_dim_names=mesh.axis_names or ("p",))
        return self._device_mesh

    # ------------------------------------------------------------- plumbing
    def _run(self, kind: str, axes, group, fn: Callable[[], object]):
        try:
            return fn()
        except RuntimeError as e:  # gloo/NCCL timeouts and closed peers are RuntimeErrors
            if isinstance(e, CommError):
                raise
            raise self._failed(kind, axes, group, e) from e

    def _wait_work(self, kind: str, axes, group, work) -> None:
        """Wait for ``work``, a started collective ``kind``: a failure is its :meth:`_failed`
        CommError (:meth:`_run`), and a tracer does not see the transport's own work at
        completion (gloo's copy-out), which is no program's."""
        if self.tracing:  # (unseen() is three Python calls: entered only while something traces)
            with self.unseen():
                self._run(kind, axes, group, work.wait)
        else:
            self._run(kind, axes, group, work.wait)

    def _failed(self, kind: str, axes, group, e: RuntimeError) -> CommError:
        """The ``CommError`` of collective ``kind`` that ``torch.distributed`` failed with ``e``:
        the collective, its axes and the user's call site named, and why (a timeout: which
        processors never joined; a processor that exited or crashed)."""
        text, site = str(e), user_call_site()
        hint = ("Every processor of a group must make the same collective calls in the same order; "
                "run with check=True to compare call sites")
        if "timed out" in text.lower() or "timeout" in text.lower():
            within = (f"did not complete within the {self.timeout:g} s timeout" if self.timeout
                      else "timed out")
            found = diagnose(kind, tuple(axes), site, list(group), self.rank, self.mesh)
            if found is None or not found[0]:
                why = f"{within}: some processor of the group {list(group)} never joined it"
            else:
                why = f"{within}: {found[0]}"
                if not found[1]:  # members simply absent: nothing was mismatched
                    hint = ("If a processor named is only slow (a long computation between two "
                            "collectives), pass a larger timeout")
        elif peer_left(e):
            why = f"failed because a processor of the group {list(group)} exited or crashed"
            # nothing was mismatched: the processor that ended says why (or its launcher, how it ended)
            hint = "Its own error, or its launcher's report of how it ended, says why"
        else:
            why = "failed"
        return CommError(f"{kind} over axes {tuple(axes)} called at {site} {why} ({text.strip()}). {hint}")

    def _to_dev(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device != self.device:
            t = t.to(self.device)
        return t.contiguous()

    def _check(self, call: dict, group) -> None:
        """Under ``check``: compare ``call`` across the group before any payload moves."""
        if not self.check:
            return
        kind, axes = call["kind"], call["axes"]
        pg = self._process_group(axes)
        mine = torch.tensor([_digest(call)], dtype=torch.int64, device=self.device)
        allh = torch.empty(len(group), dtype=torch.int64, device=self.device)
        self._run(kind, axes, group, lambda: self._gather_flat(allh, mine, pg))
        if bool((allh == allh[0]).all()):
            return
        calls: list = [None] * len(group)
        self._run(kind, axes, group, lambda: dist.all_gather_object(calls, call, group=pg))
        compare_calls(dict(zip(group, calls)), group, self.mesh)
        # the digests cover exactly the compared fields, so only a repr that is not stable
        # across processes could get here
        raise CommError(f"collective mismatch in {kind} over {tuple(axes)}: the calls' digests differ "
                        f"but their descriptions compare equal ({calls})")

    def _single(self, kind: str, run: Callable[[], object] | None) -> bool:
        """Run ``run``, the single-tensor spelling of collective ``kind`` (``None``: the installed
        ``torch.distributed`` has none); ``False`` where there is none or the process group does not
        support it, and from then on without trying it again: the caller runs the list form instead.
        Any other error is raised."""
        if kind in self._missing:
            return False
        if run is not None:
            try:
                run()
                return True
            except (NotImplementedError, RuntimeError) as e:
                if not _unsupported(e):
                    raise
        self._missing.add(kind)
        return False

    def _gather_flat(self, out: torch.Tensor, t: torch.Tensor, pg) -> None:
        """All-gather ``t`` into ``out`` concatenated along dim 0."""
        op = single_collective("all_gather")
        if not self._single("all_gather", op and (lambda: op(out, t, group=pg))):
            parts = list(out.chunk(dist.get_world_size(pg), 0))
            dist.all_gather(parts, t, group=pg)

    # ------------------------------------------------------------ collectives
    def _all_reduce(self, t, axes, group, op, call):
        if torch.compiler.is_compiling():
            return self._back(funcol.all_reduce(self._on_dev(t), op, self._process_group(axes)), t)
        self._check(call, group)
        pg = self._process_group(axes)
        x = self._to_dev(t).clone()
        self._run("all_reduce", axes, group, lambda: dist.all_reduce(x, _REDUCE[op], group=pg))
        return x.to(t.device)

    def _all_gather(self, t, axes, group, dim, call):
        if torch.compiler.is_compiling():
            # gathered along dim 0, the pieces moved to ``dim`` here (a view where no data moves):
            # torch 2.11's all_gather_tensor moves them in a function Dynamo skips, a graph break
            out = funcol.all_gather_tensor(self._on_dev(t), 0, self._process_group(axes))
            if dim:
                out = out.unflatten(0, (len(group), -1)).movedim(0, dim).flatten(dim, dim + 1)
            return self._back(out, t)
        self._check(call, group)
        pg = self._process_group(axes)
        x = self._to_dev(t.movedim(dim, 0))
        out = torch.empty((len(group) * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        self._run("all_gather", axes, group, lambda: self._gather_flat(out, x, pg))
        return out.movedim(0, dim).to(t.device)

    def _reduce_scatter(self, t, axes, group, dim, op, call):
        if torch.compiler.is_compiling():
            out = funcol.reduce_scatter_tensor(self._on_dev(t), op, dim, self._process_group(axes))
            return self._back(out, t)
        self._check(call, group)
        pg = self._process_group(axes)
        x = self._to_dev(t.movedim(dim, 0))
        out = torch.empty((x.shape[0] // len(group),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)

        def go():
            fn = single_collective("reduce_scatter")
            if self._single("reduce_scatter", fn and (lambda: fn(out, x, op=_REDUCE[op], group=pg))):
                return
            y = x.clone()
            dist.all_reduce(y, _REDUCE[op], group=pg)
            out.copy_(y.chunk(len(group), 0)[group.index(self.rank)])

        self._run("reduce_scatter", axes, group, go)
        return out.movedim(0, dim).contiguous().to(t.device)

    def _all_to_all(self, t, axes, group, split_dim, concat_dim, call):
        n = len(group)
        if torch.compiler.is_compiling():
            x = self._on_dev(t.movedim(split_dim, 0))
            out = funcol.all_to_all_single(x, None, None, self._process_group(axes))
            return self._blocks(out, t, n, split_dim, concat_dim)
        self._check(call, group)
        pg = self._process_group(axes)
        x = self._to_dev(t.movedim(split_dim, 0))
        out = torch.empty_like(x)

        def go():
            if self._single("all_to_all", lambda: dist.all_to_all_single(out, x, group=pg)):
                return
            # fallback: gather everything and keep the chunks addressed to us
            whole = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            self._gather_flat(whole.view(n * x.shape[0], *x.shape[1:]), x, pg)
            me = group.index(self.rank)
            out.copy_(torch.cat([whole[j].chunk(n, 0)[me] for j in range(n)], 0))

        self._run("all_to_all", axes, group, go)
        return self._blocks(out, t, n, split_dim, concat_dim)

    # ---------------------------------------------------- grouped, asynchronous
    # One flat call with async_op=True: the work runs while this processor computes (gloo on its
    # own threads, NCCL on its own stream; Work.wait makes the current stream wait for it), and
    # the handle unpacks the result when waited on. The buffers stay alive in the closure.
    def _async(self, kind: str, axes, group, start: Callable[[], object], finish: Callable[[], list]
               ) -> Handle:
        held = [self._run(kind, axes, group, start)]

        def wait() -> list:
            work = held.pop()
            self._wait_work(kind, axes, group, work)
            # the work holds the call's input (a packed buffer): let go of it before unpacking, so
            # that a grouped gather's input is not alive beside its result and the result's copies
            del work
            return finish()

        # the work is looked up when asked, not bound now: a bound method would keep the work,
        # and the work its tensors, alive after the wait
        return Handle(wait, lambda: not held or held[0].is_completed())

    def _start_all_gather(self, flat, axes, group, call, unpack):
        op = single_collective("all_gather")
        if "all_gather" in self._missing or op is None:
            return super()._start_all_gather(flat, axes, group, call, unpack)
        self._check(call, group)
        pg = self._process_group(axes)
        x = self._to_dev(flat)
        out = torch.empty(len(group) * x.numel(), dtype=x.dtype, device=x.device)
        home = flat.device  # (not ``flat``, which the unpacking must not keep alive)
        return self._async("all_gather", axes, group, lambda: op(out, x, group=pg, async_op=True),
                           lambda: unpack(out.to(home)))

    def _start_reduce_scatter(self, buf, axes, group, op, call, unpack):
        fn = single_collective("reduce_scatter")
        if "reduce_scatter" in self._missing or fn is None:
            return super()._start_reduce_scatter(buf, axes, group, op, call, unpack)
        self._check(call, group)
        pg = self._process_group(axes)
        x = self._to_dev(buf)
        out = torch.empty((1,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        return self._async("reduce_scatter", axes, group,
                           lambda: fn(out, x, op=_REDUCE[op], group=pg, async_op=True),
                           lambda: unpack(out.to(buf.device)))

    def _start_all_reduce(self, flat, axes, group, op, call, unpack):
        self._check(call, group)
        pg = self._process_group(axes)
        x = self._to_dev(flat)  # the packed buffer is the call's own: reduced in place
        return self._async("all_reduce", axes, group,
                           lambda: dist.all_reduce(x, _REDUCE[op], group=pg, async_op=True),
                           lambda: unpack(x.to(flat.device)))

    # A FlatAllReduce's buffer is reduced in place by the process group's own C++ method,
    # ``ProcessGroup.allreduce([t], opts)``: what DDP's reducer calls, and what dist.all_reduce
    # calls after five Python calls of its own checks per start. dist.all_reduce runs it where
    # the process group has no such method or it takes other arguments (a TypeError, then
    # remembered), and for what dist.all_reduce handles itself: a complex dtype (reduced as real
    # pairs), a tensor subclass.
    # What is prepared holds the group's key and the method of its class, not the group: the
    # groups die with leave_groups (a gloo group living on into the interpreter's exit aborts the
    # process), and a start after that raises CommError as any collective does.
    def _prepare_all_reduce(self, axes, group, op):
        pg = self._process_group(axes)
        method = None if "ProcessGroup.allreduce" in self._missing else process_group_allreduce(pg)
        return [self._key(axes), method, None if method is None else _allreduce_options(_REDUCE[op])]

    def _start_flat_all_reduce(self, flat, axes, group, op, call, prepared):
        if flat.device != self.device:  # (moved to where the collective runs and back)
            return super()._start_flat_all_reduce(flat, axes, group, op, call, prepared)
        key, method, opts = prepared
        pg = self._groups.get(key) or self._process_group(axes)
        try:
            if method is not None and type(flat) is torch.Tensor and not flat.is_complex():
                try:
                    held = [method(pg, [flat], opts)]
                except TypeError:  # another signature: dist.all_reduce from now on
                    prepared[1] = None
                    self._missing.add("ProcessGroup.allreduce")
                    held = [dist.all_reduce(flat, _REDUCE[op], group=pg, async_op=True)]
            else:
                held = [dist.all_reduce(flat, _REDUCE[op], group=pg, async_op=True)]
        except RuntimeError as e:
            raise self._failed("all_reduce", axes, group, e) from e

        def wait() -> list:
            self._wait_work("all_reduce", axes, group, held.pop())
            return [flat]

        return Handle(wait, lambda: not held or held[0].is_completed())

    @staticmethod
    def _blocks(out: torch.Tensor, t: torch.Tensor, n: int, split_dim: int, concat_dim: int) -> torch.Tensor:
        """What arrived from each member (``out``, stacked along dim 0) concatenated along
        ``concat_dim``, in group order, on ``t``'s device."""
        pieces = out.view(n, out.shape[0] // n, *out.shape[1:])
        # one permute and one unbind, not a movedim per member (n aten ops: 128 on a 128-way axis)
        return torch.cat(pieces.movedim(1, split_dim + 1).unbind(0), concat_dim).to(t.device)

    def _permute(self, t, axes, group, sources, call):
        if torch.compiler.is_compiling():
            return self._traced_permute(t, axes, group, sources)
        self._check(call, group)
        pg = self._process_group(axes)
        me = group.index(self.rank)
        x = self._to_dev(t)
        src = sources[me]
        recv = torch.zeros_like(x) if src is None else (x.clone() if src == me else torch.empty_like(x))
        ops = [dist.P2POp(dist.isend, x, group[i], pg) for i, s in enumerate(sources) if s == me and i != me]
        if src is not None and src != me:
            ops.append(dist.P2POp(dist.irecv, recv, group[src], pg))

        def go():
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

        self._run("permute", axes, group, go)
        return recv.to(t.device)

    def _traced_permute(self, t, axes, group, sources):
        # one all_to_all_single with a block per (sender, receiver) pair: a member sends its
        # tensor once to each member that names it, and receives one block (or nothing)
        me, numel = group.index(self.rank), t.numel()
        dsts = [i for i, s in enumerate(sources) if s == me]
        send = [numel if i in dsts else 0 for i in range(len(group))]
        recv = [numel if i == sources[me] else 0 for i in range(len(group))]
        x = self._on_dev(t).reshape(1, -1).expand(len(dsts), numel).reshape(-1)
        out = funcol.all_to_all_single(x, recv, send, self._process_group(axes))
        if sources[me] is None:
            return torch.zeros_like(t)
        return self._back(out.view(t.shape), t)

    def _on_dev(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where a traced collective runs it (contiguous, on this processor's device)."""
        return (t if t.device == self.device else t.to(self.device)).contiguous()

    @staticmethod
    def _back(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return out if out.device == t.device else out.to(t.device)

    def _send(self, t, axes, group, dst, tag):
        pg = self._process_group(axes)
        x = self._to_dev(t)
        if x.dim() > _P2P_MAX_DIMS or x.dtype not in _P2P_DTYPES:
            raise CommError(f"send along {axes}: tensors of up to {_P2P_MAX_DIMS} dims and dtypes "
                            f"{_P2P_DTYPES} travel point-to-point, got {x.dtype}{list(x.shape)}")
        # the receiver allocates from a fixed-size header: dtype, number of dims, sizes
        head = torch.zeros(2 + _P2P_MAX_DIMS, dtype=torch.int64, device=self.device)
        head[0], head[1] = _P2P_DTYPES.index(x.dtype), x.dim()
        head[2:2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        # keep completed sends out of the list, and the in-flight tensors alive until delivered
        self._sends = [w for w in self._sends if not w[0].is_completed()]
        _sending[id(self)] = self
        for buf, tg in ((head, 2 * tag), (x, 2 * tag + 1)):
            work = self._run("send", axes, group, lambda b=buf, g=tg: dist.isend(
                b, group=pg, group_dst=dst, tag=g))
            self._sends.append((work, buf, axes, group))

    def _recv(self, axes, group, src, tag):
        pg = self._process_group(axes)
        head = torch.empty(2 + _P2P_MAX_DIMS, dtype=torch.int64, device=self.device)
        self._run("recv", axes, group, lambda: dist.recv(head, group=pg, group_src=src, tag=2 * tag))
        n = int(head[1])
        sizes = [int(v) for v in head[2:2 + n]]
        out = torch.empty(sizes, dtype=_P2P_DTYPES[int(head[0])], device=self.device)
        self._run("recv", axes, group, lambda: dist.recv(out, group=pg, group_src=src, tag=2 * tag + 1))
        return out

    def wait_sends(self) -> None:
        sends, self._sends = self._sends, []
        _sending.pop(id(self), None)
        for work, _, axes, group in sends:
            self._run("send", axes, group, work.wait)

    def _broadcast(self, t, axes, group, src, call):
        if torch.compiler.is_compiling():
            return self._back(funcol.broadcast(self._on_dev(t), group[src], self._process_group(axes)), t)
        self._check(call, group)
        pg = self._process_group(axes)
        x = self._to_dev(t).clone()
        self._run("broadcast", axes, group, lambda: dist.broadcast(x, src=group[src], group=pg))
        return x.to(t.device)

    def _barrier(self, call):
        group = tuple(range(self.mesh.size))
        axes = self.mesh.axis_names
        z = torch.zeros(1, device=self.device)
        self._check(call, group)
        pg = self._process_group(axes)
        self._run("barrier", axes, group, lambda: dist.all_reduce(z, group=pg))


# the single-tensor spellings of a collective, in the order tried (torch has named them differently)
_SINGLE = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
           "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}


def single_collective(kind: str) -> Callable | None:
    """The installed ``torch.distributed``'s single-tensor spelling of collective ``kind`` (``None``
    where it has none).

    Example:
        >>> single_collective("all_gather") is not None
        True
    """
    for name in _SINGLE[kind]:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    return None


def process_group_allreduce(pg) -> Callable | None:
    """The ``allreduce`` method of ``pg``'s class (``ProcessGroup.allreduce(pg, tensors, opts)``,
    C++; unbound, so that holding it does not hold the group), or ``None`` where the installed
    ``torch.distributed`` has it not, or no ``AllreduceOptions``: then ``dist.all_reduce`` runs
    the call.

    Example:
        >>> process_group_allreduce(object()) is None  # no process group
        True
    """
    method = getattr(type(pg), "allreduce", None)
    return method if callable(method) and hasattr(dist, "AllreduceOptions") else None


def _allreduce_options(op) -> object:
    """What ``dist.all_reduce(t, op, async_op=True)`` hands the process group."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    if hasattr(opts, "asyncOp"):  # (a field of newer torch's options only)
        opts.asyncOp = True
    return opts


def _unsupported(e: BaseException) -> bool:
    if isinstance(e, NotImplementedError):
        return True
    text = str(e).lower()
    return "not supported" in text or "unsupported" in text or "not implemented" in text
