"""Run this processor's actions of a schedule table (one stage of the pipeline).

Stage ``s`` walks its row of the table in slot order. A forward receives the
micro-batch's activation from stage ``s-1`` (stage 0 takes the micro-batch
itself), runs the stage, and sends the output to ``s+1`` (the last stage
applies the loss instead). A backward receives the output gradient from
``s+1`` (the last stage starts from its loss), backpropagates through the
stage, and sends the input gradient to ``s-1``. Transfers go through the
communicator's point-to-point ``send``/``recv`` along the pipeline axis; a
send never waits, so a stage only ever waits for data the table says another
stage produces earlier, and a valid table cannot deadlock.

A table with weight-gradient actions (``"zb"``) splits the backward: ``B``
computes only the input gradients (``torch.autograd.grad`` on the stage's
inputs, keeping the graph and the gradients flowing into the ops the
parameters feed) and sends them on; ``W``, later, computes the parameters'
gradients from those kept gradients and accumulates them, as
``torch.distributed.pipelining`` does (:mod:`~meshtorch.pipeline.split_backward`:
each part of the backward runs once); a stage that is not an ``nn.Module``
gets no weight gradients.

With virtual stages (``"interleaved"``, ``v`` model chunks per stage) the
module is a list (or ``nn.ModuleList``) of this stage's ``v`` chunks, local
chunk ``k`` being model chunk ``c = k·p + s``. The rules above hold per model
chunk: chunk ``c`` takes its activation from chunk ``c-1`` (on stage
``(c-1) mod p``), model chunk 0 takes the micro-batch, the last model chunk
applies the loss, and gradients go back from ``c+1`` to ``c``. Messages into
local chunk ``k`` carry their own tags, so a pair of stages that exchanges
several chunks' activations never confuses them; with one stage (``p = 1``)
the chunks hand values to each other in memory. ZB-V (``"zbv"``) places its two
chunks per stage in a V (:func:`~meshtorch.pipeline.schedule.where`: chunk ``c``
and ``2p-1-c`` on stage ``c``): the last stage hands chunk ``p-1``'s values to
chunk ``p`` in memory, and stage 0 holds both the first and the last chunk.

Each micro-batch's loss is divided by the number of micro-batches, so the
accumulated gradient is that of the mean of the micro-batch losses: for a
loss that is a mean over the micro-batch, the gradient of the whole batch.

A table may hold several batches: before each action the executor calls
``bind(version)`` with the weight version the table tags it with, and at each
batch's update slot ``on_update(batch)`` (the caller applies the optimizer
there); :class:`~meshtorch.pipeline.Pipeline` supplies both.

With ``recompute`` a forward keeps only its input (and the random-number
state: torch's generator and meshtorch's stream counter) and the backward
runs the stage forward again before backpropagating.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.pipeline import build_schedule
    >>> from meshtorch.pipeline.executor import Executor
    >>> def f():
    ...     torch.manual_seed(0)
    ...     stages = [torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)]
    ...     ex = Executor(stages[mt.current().coords["stage"]], "stage", lambda y, t: ((y - t) ** 2).mean())
    ...     x, t = torch.ones(4, 3), torch.zeros(4, 1)
    ...     loss = ex.run(build_schedule("1f1b", 2, 2), list(x.chunk(2)), list(t.chunk(2)))
    ...     return [k for k, *_ in ex.trace], loss is None
    >>> mt.launch(f, mesh="stage:2")
    [(['F', 'F', 'B', 'B'], True), (['F', 'B', 'F', 'B'], False)]
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshtorch.context import current, phase
from meshtorch.errors import CommError, PipelineError
from meshtorch.pipeline.schedule import BACKWARD, FORWARD, WEIGHT, Schedule, model_chunk_of, where
from meshtorch.pipeline.split_backward import Kept, input_gradient, weight_gradient
from meshtorch.pipeline.transport import leaves, local, recv_value, send_value
from meshtorch.tensor import MeshTensor

# tags keep activations (forward) and gradients (backward) of one pair of stages apart
FORWARD_TAG, BACKWARD_TAG = 1, 2
CHUNK_TAGS = 4  # a message into local chunk k has tag kind + 4k (tag 3 is lm.gather_whole's)


def chunk_tag(kind: int, chunk: int) -> int:
    """The tag of a message of ``kind`` (:data:`FORWARD_TAG`, :data:`BACKWARD_TAG`) into the
    receiver's local chunk ``chunk``; the plain tags for chunk 0.

    Example:
        >>> chunk_tag(FORWARD_TAG, 0), chunk_tag(BACKWARD_TAG, 1)
        (1, 6)
    """
    return kind + CHUNK_TAGS * chunk


def chunks_of(module: Any) -> list:
    """The model chunks a stage runs: the items of a list, tuple or ``nn.ModuleList``
    (virtual stages), else ``[module]``.

    Example:
        >>> import torch
        >>> len(chunks_of(torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 3))), len(chunks_of(abs))
        (3, 1)
    """
    return list(module) if isinstance(module, (list, tuple, torch.nn.ModuleList)) else [module]


def _detached(value: Any) -> Any:
    """``value`` as :func:`send_value` delivers it: every leaf detached."""
    def one(x: Any) -> Any:
        t = local(x)
        if t is None:
            return x
        return MeshTensor(t.detach(), x.shape, x.layout) if isinstance(x, MeshTensor) else t.detach()

    return tuple(map(one, value)) if isinstance(value, tuple) else one(value)


def _as_leaf(x: Any) -> Any:
    """A received activation as a fresh autograd leaf (floating tensors only)."""
    t = local(x)
    if t is None or not t.is_floating_point():
        return x
    t = t.detach().requires_grad_(True)
    return MeshTensor(t, x.shape, x.layout) if isinstance(x, MeshTensor) else t


def _add(totals: list, b: int, loss: torch.Tensor) -> None:
    """Add a micro-batch's loss to batch ``b``'s total."""
    totals[b] = loss if totals[b] is None else totals[b] + loss


def _call(module: Callable, value: Any) -> Any:
    return module(*value) if isinstance(value, tuple) else module(value)



def refuse_inference_mode() -> None:
    """A training step builds autograd graphs, which ``torch.inference_mode()`` forbids: say so."""
    if torch.is_inference_mode_enabled():
        raise PipelineError("a training step cannot run under torch.inference_mode(): it builds autograd "
                            "graphs; step outside it, or evaluate with Pipeline.loss()")


def _marked_update(on_update: Callable[[int], None], batch: int) -> None:
    """``on_update(batch)`` marked as the "update" phase: the planner prices it apart from the
    micro-batches (:func:`meshtorch.context.phase`)."""
    with phase("update"):
        on_update(batch)

class Executor:
    """One stage of a pipeline: runs its row of a schedule table.

    Args:
        module: the stage (an ``nn.Module`` or any callable of the previous
            stage's output, a tuple being unpacked into arguments); with virtual
            stages, a list or ``nn.ModuleList`` of this stage's chunks (local
            chunk ``k`` is model chunk ``k·p + stage``).
        axis: the mesh axis along which stages lie; this processor's
            coordinate on it is its stage.
        loss_fn: ``loss_fn(output, target)`` on the last model chunk, a scalar
            tensor or MeshTensor (a mean over the micro-batch).
        recompute: activation recomputation (see the module docstring).
    """

    def __init__(self, module: Callable | Sequence[Callable], axis: str, loss_fn: Callable | None,
                 recompute: bool = False):
        ctx = current()
        if axis not in ctx.mesh.axis_names:
            raise PipelineError(f"the pipeline axis {axis!r} is not an axis of the mesh '{ctx.mesh}'; "
                                f"add it, e.g. mesh='{axis}:2,...', or pass axis=<one of "
                                f"{list(ctx.mesh.axis_names)}>")
        self.module = module
        self.chunks = chunks_of(module)
        if not self.chunks:
            raise PipelineError("a stage needs at least one model chunk, got an empty list")
        self.axis = axis
        self.loss_fn = loss_fn
        self.recompute = recompute
        self.stage = ctx.coords[axis]
        self.stages = ctx.mesh.axis_size(axis)
        # (kind, micro-batch, start, end, weight version) of the last run, in the order executed: the
        # compute only, after the inputs arrived and before the outputs are sent; and each one's local chunk
        self.trace: list[tuple[str, int, float, float, int]] = []
        self.trace_chunks: list[int] = []
        # values one chunk hands to another on this same stage (p = 1, or the V's turn), by tag, in order
        self._here: dict[int, deque] = {}
        # per other stage, the (kind, model chunk, micro-batch) of the messages it will send this stage, in
        # its order; and those received before they were needed
        self._inbox: dict[int, deque] = {}
        self._arrived: dict[tuple[int, int, int], Any] = {}
        self._where: Callable[[int], tuple[int, int]] = functools.partial(where, stages=self.stages)

    def _fail(self, what: str, i: int, e: Exception, schedule: Schedule, chunk: int = 0) -> PipelineError:
        m = schedule.microbatches
        where = f"micro-batch {i % m} of batch {i // m}" if schedule.batches > 1 else f"micro-batch {i}"
        if len(self.chunks) > 1:
            c = model_chunk_of(self.stage, chunk, self.stages, schedule.placement)
            where += f" on its chunk {chunk} (model chunk {c})"
        return PipelineError(f"stage {self.stage} of axis {self.axis!r} raised {type(e).__name__} in the "
                             f"{what} of {where}: {e}")

    @contextlib.contextmanager
    def _errors(self, what: str, i: int, schedule: Schedule, chunk: int = 0):
        """A stage's error as a :class:`PipelineError` naming the stage and micro-batch
        (communication errors pass through: they already name the failed stage)."""
        try:
            yield
        except CommError:
            raise
        except Exception as e:
            raise self._fail(what, i, e, schedule, chunk) from e

    def _send(self, comm, value: Any, chunk: int, kind: int) -> None:
        """Send ``value`` (``kind``: forward or backward) to model chunk ``chunk``."""
        dst, local_chunk = self._where(chunk)
        tag = chunk_tag(kind, local_chunk)
        if dst == self.stage:
            self._here.setdefault(tag, deque()).append(_detached(value))
        else:
            send_value(comm, value, self.axis, dst, tag)

    def _recv(self, comm, chunk: int, mine: int, kind: int, microbatch: int) -> Any:
        """Receive the value of ``kind`` model chunk ``chunk`` sends to this stage's model chunk ``mine``
        for ``microbatch``. From another stage the messages are taken in the order that stage sends
        them (:meth:`_expect`), those that come before this one kept until asked for: NCCL ignores
        tags and matches a pair's messages in order, and under ZB-V a stage receives a peer's
        activations and gradients in another order than the peer sends them."""
        src = self._where(chunk)[0]
        if src == self.stage:
            return self._here[chunk_tag(kind, self._where(mine)[1])].popleft()
        key = (kind, mine, microbatch)
        while key not in self._arrived:
            if not self._inbox.get(src):
                raise PipelineError(f"stage {self.stage} waits for a message from stage {src} that the "
                                    "schedule table never sends it: the table and the executor disagree")
            k, c, i = self._inbox[src].popleft()
            self._arrived[k, c, i] = recv_value(comm, self.axis, src, chunk_tag(k, self._where(c)[1]))
        return self._arrived.pop(key)

    def _expect(self, schedule: Schedule, train: bool) -> None:
        """For each other stage, the messages it sends this stage, in the order it sends them: a
        forward of model chunk ``c`` sends its output to chunk ``c+1``, a backward (``train``) its
        input gradient to ``c-1``, right after running (actions in slot order)."""
        n, s = schedule.stages * schedule.virtual_stages, self.stage
        self._inbox, self._arrived = {}, {}
        for a in schedule.actions:
            c = schedule.model_chunk(a)
            if a.kind == FORWARD and c < n - 1:
                kind, to = FORWARD_TAG, c + 1
            elif a.kind == BACKWARD and train and c > 0:
                kind, to = BACKWARD_TAG, c - 1
            else:
                continue
            if a.stage != s and self._where(to)[0] == s:
                self._inbox.setdefault(a.stage, deque()).append((kind, to, a.microbatch))

    def _check(self, schedule: Schedule) -> None:
        v = len(self.chunks)
        if schedule.virtual_stages != v:
            raise PipelineError(f"schedule {schedule.name!r} has {schedule.virtual_stages} model chunk(s) "
                                f"per stage but stage {self.stage} holds {v}; pass a list of "
                                f"{schedule.virtual_stages} chunks (local chunk k = model chunk k·p + stage) "
                                f"or build the table with virtual_stages={v}")
        if schedule.stages != self.stages:
            raise PipelineError(f"schedule {schedule.name!r} has {schedule.stages} stages but axis "
                                f"{self.axis!r} has {self.stages} processors")
        self._where = schedule.where  # model chunk -> (stage, local chunk): the table's placement

    def _evaluate(self, schedule: Schedule, inputs, targets) -> Any:
        comm = current().comm
        s, m = self.stage, schedule.microbatches
        n = self.stages * len(self.chunks)
        holds_last = s == schedule.where(n - 1)[0]
        totals: list[torch.Tensor | None] = [None] * schedule.batches
        self._here = {}
        self._expect(schedule, train=False)
        for a in schedule.for_stage(s):
            if a.kind != FORWARD:
                continue
            i, c = a.microbatch, schedule.model_chunk(a)
            last = c == n - 1
            inp = inputs[i] if c == 0 else self._recv(comm, c - 1, c, FORWARD_TAG, i)
            with self._errors("forward", i, schedule, a.chunk):
                out = self._forward(self.chunks[a.chunk], inp, targets[i] if last else None, last)
            if last:
                _add(totals, schedule.batch_of(i), local(out).detach().reshape(()) / m)
            else:
                self._send(comm, out, c + 1, FORWARD_TAG)
        comm.wait_sends()
        return torch.stack(totals) if holds_last else None

    def _forward(self, module: Callable, inp: Any, target: Any, last: bool) -> Any:
        out = _call(module, inp)
        if not last:
            return out
        if self.loss_fn is None:
            raise PipelineError("the last stage needs a loss_fn(output, target) to start the backward")
        loss = self.loss_fn(out, target)
        value = loss.local if isinstance(loss, MeshTensor) else loss
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else \
                f"a {type(loss).__name__}"
            raise PipelineError(f"loss_fn returned {got}; it must return a scalar tensor, the mean over the "
                                "micro-batch (e.g. reduction='mean')")
        return loss

    def run(self, schedule: Schedule, inputs: Sequence[Any] | None, targets: Sequence[Any] | None,
            train: bool = True, on_update: Callable[[int], None] | None = None,
            bind: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """Run this stage's actions; ``inputs`` (stage 0, which holds model chunk 0) and
        ``targets`` (the last stage, which holds the last model chunk) are per micro-batch
        of the table (``batches × microbatches`` of them). Gradients accumulate in the
        chunks' parameters.

        Returns, on the last stage, the mean micro-batch loss of each batch (a
        detached 1-D tensor), ``None`` elsewhere. ``bind(version)`` runs before each
        action with the weight version the table tags it with (the caller puts
        those weights in the module); ``on_update(batch)`` runs at the table's
        update slot of each batch (:meth:`Schedule.update_slot`, the same slot on
        every stage, so it may call collectives over the stages), or after the
        last action. ``train=False`` runs only the forwards, without gradients
        (evaluation)."""
        self._check(schedule)
        if not train:
            with torch.no_grad():
                return self._evaluate(schedule, inputs, targets)
        refuse_inference_mode()
        with torch.enable_grad():  # a step trains even inside the caller's torch.no_grad()
            return self._train(schedule, inputs, targets, on_update, bind)

    def _train(self, schedule: Schedule, inputs: Sequence[Any] | None, targets: Sequence[Any] | None,
               on_update: Callable[[int], None] | None, bind: Callable[[int], None] | None
               ) -> torch.Tensor | None:
        comm = current().comm
        s, m, nb = self.stage, schedule.microbatches, schedule.batches
        n = self.stages * len(self.chunks)  # model chunks
        first, holds_last = s == schedule.where(0)[0], s == schedule.where(n - 1)[0]
        given = (("inputs", inputs if first else None), ("targets", targets if holds_last else None))
        for name, seq in given:
            if seq is not None and len(seq) != m * nb:
                raise PipelineError(f"stage {s}: {len(seq)} micro-batch {name} for {nb} batch(es) of {m} "
                                    "micro-batches")
        updates = [schedule.update_slot(b) for b in range(nb)]
        update = None if on_update is None else functools.partial(_marked_update, on_update)
        done = 0  # batches whose update ran
        split = schedule.split_backward
        # (local chunk, micro-batch) -> the forward's stash; -> (outputs, their gradients) for its W
        stash: dict[tuple[int, int], tuple] = {}
        pending: dict[tuple[int, int], Kept] = {}
        totals: list[torch.Tensor | None] = [None] * nb
        self.trace, self.trace_chunks = [], []
        self._here = {}
        self._expect(schedule, train=True)
        for a in schedule.for_stage(s):
            while update is not None and done < nb and updates[done] <= a.slot:
                update(done)
                done += 1
            if bind is not None:
                bind(a.version)
            i, k, c = a.microbatch, a.chunk, schedule.model_chunk(a)
            module, start, last = self.chunks[k], c == 0, c == n - 1
            if a.kind == FORWARD:
                inp = inputs[i] if start else self._recv(comm, c - 1, c, FORWARD_TAG, i)
                inp = inp if start else tuple(map(_as_leaf, inp)) if isinstance(inp, tuple) else _as_leaf(inp)
                t0 = time.perf_counter()
                target = targets[i] if last and targets is not None else None
                rng = (torch.get_rng_state(), current().random_calls)
                with self._errors("forward", i, schedule, k), \
                        torch.no_grad() if self.recompute else torch.enable_grad():
                    out = self._forward(module, inp, target, last)
                t1 = time.perf_counter()
                if not last:
                    self._send(comm, out, c + 1, FORWARD_TAG)
                stash[k, i] = (inp, target, rng, None if self.recompute else out)
            elif a.kind == WEIGHT:
                t0 = time.perf_counter()
                with self._errors("weight gradient", i, schedule, k):
                    weight_gradient(pending.pop((k, i)))
                t1 = time.perf_counter()
            else:
                inp, target, rng, out = stash.pop((k, i))
                grads = None if last else self._recv(comm, c + 1, c, BACKWARD_TAG, i)
                t0 = time.perf_counter()
                with self._errors("backward", i, schedule, k):
                    if out is None:  # recompute: the same random numbers as the first forward
                        saved = (torch.get_rng_state(), current().random_calls)
                        torch.set_rng_state(rng[0])
                        current().random_calls = rng[1]
                        out = self._forward(module, inp, target, last)
                        torch.set_rng_state(saved[0])
                        current().random_calls = saved[1]
                    if last:
                        loss = local(out) / m
                        pairs = [(loss, None)]
                        _add(totals, schedule.batch_of(i), loss.detach())
                    else:
                        pairs = [(local(o), g) for o, g in zip(leaves(out), leaves(grads))
                                 if g is not None and local(o) is not None and local(o).requires_grad]
                    outs, out_grads = [o for o, _ in pairs], [g for _, g in pairs]
                    if split:  # B: the input gradient only; the graph stays for this micro-batch's W
                        params = list(module.parameters()) if isinstance(module, torch.nn.Module) else []
                        pending[k, i] = input_gradient(outs, out_grads, [] if start else
                                                       [local(x) for x in leaves(inp)], params)
                    elif pairs:
                        torch.autograd.backward(outs, out_grads)
                t1 = time.perf_counter()
                if not start:
                    in_grads = tuple(None if local(x) is None else local(x).grad for x in leaves(inp))
                    self._send(comm, in_grads if isinstance(inp, tuple) else in_grads[0], c - 1, BACKWARD_TAG)
            self.trace.append((a.kind, i, t0, t1, a.version))
            self.trace_chunks.append(k)
        comm.wait_sends()
        while update is not None and done < nb:
            update(done)
            done += 1
        if not holds_last:
            return None
        return torch.stack([t.reshape(()) for t in totals])
