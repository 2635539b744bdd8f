"""The search's space: candidate meshes, layout rules and pipelined layouts for a model's dims.

Meshes for ``N`` processors are ``b:N`` and every ``b:x,m:N/x`` (a data axis
``b`` and a model axis ``m``; :func:`meshes_for`), with ``axes=3`` also every
``b:x,m:y,x:z``. Rule sets come from a few *families* (:data:`FAMILIES`, one
generator each), which name dims by their role in the model
(:class:`meshtorch.plan.program.SpaceDims`: the data dim, the model dims, the
experts, the residual stream's dim, the sequence), so that any model's names
can be searched; :func:`rules_for` keeps the rule sets whose splits divide
their dims. :func:`pipeline_layouts` adds the pipelined family: a ``stage``
axis in front of each smaller SPMD layout, with its micro-batch counts.

Example:
    >>> from meshtorch.plan.program import SpaceDims
    >>> from meshtorch.plan.space import rules_for
    >>> rules_for("b:2", {"batch": 4, "d_ff": 8})
    ['', 'batch:b', 'd_ff:b', 'batch:b; d_ff:b']
    >>> rules_for("p:2", {"rows": 4, "units": 8}, SpaceDims(batch="rows", model=("units",)))
    ['', 'rows:p', 'units:p', 'rows:p; units:p']
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

from meshtorch.errors import PlanError
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh
from meshtorch.plan.program import TRANSFORMER_DIMS, SpaceDims

PIPELINE_AXIS = "stage"

Choice = list[tuple[str, Any]]  # (dim name, the axes it goes on: a name, a tuple of names, or None)
Family = Callable[[tuple[str, ...], dict[str, int], SpaceDims], Iterable[Choice]]


def meshes_for(n: int, axes: int = 2) -> list[str]:
    """``b:n`` and every two-axis ``b:x,m:n/x``; with ``axes=3`` also every three-axis
    ``b:x,m:y,x:z`` (each axis of at least 2 processors).

    Example:
        >>> from meshtorch.plan.space import meshes_for
        >>> meshes_for(8)
        ['b:8', 'b:2,m:4', 'b:4,m:2']
        >>> meshes_for(8, axes=3)[3:]
        ['b:2,m:2,x:2']
    """
    if n < 1:
        raise PlanError(f"num_processors must be >= 1, got {n}")
    if axes not in (1, 2, 3):
        raise PlanError(f"the search's meshes have 1, 2 or 3 axes, got axes={axes}")
    out = [f"b:{n}"]
    if axes >= 2:
        out += [f"b:{x},m:{n // x}" for x in range(2, n) if n % x == 0]
    if axes == 3:
        out += [f"b:{x},m:{y},x:{n // (x * y)}" for x in range(2, n) if n % x == 0
                for y in range(2, n // x) if (n // x) % y == 0 and n // (x * y) >= 2]
    return out


def _choices(names: list[str], options: list[list]) -> Iterable[Choice]:
    for choice in itertools.product(*options):
        yield list(zip(names, choice))


def _model(dims: dict[str, int], names: SpaceDims, experts: bool = True) -> list[str]:
    """The model dims the model has (and its experts, with ``experts``), in the order of ``names``."""
    return [d for d in (*names.model, *((names.experts,) if experts else ())) if d in dims]


def one_axis_family(axes: tuple[str, ...], dims: dict[str, int], names: SpaceDims) -> Iterable[Choice]:
    """One axis: the batch and each model dim (experts included) on it or not."""
    if len(axes) != 1:
        return
    split = [names.batch, *_model(dims, names)]
    yield from _choices(split, [[None, axes[0]]] * len(split))


def data_model_family(axes: tuple[str, ...], dims: dict[str, int], names: SpaceDims) -> Iterable[Choice]:
    """Two axes: the batch on the data axis, each model dim on the model axis or not, and the
    residual stream's dim (``hidden``) on the data axis or not (ZeRO/FSDP-style sharding of
    the parameters)."""
    if len(axes) != 2:
        return
    b, m = axes
    model = _model(dims, names)
    yield from _choices([names.batch, *model, names.hidden], [[b]] + [[None, m]] * len(model) + [[None, b]])


def whole_mesh_data_family(axes: tuple[str, ...], dims: dict[str, int], names: SpaceDims) -> Iterable[Choice]:
    """Two axes: data parallelism over the whole mesh, the parameters whole or sharded over
    every processor (ZeRO-3)."""
    if len(axes) != 2:
        return
    yield [(names.batch, axes)]
    yield [(names.batch, axes), (names.hidden, axes)]


def activation_model_family(axes: tuple[str, ...], dims: dict[str, int], names: SpaceDims
                            ) -> Iterable[Choice]:
    """Two axes: the batch on the data axis and the residual stream's dim or the sequence on
    the model axis (with the sequence, causal attention runs as ring attention), with each
    model dim but the experts on the model axis or not (an earlier dim of a tensor on the
    model axis wins)."""
    if len(axes) != 2:
        return
    b, m = axes
    model = _model(dims, names, experts=False)
    for act in (names.hidden, names.sequence):
        if act in dims:
            yield from _choices([names.batch, act, *model], [[b], [m]] + [[None, m]] * len(model))


def experts_on_data_family(axes: tuple[str, ...], dims: dict[str, int], names: SpaceDims
                           ) -> Iterable[Choice]:
    """Two axes, a mixture of experts: the experts on the data axis with the batch (Mesh-TF's
    MoE layout: the tokens of a group go to the processors holding their experts by
    all_to_all), each other model dim on the model axis or not."""
    if len(axes) != 2 or names.experts not in dims:
        return
    b, m = axes
    model = _model(dims, names, experts=False)
    yield from _choices([names.batch, names.experts, *model], [[b], [b]] + [[None, m]] * len(model))


def three_axis_family(axes: tuple[str, ...], dims: dict[str, int], names: SpaceDims) -> Iterable[Choice]:
    """Three axes ``b, m, x``: the batch over ``(b, x)``, each model dim on ``m`` or not, and the
    residual stream's dim over ``(b, x)`` or not. Priced like its two-axis collapse unless the
    device gives the axes different links (``spec.with_links``)."""
    if len(axes) != 3:
        return
    b, m, x = axes
    model = _model(dims, names)
    options = [[(b, x)]] + [[None, m]] * len(model) + [[None, (b, x)]]
    yield from _choices([names.batch, *model, names.hidden], options)


# each family proposes rule sets for the meshes it knows; rules_for keeps those that divide
FAMILIES: tuple[Family, ...] = (
    one_axis_family, data_model_family, whole_mesh_data_family, activation_model_family,
    experts_on_data_family, three_axis_family)


def rules_for(mesh: str, dims: dict[str, int], names: SpaceDims = TRANSFORMER_DIMS) -> list[str]:
    """Every rule set of the search space for ``mesh`` whose splits divide their dims: the
    union of what the :data:`FAMILIES` propose for a model with ``dims`` (name: size) whose
    roles ``names`` gives.

    Example:
        >>> from meshtorch.plan.space import rules_for
        >>> rules_for("b:2,m:2", {"batch": 8, "d_ff": 32, "d_model": 16, "length": 8})[5:7]
        ['batch:b; d_model:m', 'batch:b; length:m']
    """
    m = Mesh(mesh)
    axes = tuple(m.axis_names)
    out = set()
    for family in FAMILIES:
        for choice in family(axes, dims, names):
            rules = _divisible(m, dims, choice)
            if rules is not None:
                out.add(rules)
    return sorted(out, key=lambda r: (r.count(":"), r))


def _divisible(m: Mesh, dims: dict[str, int], choice: Choice) -> str | None:
    """The rules of ``choice`` (dim name, axes) for the dims the model has, or ``None`` if one
    does not divide."""
    rules = []
    for name, axes in choice:
        if axes is None or name not in dims:
            continue
        r = LayoutRules({name: axes})
        if dims[name] % r.pieces(name, m):
            return None
        rules.append(str(r))
    return "; ".join(rules)


def stage_counts(n: int, layers: int) -> list[int]:
    """Pipeline depths the search tries on ``n`` processors: 2, 4, 8, ... dividing ``n``, at most
    ``layers`` (a stage holds at least one block).

    Example:
        >>> from meshtorch.plan.space import stage_counts
        >>> stage_counts(8, 6), stage_counts(6, 2), stage_counts(1, 4)
        ([2, 4], [2], [])
    """
    out, s = [], 2
    while s <= min(n, layers):
        if n % s == 0:
            out.append(s)
        s *= 2
    return out


def microbatch_counts(stages: int, batch: int) -> list[int]:
    """Micro-batch counts the search tries for ``stages`` stages: ``stages``, ``2·stages`` and
    ``4·stages`` (bubbles of about 1/2, 1/3 and 1/5 of a flushed schedule) that divide ``batch``
    (the batch each data-parallel slice of a stage cuts up).

    Example:
        >>> from meshtorch.plan.space import microbatch_counts
        >>> microbatch_counts(2, 8), microbatch_counts(4, 8), microbatch_counts(2, 6)
        ([2, 4, 8], [4, 8], [2])
    """
    return [m for m in (stages, 2 * stages, 4 * stages) if m <= batch and batch % m == 0]


def pipeline_layouts(n: int, dims: dict[str, int], layers: int, names: SpaceDims = TRANSFORMER_DIMS
                     ) -> list[tuple[str, str, int]]:
    """The pipelined family: ``(mesh, rules, microbatches)`` for every stage count of
    :func:`stage_counts`, every SPMD layout of the search on the ``n / stages`` processors left
    (:func:`meshes_for`, :func:`rules_for` with each micro-batch's batch), the ``stage`` axis in
    front, and every micro-batch count of :func:`microbatch_counts`.

    Example:
        >>> from meshtorch.plan.space import pipeline_layouts
        >>> pipeline_layouts(2, {"batch": 8, "d_ff": 16}, layers=2)
        [('stage:2', '', 2), ('stage:2', '', 4), ('stage:2', '', 8)]
    """
    batch = names.batch
    out = []
    for s in stage_counts(n, layers):
        rest = n // s
        for mesh in meshes_for(rest) if rest > 1 else [""]:
            for mb in microbatch_counts(s, dims.get(batch, 1)):
                micro = {**dims, batch: dims.get(batch, 1) // mb} if batch in dims else dims
                full = f"{PIPELINE_AXIS}:{s}" + (f",{mesh}" if mesh else "")
                for rules in rules_for(mesh, micro, names) if mesh else [""]:
                    out.append((full, rules, mb))
    return out


__all__ = ["FAMILIES", "PIPELINE_AXIS", "activation_model_family", "data_model_family",
           "experts_on_data_family", "meshes_for", "microbatch_counts", "one_axis_family",
           "pipeline_layouts", "rules_for", "stage_counts", "three_axis_family", "whole_mesh_data_family"]
