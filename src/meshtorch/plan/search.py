"""``mt.plan.search``: the fastest mesh shape and layout rules that fit in memory.

The search is *exact over its space*: every candidate is traced on the meta
backend and costed (:mod:`meshtorch.plan.estimate`); nothing is guessed from a
surrogate. The space, pruned by divisibility:

- meshes: the given one, or for ``N`` processors ``b:N`` and every
  ``b:x,m:N/x`` (two axes: a data axis ``b`` and a model axis ``m``);
- rules: on two axes, ``batch`` on ``b`` (data parallelism) and, each on
  ``m`` or not at all, the model dims (``heads, d_ff, vocab, experts`` when the
  model has them), and ``d_model`` on ``b`` or not at all (ZeRO/FSDP-style
  sharding of the parameters along the data axis); on one axis, each of
  those dims on it or not.

That is at most a few hundred candidates, so no integer program is needed
(``scipy.optimize.milp`` would need a separable cost model, which the
collective costs are not: the bytes an all_reduce moves along ``b`` depend on
how ``m`` splits the same tensor). To keep each candidate cheap, a step
function that can be rebuilt with fewer layers (``training_step`` can) is
traced with 1 and 2 layers and extrapolated linearly, which is exact for
FLOPs and bytes because the blocks are identical; the best candidates are
then traced in full, so the numbers reported for them are not extrapolated.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.plan.step import training_step
    >>> from meshtorch.train import TrainConfig
    >>> cfg = TrainConfig(d_model=64, heads=4, d_kv=16, d_ff=256, layers=1, batch=32, length=32)
    >>> res = mt.plan.search(training_step(cfg, vocab=256), 2, device="a100", echo=False)
    >>> res.best.fits, res.best.step_seconds <= min(c.step_seconds for c in res.candidates)
    (True, True)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from meshtorch.errors import PlanError
from meshtorch.mesh import Mesh
from meshtorch.plan.devices import DeviceSpec
from meshtorch.plan.devices import device as get_device
from meshtorch.plan.estimate import Estimate, _fmt_bytes, from_trace
from meshtorch.plan.tracing import KINDS, Trace, trace

MODEL_DIMS = ("heads", "d_ff", "vocab", "experts")


def meshes_for(n: int) -> list[str]:
    """``b:n`` and every two-axis ``b:x,m:n/x``.

    Example:
        >>> from meshtorch.plan.search import meshes_for
        >>> meshes_for(8)
        ['b:8', 'b:2,m:4', 'b:4,m:2']
    """
    if n < 1:
        raise PlanError(f"num_processors must be >= 1, got {n}")
    return [f"b:{n}"] + [f"b:{x},m:{n // x}" for x in range(2, n) if n % x == 0]


def rules_for(mesh: str, dims: dict[str, int]) -> list[str]:
    """Every rule set of the search space for ``mesh`` whose splits divide their dims."""
    m = Mesh(mesh)
    axes = m.axis_names
    model = [d for d in MODEL_DIMS if d in dims]
    if len(axes) == 1:
        a = axes[0]
        options = [[None, a] for _ in ["batch", *model]]
        names = ["batch", *model]
    else:
        b, mm = axes[0], axes[-1]
        names = ["batch", *model, "d_model"]
        options = [[b]] + [[None, mm] for _ in model] + [[None, b]]
    out = []
    for choice in itertools.product(*options):
        rules = []
        for name, axis in zip(names, choice):
            if axis is None or name not in dims:
                continue
            if dims[name] % m.axis_size(axis):
                break
            rules.append(f"{name}:{axis}")
        else:
            out.append("; ".join(rules))
    return sorted(set(out), key=lambda r: (r.count(":"), r))


@dataclass
class SearchResult:
    """Candidates, best first (fitting ones by step time, then the others by memory)."""

    candidates: list[Estimate]
    device: str
    seconds: float

    @property
    def best(self) -> Estimate:
        return self.candidates[0]

    @property
    def mesh(self) -> str:
        return self.best.mesh

    @property
    def rules(self) -> str:
        """The best rules, ready to paste into ``mt.launch(..., rules=...)``."""
        return self.best.rules

    def table(self, top: int = 10) -> str:
        rows = [f"{'#':>3}  {'mesh':<14}{'rules':<48}{'step ms':>10}{'memory':>12}  fits  why"]
        for i, e in enumerate(self.candidates[:top], 1):
            rows.append(f"{i:>3}  {e.mesh:<14}{e.rules or '(replicated)':<48}{e.step_seconds * 1e3:>10.2f}"
                        f"{_fmt_bytes(e.memory_bytes['total']):>12}  {'yes' if e.fits else 'NO ':<4}  "
                        f"{e.reason()}")
        rows.append(f"{len(self.candidates)} candidates on {self.device} in {self.seconds:.1f} s; "
                    f"best: --mesh {self.mesh} --rules \"{self.rules}\"")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def _key(e: Estimate) -> tuple:
    return (not e.fits, e.step_seconds if e.fits else e.memory_bytes["total"])


def _extrapolate(t1: Trace, t2: Trace, layers: int) -> Trace:
    """A ``layers``-deep trace from 1- and 2-layer ones (every block costs the same)."""
    k = layers - 1

    def lin(a, b):
        return a + k * (b - a)

    comm = t1.comm.copy()
    for key in set(t1.comm._calls) | set(t2.comm._calls):
        comm._calls[key] = lin(t1.comm._calls.get(key, 0), t2.comm._calls.get(key, 0))
        comm._bytes[key] = lin(t1.comm._bytes.get(key, 0), t2.comm._bytes.get(key, 0))
    by_kind = {kd: lin(t1.peak_by_kind[kd], t2.peak_by_kind[kd]) for kd in KINDS}
    flops = {dt: lin(t1.flops_by_dtype.get(dt, 0), t2.flops_by_dtype.get(dt, 0))
             for dt in set(t1.flops_by_dtype) | set(t2.flops_by_dtype)}
    result = t2.result
    if isinstance(t1.result, dict) and "parameters" in t1.result:
        result = {"parameters": lin(t1.result["parameters"], t2.result["parameters"])}
    return replace(t2, comm=comm, peak_by_kind=by_kind, peak_bytes=sum(by_kind.values()),
                   flops_by_dtype=flops, flops=sum(flops.values()),
                   parameters=lin(t1.parameters, t2.parameters), result=result, ops=[])


def dims_of(step_fn: Callable[[], Any]) -> dict[str, int]:
    """Every dim name and size the step's MeshTensors use (from a one-processor meta trace)."""
    t = trace(step_fn, mesh="", rules="", backend="meta")
    dims: dict[str, int] = {}
    for op in t.ops:
        for part in op.shape.split(","):
            if ":" in part:
                name, size = part.split(":")
                dims.setdefault(name, int(size))
    return dims


