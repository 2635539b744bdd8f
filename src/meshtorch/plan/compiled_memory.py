"""What a compiled step holds: the traced storages' lifetimes as ``torch.compile`` keeps them.

A step traced with ``compiled=True`` records its ops in order with the storages each reads and
writes (:data:`~meshtorch.plan.kernels.SequenceOp`) and where each op stands among the tracer's
allocation events. Inductor changes what is alive in three ways, modelled here after its defaults
(checked on an H200, torch 2.11: what the compiled step saves for the backward and its peak):

- **fusion**: a run of consecutive memory-bound ops is one kernel
  (:func:`~meshtorch.plan.kernels.fusible_runs`); a storage the run makes and only the run
  reads lives in registers, never in memory (the float32 copy of the logits a loss upcasts);
- **recomputation** (the min-cut partitioner of ``torch._functorch.partitioners``): a storage a
  forward run makes and the backward reads again, only in fused runs, is not saved when the run's
  inputs cost less to keep until then (those already alive then cost nothing): it is dropped after
  its forward uses (never made, where only its own run reads it forward) and remade inside the
  backward's fused kernel. The log-softmax of the loss (float32, vocabulary-wide) is remade from
  the bf16 logits. What an unfused backward op reads (a matmul's weight gradient: GELU's output,
  a bf16 copy of a weight or of a layer norm's output) is saved, as the partitioner's
  ``ban_recompute_materialized_backward`` does: remade, it would be made in memory anyway;
- **in-place buffers**: a fused kernel writes a result into an input of the same size that it
  reads for the last time (the loss's backward writes the logits' gradient into the saved
  logits): one storage, never both alive; not where a storage remade later is made from that
  input, nor where the input is held past the result's end.

:func:`compiled_timeline` returns the events re-timed; :func:`peak_of` their peak by kind in the
measured windows, what :meth:`meshtorch.plan.tracing.Tracer.peak` reports for a compiled trace.

Example:
    >>> from meshtorch.plan.compiled_memory import compiled_timeline
    >>> mul = ("mul", "float32", 0, 8, (), 1, 0)
    >>> mm = ("mm", "float32", 64, 8, (1, 2, 2, 2), 1, 0)
    >>> # x (1) -> mul -> y (2) -> mul -> z (3) -> mm -> w (4): y lives only inside the fused run
    >>> seq = [(mul, ((1, 4),), ((2, 4),)), (mul, ((2, 4),), ((3, 4),)), (mm, ((3, 4),), ((4, 4),))]
    >>> events = [(1, 4), (2, 4), (3, 4), (2, -4), (4, 4)]
    >>> [(s, d) for _, s, d in compiled_timeline(seq, [2, 3, 5], [False] * 3, events, {})]
    [(1, 4), (3, 4), (4, 4)]
"""

from __future__ import annotations

import math

from meshtorch.plan.kernels import SequenceOp, fusible_runs

Timeline = list[tuple[float, int, int]]  # (position among the events, storage serial, +bytes / -bytes)


