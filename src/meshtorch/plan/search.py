"""``mt.plan.search``: the fastest mesh shape and layout rules that fit in memory.

The search is *exact over its space*: every candidate it ranks is traced on
the meta backend and costed (:mod:`meshtorch.plan.estimate`); nothing is
guessed from a surrogate. Each concern has its module:

- the space (:mod:`meshtorch.plan.space`): meshes of the processor count (one,
  two or three axes) and the rule sets a few families propose for the model's
  dims, named by their role (:class:`meshtorch.plan.program.SpaceDims`: the
  program's ``dims``), pruned by divisibility; and, for a program that can be
  pipelined, a ``stage`` axis in front of each smaller layout with its
  micro-batch counts. Its size grows with the divisors of the processor count
  and the number of model dims: for the Mesh-TensorFlow paper's 4.9B 6-layer LM
  (d_ff 262144, 256 heads; ``tests/test_plan_space.py`` counts them),
  16 SPMD candidates on 2 processors, 84 on 8, 186 on 64 and 260 on 512 (an
  MoE's experts add about half), and the pipelined family 3, 198, 810 and
  1,104 more (``max_candidates`` caps the total).
- the bounds (:mod:`meshtorch.plan.bounds`): from one replicated trace, lower
  bounds on every candidate's step time and memory, in microseconds each.
- the loop (here): branch and bound. Candidates are traced in order of their
  time bound until the bound reaches the best step time found; those whose
  parameters alone overflow memory are not traced. A pipelined candidate is
  first probed with one micro-batch (:func:`meshtorch.plan.pipeline.microbatch_work`,
  a tighter lower bound for a fraction of a stage trace). The answer is the one
  tracing every candidate would give.
- the answer (:mod:`meshtorch.plan.ranking`): :class:`SearchResult` ranks the traced
  and the pruned candidates and says why each ranks where it does.

No integer program is needed (``scipy.optimize.milp`` would need a separable
cost model, which the collective costs are not: the bytes an all_reduce moves
along ``b`` depend on how ``m`` splits the same tensor). To keep each traced
candidate cheap, a program that can be rebuilt with fewer layers
(:class:`meshtorch.plan.program.Program` ``layers`` > 0, as ``meshtorch
plan``'s training step) is traced at two shallow depths one period apart and
extrapolated linearly (:mod:`meshtorch.plan.layered`), and its forward and
backward without the update (``without_update``) prune first. The best
candidates are then traced in full, so the numbers reported for them are not
extrapolated.

Example:
    >>> import meshtorch as mt
    >>> def step():
    ...     ff = mt.nn.Dense(mt.Dim("d_model", 64), mt.Dim("d_ff", 256), bias=False)
    ...     x = mt.random.normal("batch:32,d_model:64", seed=1)
    ...     with mt.plan.measure():
    ...         mt.reduce_sum(ff(x)).backward()
    >>> res = mt.plan.search(step, 2, device="a100")
    >>> res.best.fits, res.best.step_seconds <= min(c.step_seconds for c in res.candidates)
    (True, True)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from meshtorch.errors import PlanError
from meshtorch.mesh import Mesh
from meshtorch.pipeline.simulate import chain_share, step_time_bound
from meshtorch.plan.bounds import REFERENCE_MESH, Candidate, dims_of, lower_bounds, stage_bounds
from meshtorch.plan.devices import DeviceSpec
from meshtorch.plan.devices import device as get_device
from meshtorch.plan.estimate import Estimate, from_trace
from meshtorch.plan.layered import (
    MAX_TRACED_LAYERS,
    check_pipelined_depth,
    lin,
    settled_extrapolation,
    shallow_programs,
)
from meshtorch.plan.pipeline import estimate_pipeline, microbatch_work, program_pipeline
from meshtorch.plan.program import Program, program_of
from meshtorch.plan.ranking import Pruned, SearchResult, rank_key
from meshtorch.plan.space import meshes_for, pipeline_layouts, rules_for
from meshtorch.plan.tracing import Trace, trace


def search(step_fn: Callable[[], Any] | Program, processors: int | str | Mesh,
           device: str | DeviceSpec = "tpu-v2", *, verify: int = 3, meshes: Iterable[str] | None = None,
           algorithm: str = "ring", max_candidates: int = 100_000, pipeline: bool = True,
           staging: str = "none", axes: int = 2, compiled: bool = False) -> SearchResult:
    """Search mesh shapes and layout rules for the fastest step that fits ``device``'s memory.

    ``processors`` is a processor count (meshes are searched) or a mesh (only
    rules are). Returns a :class:`SearchResult` whose ``rules`` and ``mesh``
    can be pasted; ``result.table(top)`` ranks the ``top`` candidates with the
    reason for each (which collectives dominate, what does not fit).

    Branch and bound: every candidate gets cheap lower bounds
    (:func:`~meshtorch.plan.bounds.lower_bounds`);
    candidates are traced in order of their time bound until the bound reaches
    the best step time found, and those whose parameters alone overflow memory
    are not traced. The result is the same as tracing every candidate.

    ``step_fn`` is a :class:`~meshtorch.plan.program.Program` (what it declares: its layers, its
    update-less part, its pipelined form, the roles of its dims) or any callable (a program that
    declares nothing, :func:`~meshtorch.plan.program.program_of`).

    With ``pipeline`` (the default), a program that can be pipelined (its ``pipelined(microbatches)``
    is not None, as ``meshtorch plan``'s LM training step) and a processor
    count also searches the pipelined family (:func:`~meshtorch.plan.space.pipeline_layouts`, priced by
    :func:`meshtorch.plan.pipeline.estimate_pipeline`), with the same bounds divided by the
    number of stages (the busiest stage does at least the average work and holds at least the
    average parameters); :meth:`SearchResult.why` compares the two families.

    ``staging``: the backend whose collective buffers the memory holds (see
    :func:`meshtorch.plan.estimate`). ``axes=3`` adds three-axis meshes
    (:func:`~meshtorch.plan.space.meshes_for`), worth it when the device's links differ per axis.

    ``compiled``: the run compiles its step (``torch.compile``), so every candidate is priced as
    that step (``trace(compiled=True)``: runs of memory-bound ops fused, the host launching
    kernels), not as the eager one. The bounds stay bounds: they count FLOPs, parameters and the
    gradients' all_reduce, which compiling does not change. The pipelined family is left out
    (``meshtorch train`` does not compile pipelined steps).
    """
    t0 = time.perf_counter()
    if isinstance(processors, int):
        mesh_list = list(meshes) if meshes is not None else meshes_for(processors, axes)
    else:
        mesh_list = [str(Mesh(processors))]
    n = Mesh(mesh_list[0]).size
    spec = get_device(device, processors=n)
    program = program_of(step_fn)
    pipelines = (pipeline and not compiled and isinstance(processors, int) and meshes is None
                 and program.pipelined(1) is not None)
    if pipelines:
        check_pipelined_depth(program)  # before the SPMD search: it would be lost work
    names = program.dims
    shallow = shallow_programs(program)
    quick = shallow is not None
    fns, periods = (shallow[:2], shallow[2]) if shallow is not None else ((program,), 0)
    refs = [trace(f, mesh=REFERENCE_MESH, rules="", backend="meta", device=spec.device_type) for f in fns]
    dims = dims_of(refs[0])
    sizes = {m: len(rules_for(m, dims, names)) for m in mesh_list}
    total = sum(sizes.values())
    if not total:
        raise PlanError(f"no layout of the dims {dims} divides over the meshes {mesh_list}; "
                        "pick a processor count that divides the batch or the model dims")
    if total > max_candidates:
        raise PlanError(
            f"{total} candidates exceed max_candidates={max_candidates} (rule sets per mesh: {sizes}); "
            "pass meshes=[...] with fewer meshes, or a fixed mesh, or raise max_candidates (each "
            "candidate costs a lower bound, microseconds; only those that can win are traced)")
    space = [(m, r) for m in mesh_list for r in rules_for(m, dims, names)]

    def bounds(m: str, r: str) -> tuple[float, float, float]:
        """Time and memory bounds of the whole step, and the time bound of one period of blocks."""
        b = [lower_bounds(t, m, r, spec, names) for t in refs]
        if quick:
            return (lin(b[0][0], b[1][0], periods), lin(b[0][1], b[1][1], periods), b[1][0] - b[0][0])
        return (*b[0], 0.0)

    lb = {c: bounds(*c) for c in space}
    partial = fns[0].without_update()
    order = sorted(space, key=lambda c: lb[c][0])
    done: dict[tuple[str, str], Estimate] = {}
    full: set[tuple[str, str]] = set()
    cut: dict[tuple[str, str], Pruned] = {}

    # time bounds found by tracing part of a candidate, kept for when the loop comes back to it
    traced_bound: dict[tuple[str, str], float] = {}

    def loses(c: tuple[str, str], bound: float) -> bool:
        traced_bound[c] = max(bound, traced_bound.get(c, 0.0))
        if traced_bound[c] >= best_time() * (1 + 1e-9):
            cut[c] = Pruned(c[0], c[1], traced_bound[c], lb[c][1], "time")
            return True
        return False

    def traced(f, c: tuple[str, str]) -> Trace:
        # the meta tensors stand for the priced device: the step picks its kernels (fused AdamW)
        return trace(f, mesh=c[0], rules=c[1], backend="meta", staging=staging, device=spec.device_type,
                     compiled=compiled)

    resharded = program.resharded()
    shallow_resharded = shallow_programs(resharded) if resharded is not None and quick else None

    def run(c: tuple[str, str], whole: bool) -> Estimate | None:
        e = price(program, fns, c, whole)
        if e is not None and not e.fits and resharded is not None:
            # memory is tight: free gathered parameters after forward, gather them again for backward
            # (c is in full where the estimate kept is a whole trace)
            plain_full = c in full
            full.discard(c)
            again = price(resharded, shallow_resharded[:2] if shallow_resharded else (resharded,), c, whole,
                          bound=False)
            if again is not None and again.memory_bytes["total"] < e.memory_bytes["total"]:
                return replace(again, reshard_after_forward=True)
            full.discard(c)
            if plain_full:
                full.add(c)
        return e

    def price(prog: Program, depths, c: tuple[str, str], whole: bool, bound: bool = True) -> Estimate | None:
        """``prog`` priced for ``c`` (its shallow ``depths`` extrapolated), or None if it loses."""
        if not whole and bound and partial is not None and c not in traced_bound:
            # the shallow step without its update is part of the step's work: if it and the
            # periods' bound already lose, the whole step does
            part = from_trace(traced(partial, c), c[0], spec, algorithm)
            if loses(c, part.step_seconds + periods * lb[c][2]):
                return None
        if not quick or (whole and prog.layers <= MAX_TRACED_LAYERS):
            full.add(c)
            return from_trace(traced(prog, c), c[0], spec, algorithm)
        if whole:  # a verified best deeper than MAX_TRACED_LAYERS: extrapolated, never traced whole
            full.add(c)
        t1 = traced(depths[0], c)
        e1 = from_trace(t1, c[0], spec, algorithm)
        # the bound per period is one too (it sums per-op and per-parameter bounds), so the
        # shallow step plus it may already lose: skip the deeper trace
        if not whole and bound and loses(c, e1.step_seconds + periods * lb[c][2]):
            return None
        t2 = traced(depths[1], c)
        # where the shallow steps' buckets are not capped as the deep one's, deeper ones are traced
        # (or the whole step, which is then this candidate's full trace)

        def deeper(f: Program) -> Trace:
            if f is prog:
                full.add(c)
            return traced(f, c)

        return from_trace(settled_extrapolation(prog, t1, t2, periods, deeper), c[0], spec, algorithm)

    def best_time() -> float:
        return min((e.step_seconds for e in done.values() if e.fits), default=math.inf)

    while True:
        cut.clear()
        for c in order:
            if c in done:
                continue
            if lb[c][1] > spec.usable_memory:
                cut[c] = Pruned(c[0], c[1], lb[c][0], lb[c][1], "memory")
            elif lb[c][0] * (1 + 1e-9) >= best_time():
                cut[c] = Pruned(c[0], c[1], lb[c][0], lb[c][1], "time")
            elif c in traced_bound and loses(c, 0.0):
                pass
            elif (e := run(c, False)) is not None:
                done[c] = e
        if not any(e.fits for e in done.values()) and any(p.by == "memory" for p in cut.values()):
            for c in order:  # nothing fits: rank everything by memory
                if c not in done and (e := run(c, False)) is not None:  # no best: never cut
                    done[c] = e
                    cut.pop(c, None)
        # the reported best are traced in full, not extrapolated (their memory may differ a little)
        ranked = sorted(done, key=lambda c: rank_key(done[c]))[:verify]
        todo = [c for c in ranked if c not in full]
        if not todo:
            break
        for c in todo:
            done[c] = run(c, True)
    results = list(done.values())
    cuts = list(cut.values())
    n_space = len(space)
    if pipelines:
        family = pipeline_layouts(n, dims, program.layers, names)
        n_space += len(family)
        traced, cut_pipes = _search_pipelines(program, family, spec, algorithm, best_time(),
                                              len(space) + len(family), max_candidates, staging)
        results += traced
        cuts += cut_pipes
    results.sort(key=rank_key)
    best = min((e.step_seconds for e in results if e.fits), default=math.inf)
    pruned = sorted((replace(p, best=best) for p in cuts), key=lambda p: (p.by == "memory", p.seconds))
    return SearchResult(results, spec.name, time.perf_counter() - t0, space=n_space,
                        pruned_candidates=pruned)


def _search_pipelines(program: Program, family: list[Candidate],
                      spec: DeviceSpec, algorithm: str, best: float, total: int, max_candidates: int,
                      staging: str = "none") -> tuple[list[Estimate], list[Pruned]]:
    """Branch and bound over the pipelined family, given the best step time found so far."""
    if total > max_candidates:
        raise PlanError(f"{total} candidates (with {len(family)} pipelined ones) exceed max_candidates="
                        f"{max_candidates}; pass pipeline=False (meshtorch plan --no-pipeline), fewer "
                        "processors, or raise max_candidates")

    def pipelined(microbatches: int) -> Program:
        piped = program.pipelined(microbatches)
        if piped is None or piped.pipeline is None:
            raise PlanError(f"the program pipelines for one micro-batch count but not for {microbatches}: "
                            "its pipelined(microbatches) must give a program with a pipeline for every count")
        return piped

    works = stage_bounds(pipelined, family, spec, program.dims)
    # how much of the stages before a stage its first action waits for: the schedule's
    info = program_pipeline(pipelined(family[0][2])) if family else None
    share = chain_share(info.schedule, info.virtual_stages) if info is not None else 1.0
    lb = {c: (step_time_bound(works[c][0], c[2], spread=works[c][2], share=share), works[c][1])
          for c in family}
    traced: list[Estimate] = []
    cut: list[Pruned] = []
    for c in sorted(family, key=lambda c: lb[c][0]):
        mesh, rules, mb = c
        step = pipelined(mb)
        label = f"{program_pipeline(step).schedule} x{mb}"
        if lb[c][1] > spec.usable_memory:
            cut.append(Pruned(mesh, rules, lb[c][0], lb[c][1], "memory", pipeline=label))
        elif lb[c][0] * (1 + 1e-9) >= best:
            cut.append(Pruned(mesh, rules, lb[c][0], lb[c][1], "time", pipeline=label))
        else:
            # stage by stage, the traced work replaces the stage's bound: stop once that loses
            work = list(works[c][0])

            lead = works[c][2]

            def give_up(stage: int, w: float, work: list[float] = work, mb: int = mb,
                        limit: float = best, lead: list[float] = lead) -> bool:
                work[stage] = max(work[stage], w)
                return step_time_bound(work, mb, spread=lead, share=share) >= limit * (1 + 1e-9)

            # first one micro-batch's forwards and backwards, a fraction of a stage trace: each
            # stage's work is at least microbatches times theirs (microbatch_work); with no best yet
            # to lose to, nothing would be pruned by it
            probe = step.one_microbatch() if best < math.inf else None
            bounds = (microbatch_work(probe, mb, mesh, rules, spec, algorithm, staging) if probe is not None
                      else ())
            if any(give_up(s, w) for s, w in enumerate(bounds)):
                e = None
            else:
                e = estimate_pipeline(step, mesh, rules, spec, algorithm, staging=staging, give_up=give_up)
            if e is None:
                cut.append(Pruned(mesh, rules, step_time_bound(work, mb, spread=lead, share=share), lb[c][1],
                                  "time", pipeline=label))
                continue
            traced.append(e)
            if e.fits:
                best = min(best, e.step_seconds)
    return traced, cut


__all__ = ["search"]