def search(step_fn: Callable[[], Any], processors: int | str | Mesh, device: str | DeviceSpec = "tpu-v2",
           *, top: int = 10, verify: int = 3, meshes: Iterable[str] | None = None,
           algorithm: str = "ring", echo: bool = True, max_candidates: int = 2000) -> SearchResult:
    """Search mesh shapes and layout rules for the fastest step that fits ``device``'s memory.

    ``processors`` is a processor count (meshes are searched) or a mesh (only
    rules are). Prints the ``top`` candidates with the reason for each (which
    collectives dominate, what does not fit) unless ``echo=False``, and
    returns a :class:`SearchResult` whose ``rules`` and ``mesh`` can be pasted.
    """
    t0 = time.perf_counter()
    if isinstance(processors, int):
        mesh_list = list(meshes) if meshes is not None else meshes_for(processors)
    else:
        mesh_list = [str(Mesh(processors))]
    n = Mesh(mesh_list[0]).size
    spec = get_device(device, processors=n)
    dims = dims_of(step_fn)
    space = [(m, r) for m in mesh_list for r in rules_for(m, dims)]
    if not space:
        raise PlanError(f"no layout of the dims {dims} divides over the meshes {mesh_list}; "
                        "pick a processor count that divides the batch or the model dims")
    if len(space) > max_candidates:
        raise PlanError(f"{len(space)} candidates exceed max_candidates={max_candidates}; pass meshes=[...] "
                        "or a fixed mesh to narrow the search")
    rebuild = getattr(step_fn, "with_layers", None)
    layers = getattr(step_fn, "layers", 0)
    quick = rebuild is not None and layers > 2
    fns = (rebuild(1), rebuild(2)) if quick else None
    results: list[Estimate] = []
    for mesh, rules in space:
        if quick:
            t1, t2 = (trace(f, mesh=mesh, rules=rules, backend="meta") for f in fns)
            t = _extrapolate(t1, t2, layers)
        else:
            t = trace(step_fn, mesh=mesh, rules=rules, backend="meta")
        results.append(from_trace(t, mesh, spec, algorithm))
    results.sort(key=_key)
    if quick:  # the reported best are traced in full, not extrapolated
        full = [from_trace(trace(step_fn, mesh=e.mesh, rules=e.rules, backend="meta"), e.mesh, spec,
                           algorithm) for e in results[:verify]]
        results = sorted(full, key=_key) + results[verify:]
    res = SearchResult(results, spec.name, time.perf_counter() - t0)
    if echo:
        print(res.table(top))
    return res