def compiled_timeline(sequence: list[SequenceOp], at: list[int], backward: list[bool],
                      events: list[tuple[int, int]], kind: dict[int, str],
                      dtypes: dict[int, object] | None = None) -> Timeline:
    """``events`` (``(serial, +bytes | -bytes)`` in time order) as a compiled step has them:
    each at its index, storages internal to a fused run gone, recomputed ones freed after their
    forward uses (their run's inputs kept instead, until the backward's last read) and remade
    where the backward reads them, a fused run's result written into an input of the same size
    that the run reads last (one storage: the input's allocation, the result's free). ``at[i]``
    is the event count once op ``i`` of ``sequence`` made its outputs; ``backward[i]`` whether it
    ran in the backward; ``kind`` the serials that are not activations (only activations are
    dropped, recomputed or taken over); ``dtypes`` each serial's dtype, where known (a storage is
    taken over only by a result of its dtype, as Inductor's buffer reuse asks)."""
    alloc: dict[int, int] = {}
    free: dict[int, float] = {}
    size: dict[int, int] = {}
    for idx, (serial, delta) in enumerate(events):
        if delta >= 0:
            alloc.setdefault(serial, idx)
            size.setdefault(serial, delta)
        else:
            free[serial] = idx
    reads: dict[int, list[int]] = {}
    made: dict[int, int] = {}
    for i, (_, rd, wr) in enumerate(sequence):
        for serial, _ in rd:
            reads.setdefault(serial, []).append(i)
        start = at[i - 1] if i else 0
        for serial, _ in wr:   # made by this op: a storage it allocated, not one it updates in place
            if serial not in made and start <= alloc.get(serial, -1) < at[i]:
                made[serial] = i
    in_run: set[int] = set()
    runs = fusible_runs(sequence, backward)
    for i0, j in runs:
        in_run.update(range(i0, j))
    removed: set[int] = set()
    moved: set[int] = set()   # storages whose free the recomputation moved
    remade_until: dict[int, int] = {}  # an input a recomputed storage is remade from -> its last remake
    for i0, j in runs:
        ours = [s for s, i in made.items() if i0 <= i < j and kind.get(s, "activations") == "activations"]
        inputs = {s for i in range(i0, j) for s, _ in sequence[i][1] if not i0 <= made.get(s, -1) < j}
        for s in ours:
            later = [r for r in reads.get(s, []) if r >= j]
            if not later:
                # read only inside the run (and freed): it never leaves the fused kernel
                if reads.get(s) and s in free:
                    removed.add(s)
                continue
            if backward[made[s]] or not backward[later[-1]]:
                continue   # not saved from the forward for the backward: nothing to recompute
            if any(backward[r] and r not in in_run for r in later):
                continue   # a backward matmul (or another unfused op) reads it: it is saved
            forward = [r for r in later if not backward[r]]
            last = later[-1]
            keep = sum(size.get(x, 0) for x in inputs
                       if x not in removed and free.get(x, math.inf) < at[last])
            if keep >= size.get(s, 0):
                continue   # saving it is cheaper than saving what remakes it
            if forward:
                free[s] = at[forward[-1]] - 0.25
                moved.add(s)
            else:   # only its run reads it forward: never leaves that kernel (the backward's remakes it)
                removed.add(s)
            for x in inputs:
                remade_until[x] = max(remade_until.get(x, -1), last)
                if x in free and free[x] < at[last]:
                    free[x] = at[last] - 0.25
                    moved.add(x)
    # a fused kernel writes a result into an input it reads last (Inductor's in-place buffers: the
    # loss's gradient into the saved logits): one storage, never both alive. Not an input that a
    # remade storage still needs, nor one held past the result's end (the caller's); of the same
    # bytes and dtype (where ``dtypes`` says), as Inductor's buffer reuse asks
    continued: dict[int, int] = {}   # a result written into an input's storage -> that input
    ended: set[int] = set()          # inputs whose storage a result took over: no free of their own
    for i0, j in runs:
        dying = [x for x in dict.fromkeys(x for i in range(i0, j) for x, _ in sequence[i][1])
                 if not i0 <= made.get(x, -1) < j and x in free and x not in moved | removed | ended
                 and kind.get(x, "activations") == "activations" and i0 <= reads[x][-1] < j
                 and remade_until.get(x, -1) < j]
        for o in (s for s, i in made.items() if i0 <= i < j and s not in removed | moved):
            if kind.get(o, "activations") != "activations":
                continue
            x = next((x for x in dying if size[x] == size[o] and free[x] <= free.get(o, math.inf)
                      and (dtypes is None or dtypes.get(x) == dtypes.get(o))), None)
            if x is not None:
                dying.remove(x)
                continued[o] = x
                ended.add(x)
    out: Timeline = []
    for idx, (serial, delta) in enumerate(events):
        if serial in removed or (serial in continued if delta >= 0 else serial in ended):
            continue
        at_ = free[serial] if delta < 0 else float(idx)
        while serial in continued:   # the storage it was written into frees (the first of a chain)
            serial = continued[serial]
        out.append((at_, serial, delta))
    out.sort(key=lambda e: e[0])
    return out


def peak_of(timeline: Timeline, windows: list[tuple[int, int]], kind: dict[int, str],
            kinds: tuple[str, ...]) -> tuple[int, dict[str, int]]:
    """The most bytes alive at once in ``windows`` (event index ranges; what is alive as a window
    begins counts too, also in a window no event falls in) and their split by ``kinds`` at that
    moment (``kind``: a serial's, when not ``activations``). The one computation of a peak: the
    eager trace's (:meth:`meshtorch.plan.tracing.Tracer.peak`, its events at their indices) and
    the compiled one's (:func:`compiled_timeline`'s).

    Example:
        >>> from meshtorch.plan.compiled_memory import peak_of
        >>> peak_of([(0.0, 1, 8), (1.0, 2, 4), (1.5, 1, -8), (2.0, 3, 2)], [(1, 3)], {1: "parameters"},
        ...         ("parameters", "activations"))
        (12, {'parameters': 8, 'activations': 4})
    """
    windows = windows or [(0, math.inf)]
    best, best_at, live, w, entered = 0, -1, 0, 0, False
    for idx, (pos, _, delta) in enumerate(timeline):
        while w < len(windows) and pos >= windows[w][1]:
            if not entered and live > best:  # a window no event falls in: alive all through it
                best, best_at = live, idx - 1
            w, entered = w + 1, False
        if w < len(windows) and pos >= windows[w][0]:
            if not entered and live > best:
                best, best_at = live, idx - 1   # alive as the window begins
            entered = True
            live += delta
            if live > best:
                best, best_at = live, idx
        else:
            live += delta
    if w < len(windows) and not entered and live > best:  # windows after the last event
        best, best_at = live, len(timeline) - 1
    alive: dict[int, int] = {}
    for _, serial, delta in timeline[: best_at + 1]:
        if delta >= 0:
            alive[serial] = delta
        else:
            alive.pop(serial, None)
    by_kind = dict.fromkeys(kinds, 0)
    for serial, n in alive.items():
        by_kind[kind.get(serial, "activations")] += n
    return best, by_kind
