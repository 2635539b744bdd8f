"""The search's answer: its candidates ranked, with the reason for each.

:class:`SearchResult` holds the traced candidates (:class:`~meshtorch.plan.estimate.Estimate`,
:class:`~meshtorch.plan.pipeline.PipelineEstimate`) and those a lower bound ruled out
(:class:`Pruned`), ranks both and says why each ranks where it does.

Example:
    >>> from meshtorch.plan.ranking import Pruned
    >>> Pruned("b:2", "batch:b", 2e-3, 1e6, "time", best=1e-3).reason()
    'pruned: step time >= 2.00 ms (lower bound) >= best 1.00 ms'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from meshtorch.plan.estimate import Estimate, _fmt_bytes
from meshtorch.plan.pipeline import PipelineEstimate


@dataclass(frozen=True)
class Pruned:
    """A candidate the search ruled out without tracing it in full, and why.

    ``seconds`` and ``memory_bytes`` are lower bounds on its step time and peak
    memory; ``by`` is ``"time"`` (its time bound is no better than the best
    step time, ``best``) or ``"memory"`` (its parameters alone overflow the device).
    """

    mesh: str
    rules: str
    seconds: float
    memory_bytes: float
    by: str
    best: float = math.inf
    pipeline: str = ""  # a pipelined candidate's schedule and micro-batches, e.g. "1f1b x4"

    def reason(self) -> str:
        if self.by == "memory":
            return f"pruned: parameter bytes alone >= {_fmt_bytes(self.memory_bytes)} do not fit"
        return (f"pruned: step time >= {_fmt_ms(self.seconds)} ms (lower bound) >= best "
                f"{_fmt_ms(self.best)} ms")

    def to_json(self) -> dict[str, Any]:
        return {"mesh": self.mesh, "rules": self.rules, "pipeline": self.pipeline, "pruned": self.by,
                "step_seconds_lower_bound": self.seconds, "memory_bytes_lower_bound": self.memory_bytes,
                "reason": self.reason()}


@dataclass
class SearchResult:
    """Candidates, best first (fitting ones by step time, then the others by memory).

    ``candidates`` holds the traced candidates only; ``space`` counts every
    candidate; ``pruned_candidates`` those a lower bound ruled out without a
    full trace (:class:`Pruned`, with the bound), and ``pruned`` counts them by
    reason (``{"time": n, "memory": n}``). Every candidate of the space is in
    exactly one of the two lists, and :meth:`table` ranks both.
    """

    candidates: list[Estimate]
    device: str
    seconds: float
    space: int = 0
    pruned_candidates: list[Pruned] = field(default_factory=list)

    @property
    def pruned(self) -> dict[str, int]:
        return {by: sum(p.by == by for p in self.pruned_candidates) for by in ("time", "memory")}

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

    def ranking(self) -> list[Estimate | Pruned]:
        """Traced and pruned candidates in one ranking: fitting ones by step time (a pruned
        one by its bound), then those traced that do not fit by memory, then those whose
        parameters alone do not fit by that bound (a bound below a traced candidate's memory
        does not make them smaller: ranked among them, one came before the best of a search where
        nothing fits)."""

        def key(c: Estimate | Pruned) -> tuple:
            if isinstance(c, Pruned):
                return (2, c.memory_bytes, 1) if c.by == "memory" else (0, c.seconds, 1)
            return (int(not c.fits), rank_key(c)[1], 0)

        return sorted([*self.candidates, *self.pruned_candidates], key=key)

    def why(self, c: Estimate | Pruned | None = None) -> str:
        """Why ``c`` ranks where it does, against the best: the best "fits memory (…); fastest,
        dominated by …"; another "12% slower: more all_reduce@m (+1.20 ms); less memory (…)";
        one that does not fit, by how much; a pruned one, its bound. Without ``c``: why the
        best won against the best of the other family (layouts with or without pipeline
        stages)."""
        if c is None:
            return self._why_chosen()
        if isinstance(c, Pruned):
            return c.reason()
        if not c.fits:
            return c.reason()
        best = self.best
        if c is best:
            return (f"fits memory ({_fmt_bytes(c.memory_bytes['total'])} of "
                    f"{_fmt_bytes(c.memory_capacity)}); fastest, {c.reason()}")
        slower = (c.step_seconds / best.step_seconds - 1) * 100 if best.step_seconds else 0.0
        if c.step_seconds <= best.step_seconds * (1 + 1e-9):
            # (the same costs under other names, e.g. all_reduce@b on b:8 and all_reduce@b,m on
            # b:2,m:4: "0% slower than #1: more all_reduce@b,m (+0.53 ms)" said otherwise)
            out = "as fast as #1 (a tie; ranked after it)"
        else:
            mine = {"compute": c.compute_seconds, **c.comm_seconds}
            theirs = {"compute": best.compute_seconds, **best.comm_seconds}
            part, extra = max(((k, mine.get(k, 0.0) - theirs.get(k, 0.0)) for k in {*mine, *theirs}),
                              key=lambda kv: (kv[1], kv[0]))
            out = f"{slower:.1f}% slower than #1" if slower < 1 else f"{slower:.0f}% slower than #1"
            if extra > 0:
                out += f": more {part} (+{_fmt_ms(extra)} ms)"
        less = best.memory_bytes["total"] - c.memory_bytes["total"]
        if less > 0:
            out += f"; {_fmt_bytes(less)} less memory"
        return out

    def reasons(self, top: int = 3) -> list[str]:
        """``"1st: …"``, ``"2nd: …"``: :meth:`why` for each of the ``top`` ranked candidates."""
        ordinal = {1: "1st", 2: "2nd", 3: "3rd"}
        return [f"{ordinal.get(i, f'{i}th')} {c.mesh} \"{c.rules}\": {self.why(c)}"
                for i, c in enumerate(self.ranking()[:top], 1)]

    def table(self, top: int = 10) -> str:
        """The ``top`` candidates of :meth:`ranking` with the reason for each (:meth:`why`);
        pruned ones show their lower bounds (``>=``)."""
        # each column after a space: a value wider than its column (long rules, a bound's ">=")
        # pushes the rest right instead of running into its neighbour
        rows = [f"{'#':>3}  {'mesh':<13} {'rules':<47} {'step ms':>9} {'memory':>12}  fits  why"]
        for i, c in enumerate(self.ranking()[:top], 1):
            if isinstance(c, Pruned):
                rows.append(f"{i:>3}  {c.mesh:<13} {_what(c):<47} {'>=' + _fmt_ms(c.seconds):>9} "
                            f"{'>=' + _fmt_bytes(c.memory_bytes):>12}  "
                            f"{'NO ' if c.by == 'memory' else '?':<4}  {c.reason()}")
                continue
            rows.append(f"{i:>3}  {c.mesh:<13} {_what(c):<47} {_fmt_ms(c.step_seconds):>9} "
                        f"{_fmt_bytes(c.memory_bytes['total']):>12}  {'yes' if c.fits else 'NO ':<4}  "
                        f"{self.why(c)}")
        n = self.pruned
        pruned = "" if not self.pruned_candidates else (
            f" ({n['time']} pruned: time bound >= the best step time; "
            f"{n['memory']} pruned: parameter bytes alone do not fit)")
        space = self.space or len(self.candidates)
        best = self.best
        flags = (f" --pipeline-stages {best.stages} --schedule {best.schedule} --microbatches "
                 f"{best.microbatches}" if isinstance(best, PipelineEstimate) else "")
        rows.append(f"{space} candidates, {len(self.candidates)} traced{pruned}, "
                    f"on {self.device} in {self.seconds:.1f} s; "
                    f"best: --mesh {self.mesh} --rules \"{self.rules}\"{flags}")
        rows.append(f"why: {self.why()}")
        return "\n".join(rows)

    def _why_chosen(self) -> str:
        best = self.best
        piped = isinstance(best, PipelineEstimate)
        rival = next((c for c in self.candidates if isinstance(c, PipelineEstimate) != piped), None)
        if not best.fits:
            return f"nothing fits; the smallest: {best.reason()}"
        what = (f"{best.label}: bubble {best.bubble:.0%}" if piped
                else f"no pipeline stages: {best.reason()}")
        if rival is None:
            return what + ("" if piped else " (no pipelined layout was searched or traced)")
        other = "the best layout without stages" if piped else f"the best pipelined layout ({rival.label})"
        if not rival.fits:
            return (f"{what}; fits memory where {other} does not ({_fmt_bytes(rival.memory_bytes['total'])} "
                    f"> {_fmt_bytes(rival.memory_capacity)})")
        return (f"{what}; {rival.step_seconds / best.step_seconds:.2f}x faster than {other} "
                f"(--mesh {rival.mesh} --rules \"{rival.rules}\": {_fmt_ms(rival.step_seconds)} ms)")

    def __str__(self) -> str:
        return self.table()


def _fmt_ms(seconds: float) -> str:
    """Milliseconds to two decimals, or to three significant digits below 0.1 ms (a small model's
    steps, which two decimals would all show as 0.01).

    Example:
        >>> _fmt_ms(1.5e-3), _fmt_ms(1.234e-5), _fmt_ms(0.0)
        ('1.50', '0.0123', '0.00')
    """
    ms = seconds * 1e3
    return f"{ms:.3g}" if 0 < abs(ms) < 0.1 else f"{ms:.2f}"


def _what(c: Estimate | Pruned) -> str:
    """A candidate's rules, and for a pipelined one its schedule and micro-batches."""
    rules = c.rules or "(replicated)"
    if isinstance(c, PipelineEstimate):
        return f"{rules} [{c.schedule} x{c.microbatches}]"
    if isinstance(c, Estimate) and c.reshard_after_forward:
        return f"{rules} [reshard after forward]"
    return f"{rules} [{c.pipeline}]" if isinstance(c, Pruned) and c.pipeline else rules


def rank_key(e: Estimate) -> tuple:
    return (not e.fits, e.step_seconds if e.fits else e.memory_bytes["total"])


__all__ = ["Pruned", "SearchResult", "rank_key"]
