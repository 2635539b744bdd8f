"""The ``threads`` backend: N processors as N threads of one process.

Collectives meet in a shared :class:`Hub`: each member deposits a private copy
of its tensor under a key (the group and the member's call count for that
group), waits until the whole group has deposited, and computes its own result
from the copies in group order, so every member of a group gets the same bits.
Before using any data, every member compares the group's call descriptions
(:func:`~meshtorch.comm.base.compare_calls`, the check all backends share), so
processors that disagree about a collective's kind, axes, reduce op, dims,
source, dtype or shape raise a :class:`~meshtorch.errors.CommError` instead of
computing garbage (with ``check=True`` it names both call sites). A processor
that raises marks the hub failed and one that returns marks itself left;
either wakes every member waiting for it with a ``CommError`` instead of a
hang. A member that waits longer than the timeout raises naming the
collective, its call site and what the missing processors are doing.

Example:
    >>> import torch, meshtorch as mt
    >>> def f():
    ...     comm = mt.current().comm
    ...     return comm.all_gather(torch.tensor([comm.rank]), "m", dim=0).tolist()
    >>> mt.launch(f, mesh="b:2,m:2")
    [[0, 1], [0, 1], [2, 3], [2, 3]]
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

import torch

from meshtorch.comm.base import Communicator, check_timeout, compare_calls, reduce_stack, user_call_site
from meshtorch.errors import CommError
from meshtorch.mesh import Mesh


def _names(mesh: Mesh, ranks) -> str:
    """``processor 2 {'b': 1}`` / ``processors 0 {'b': 0}, 2 {'b': 1}``."""
    ranks = sorted(ranks)
    listed = ", ".join(f"{r} {mesh.coords(r)}" for r in ranks)
    return f"processor{'s' if len(ranks) > 1 else ''} {listed}"


class Hub:
    """The shared meeting place of one launch's thread-processors.

    Besides the deposits it knows, for the messages of whoever waits, which
    processors have finished (returned: :meth:`leave`, or raised: :meth:`fail`)
    and what each waiting processor waits in. A wait for a member that has
    finished, or in a hub the launch has given up on (:meth:`close`), ends at
    once with a :class:`~meshtorch.errors.CommError`. Each launch has its own
    hub, so a thread left behind by an abandoned launch meets nobody from a later
    one: its next collective raises.

    Args:
        mesh: the processor mesh.
        timeout: seconds a member waits for the rest of its group (positive).
    """

    def __init__(self, mesh: Mesh, timeout: float):
        self.mesh = mesh
        self.timeout = check_timeout(timeout)
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        # the launch waits on this one, woken by finishes only, not by every deposit
        self.finishes = threading.Condition(lock)
        self.slots: dict[tuple, dict] = {}
        self.failed: tuple[int, BaseException] | None = None
        self.failed_at: float | None = None
        self.left: dict[int, float] = {}  # rank -> when it returned
        self.finished: set[int] = set()  # ranks that returned or raised
        self.closed: str | None = None
        self.waiting: dict[int, str] = {}  # rank -> what it waits in, for timeout messages
        self.mail: dict[tuple, deque] = {}

    def fail(self, rank: int, exc: BaseException) -> None:
        """Processor ``rank`` raised ``exc``: wake every waiting member (the first failure is kept)."""
        with self.cond:
            if self.failed is None:
                self.failed = (rank, exc)
                self.failed_at = time.monotonic()
            self.finished.add(rank)
            self.cond.notify_all()
            self.finishes.notify_all()

    def leave(self, rank: int) -> None:
        """Processor ``rank`` returned: whoever waits for it now waits in vain."""
        with self.cond:
            self.left[rank] = time.monotonic()
            self.finished.add(rank)
            self.cond.notify_all()
            self.finishes.notify_all()

    def close(self, why: str) -> None:
        """The launch gave up: every wait in this hub, now or later, raises with ``why``."""
        with self.cond:
            self.closed = why
            self.cond.notify_all()
            self.finishes.notify_all()

    def _hopeless(self, missing) -> str | None:
        """Why a wait for the ranks ``missing`` cannot succeed (to follow the waiter's
        description in a ``CommError``), or ``None``. Holds ``cond``."""
        if self.closed is not None:
            return f"abandoned: {self.closed}"
        if self.failed is not None:
            frank, exc = self.failed
            return (f"abandoned: processor {frank} {self.mesh.coords(frank)} failed with "
                    f"{type(exc).__name__}: {exc}")
        gone = [r for r in missing if r in self.left]
        if gone:
            return (f"cannot complete: {_names(self.mesh, gone)} left (returned from the program) and "
                    "never joined it. Every processor of a group must make the same collective calls "
                    "in the same order")
        return None

    def _doing(self, ranks) -> str:
        """What each of ``ranks`` is doing, for a timeout message. Holds ``cond``."""
        parts = [f"processor {r} is waiting in {self.waiting[r]}" if r in self.waiting
                 else f"processor {r} is running outside any collective" for r in sorted(ranks)]
        return "; ".join(parts)

    def post(self, key: tuple, value: torch.Tensor) -> None:
        """Leave ``value`` in the mailbox ``key`` (sender, receiver, axes, tag); no waiting."""
        with self.cond:
            self.mail.setdefault(key, deque()).append(value)
            self.cond.notify_all()

    def take(self, key: tuple, what: str) -> torch.Tensor:
        """The oldest tensor in mailbox ``key``, waiting for one (or for a failure)."""
        sender, receiver = key[0], key[1]
        deadline = time.monotonic() + self.timeout
        with self.cond:
            self.waiting[receiver] = what
            try:
                while not self.mail.get(key):
                    stop = self._hopeless((sender,))
                    if stop is not None:
                        raise CommError(f"{what} {stop}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CommError(f"{what} called at {user_call_site()} received nothing within "
                                        f"{self.timeout:g} s: the sender never sent it "
                                        f"({self._doing((sender,))})")
                    self.cond.wait(min(left, 1.0))
            finally:
                self.waiting.pop(receiver, None)
            box = self.mail[key]
            value = box.popleft()
            if not box:
                del self.mail[key]
        return value

    def exchange(self, key: tuple, group: tuple[int, ...], rank: int, meta: dict, value) -> dict:
        """Deposit ``value``; return ``{rank: (meta, value)}`` of the whole group."""
        deadline = time.monotonic() + self.timeout
        site = meta.get("site")
        what = f"{meta['kind']} over axes {meta['axes']}"
        with self.cond:
            if self.closed is not None:
                raise CommError(f"{what} called at {site or user_call_site()} abandoned: {self.closed}")
            slot = self.slots.setdefault(key, {"vals": {}, "reads": 0})
            slot["vals"][rank] = (meta, value)
            self.cond.notify_all()
            self.waiting[rank] = what + (f" called at {site}" if site else "")
            try:
                while len(slot["vals"]) < len(group):
                    missing = sorted(set(group) - set(slot["vals"]))
                    stop = self._hopeless(missing)
                    if stop is not None:  # the call site is looked up only now: it is slow
                        raise CommError(f"{what} called at {site or user_call_site()} {stop}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CommError(
                            f"{what} called at {site or user_call_site()} did not complete within "
                            f"{self.timeout:g} s: processors {missing} never joined it "
                            f"({self._doing(missing)}). Every processor of a group must make the same "
                            "collective calls in the same order; run with check=True to compare call "
                            "sites")
                    self.cond.wait(min(left, 1.0))
            finally:
                self.waiting.pop(rank, None)
            vals = dict(slot["vals"])
            slot["reads"] += 1
            if slot["reads"] == len(group):
                del self.slots[key]
        return vals


class ThreadsCommunicator(Communicator):
    """A thread-processor's communicator over a shared :class:`Hub`."""

    backend = "threads"
    gathers_uneven = True  # _all_gather concatenates whatever lengths arrive

    def __init__(self, hub: Hub, rank: int, check: bool = False, device: torch.device | None = None):
        super().__init__(hub.mesh, rank, check)
        self.hub = hub
        self.device = device or torch.device("cpu")  # set by the launch once the processor has one
        self._seq: dict[tuple[int, ...], int] = defaultdict(int)

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """A private copy of ``t`` to leave in the hub: the backend's staging buffer.

        The processor's tracer (the planner's, if any) does not see it,
        because it is no memory of the program's: the ``torch`` backend's transport
        buffers are invisible to the dispatcher too, and the ``meta`` backend has
        none. It lives until the *last* member of the group has read it, a moment
        that depends on thread timing, so counting it would make a processor's
        measured peak vary between runs (see ``docs/planner.md``).
        """
        with self.unseen():
            return t.detach().clone()

    def _meet(self, call: dict, group, value) -> list:
        """Deposit ``value`` with ``call``'s description; the group's values in group order,
        once every member's description has been compared with the others'."""
        self._seq[group] += 1
        vals = self.hub.exchange((group, self._seq[group]), group, self.rank, call, value)
        compare_calls({r: m for r, (m, _) in vals.items()}, group, self.mesh)
        return [vals[r][1] for r in group]

    def _meet_here(self, call: dict, group, t: torch.Tensor) -> list:
        """:meth:`_meet` with a staged copy of ``t``; the group's values on ``t``'s device.
        On CUDA each thread-processor has its own GPU, so the others' copies are on theirs;
        all threads share each device's default stream, so a copy here is queued after the
        staging copy its owner queued before depositing it."""
        parts = self._meet(call, group, self._stage(t))
        return [p if p.device == t.device else p.to(t.device) for p in parts]

    def _all_reduce(self, t, axes, group, op, call):
        return reduce_stack(self._meet_here(call, group, t), op)

    def _all_gather(self, t, axes, group, dim, call):
        return torch.cat(self._meet_here(call, group, t), dim)

    def _reduce_scatter(self, t, axes, group, dim, op, call):
        parts = self._meet(call, group, self._stage(t))
        me = group.index(self.rank)
        # only this processor's chunk of each part crosses devices
        chunks = [p.chunk(len(group), dim)[me].to(t.device) for p in parts]
        return reduce_stack(chunks, op).contiguous()

    def _all_to_all(self, t, axes, group, split_dim, concat_dim, call):
        parts = self._meet(call, group, self._stage(t))
        me = group.index(self.rank)
        return torch.cat([p.chunk(len(group), split_dim)[me].to(t.device) for p in parts], concat_dim)

    def _permute(self, t, axes, group, sources, call):
        parts = self._meet(call, group, self._stage(t))
        src = sources[group.index(self.rank)]
        return torch.zeros_like(t) if src is None else parts[src].to(t.device, copy=True)

    def _send(self, t, axes, group, dst, tag):
        self.hub.post((self.rank, group[dst], axes, tag), self._stage(t))

    def _recv(self, axes, group, src, tag):
        what = f"recv along {axes} from processor {group[src]} (tag {tag})"
        got = self.hub.take((group[src], self.rank, axes, tag), what)
        return got if self.device is None or got.device == self.device else got.to(self.device)

    def _broadcast(self, t, axes, group, src, call):
        # only the source's tensor is read, so only the source stages a copy
        mine = self._stage(t) if group.index(self.rank) == src else None
        return self._meet(call, group, mine)[src].to(t.device, copy=True)

    def _barrier(self, call):
        self._meet(call, tuple(range(self.mesh.size)), None)
