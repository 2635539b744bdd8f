"""One training program: the step the planner traces is the step ``meshtorch train`` runs.

The real side is the trainer's own strategy (``strategy_for``: ``PlainStep`` or
``PipelinedStep``) running ``run`` on the threads backend, recorded by an
independent dispatch-mode recorder; the planned side is the planner's meta
trace of the LM's :class:`TrainingProgram` (``Trace.aten_names``, ``Trace.comm``).
Both must execute the same aten ops in the same order and the same collectives
(calls and bytes per kind and axis). Two kinds of ops are set apart, on both sides:
each collective's own work is the backend's (the threads backend sums the
payloads, the meta backend makes an empty result), so it becomes one ``<kind>``
marker; and host reads of values (``aminmax`` + ``_local_scalar_dense``: the
embedding's id range check and the loss ``item()``), which meta tensors have no
values for, and the host's lifting of a Python number into a tensor (``lift_fresh``), which
a meta tensor's factory skips.

The meta backend models the torch backend's collectives, strides included (its
``all_gather`` returns a ``movedim`` view of the gathered buffer, where the threads
backend concatenates), and autograd picks its backward ops by the strides it
sees: where a layout all-gathers a weight (``d_model:b``, MoE's ``experts:b``), the real
side runs on the torch backend, whose ops the plan then matches one for one.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

import meshtorch as mt
from meshtorch.comm.meta import MetaCommunicator
from meshtorch.comm.threads import ThreadsCommunicator
from meshtorch.comm.torch import TorchCommunicator
from meshtorch.context import current, use_tracer
from meshtorch.plan import trace
from meshtorch.plan.pipeline import stage_traces
from meshtorch.plan.program import PROGRAM_MEMBERS, Program, SpaceDims, Step, program_of
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import pipelined_training_step, prepare, training_step
from meshtorch.recipes.lm.strategies import PipelinedStep, PlainStep

VOCAB = 16
TINY = TrainConfig.of(batch=4, length=8, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, encoder_layers=1,
                      experts=2, top_k=1, moe_every=1)
HOST_READS = {"aminmax", "_local_scalar_dense", "lift_fresh"}
BACKEND_METHODS = ("_all_reduce", "_all_gather", "_reduce_scatter", "_all_to_all", "_permute", "_broadcast",
                   "_send", "_recv", "_start_all_gather", "_start_reduce_scatter", "_start_all_reduce",
                   "_start_flat_all_reduce")


class Recorder(TorchDispatchMode):
    """The aten ops a processor runs, in order: a processor tracer of its own (so that the
    core's ``untraced`` blocks, a backend's staging copies, are hidden from it as from the
    planner's), independent of the planner's tracer."""

    counting = True

    def __init__(self) -> None:
        super().__init__()
        self.aten_names: list[str] = []
        self._off = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._off:
            self.aten_names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def observe(self, tensor) -> None:
        pass

    @contextlib.contextmanager
    def paused(self):
        self._off += 1
        try:
            yield
        finally:
            self._off -= 1

    def drawing(self):
        return contextlib.nullcontext(False)

    def phase(self, name: str):
        return contextlib.nullcontext()


@contextlib.contextmanager
def marking_collectives():
    """Each backend collective's own ops replaced by one ``<kind>`` marker in whichever tracer
    (the planner's or the :class:`Recorder`) this processor has, while it counts."""

    def marked(method, kind):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            tr = current().tracer
            names = tr.aten_names if tr is not None and tr.counting else None
            n = len(names) if names is not None else 0
            out = method(self, *args, **kwargs)
            if names is not None:
                del names[n:]
                names.append(f"<{kind}>")
            return out

        return call

    backends = (ThreadsCommunicator, MetaCommunicator, TorchCommunicator)
    # (a grouped collective's start may be the base class's, which runs the backend's collective)
    saved = [(cls, name, cls.__dict__.get(name)) for cls in backends for name in BACKEND_METHODS]
    for cls, name, _ in saved:
        setattr(cls, name, marked(getattr(cls, name), name[1:]))
    try:
        yield
    finally:
        for cls, name, method in saved:
            if method is None:
                delattr(cls, name)
            else:
                setattr(cls, name, method)


@pytest.fixture
def collectives_as_markers():
    with marking_collectives():
        yield


def _program_ops(names: list[str]) -> list[str]:
    return [n for n in names if n not in HOST_READS]


def run_step(cfg: TrainConfig, pipelined: bool, mark: bool = False) -> tuple[list[str], dict, str]:
    """One processor's ``run`` of the trainer's strategy after the warm-up, recorded (``mark``:
    collectives marked here, in a process of the torch backend)."""
    step, batch = prepare(cfg, VOCAB, pipelined=pipelined)
    rec = Recorder()
    with marking_collectives() if mark else contextlib.nullcontext(), use_tracer(rec), rec:
        before = mt.comm_stats().copy()
        step.run([batch], 1)
        counted = (mt.comm_stats() - before).as_dict()
    return rec.aten_names, counted, type(step).__name__


@pytest.mark.parametrize("model, optimizer, mesh, rules, backend, overlap", [
    ("lm", "adamw", "b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m", "threads", False),
    ("seq2seq", "adamw", "b:2,m:2", "batch:b; heads:m; d_ff:m", "threads", True),
    ("moe", "adafactor", "b:2", "batch:b; experts:b; d_model:b", "torch", True),
])
def test_the_planned_step_runs_the_ops_and_collectives_of_the_trainers_step(
        collectives_as_markers, model, optimizer, mesh, rules, backend, overlap):
    cfg = TINY.replace(model=model, optimizer=optimizer, clip=1.0, overlap=overlap)
    names, comm, kind = mt.launch(run_step, cfg, False, backend == "torch", mesh=mesh, rules=rules,
                                  backend=backend, timeout=120)[0]
    planned = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules)
    assert kind == "PlainStep"
    assert planned.comm.as_dict() == comm
    assert any(n.startswith("<all_reduce") for n in names)  # the markers are there: a real comparison
    assert _program_ops(planned.aten_names) == _program_ops(names)


def test_the_planned_pipeline_runs_the_ops_and_collectives_of_the_trainers_pipelined_step(
        collectives_as_markers):
    cfg = TINY.replace(layers=2, microbatches=2, schedule="1f1b", clip=1.0)
    mesh = "stage:2,b:2"
    real = mt.launch(run_step, cfg, True, mesh=mesh, rules="batch:b", backend="threads")
    stages = stage_traces(pipelined_training_step(cfg, VOCAB), mesh, "batch:b")
    for s, planned in enumerate(stages):
        names, comm, kind = real[mt.Mesh(mesh).rank({"stage": s, "b": 0})]
        assert kind == "PipelinedStep"
        assert planned.comm.as_dict() == comm, s
        assert _program_ops(planned.aten_names) == _program_ops(names), s


def test_the_strategies_and_the_lm_program_implement_the_planners_protocols():
    program = training_step(TINY, VOCAB)
    assert isinstance(program, Program) and program.pipeline is None
    piped = program.pipelined(4)
    assert isinstance(piped, Program) and (piped.pipeline.microbatches, piped.pipeline.axis) == (4, "stage")
    assert training_step(TINY.replace(model="moe"), VOCAB).pipelined(2) is None  # train pipelines the LM only
    per_use = training_step(TINY.replace(overlap=False), VOCAB)
    assert program.with_layers(3).layers == 3 and per_use.without_update().pipeline is None
    # a step that overlaps (the default) has no cheaper part (its gathers are grouped by the step before)
    assert program.without_update() is None
    t = trace(program, mesh="b:2", rules="batch:b")
    assert t.aten_ops == len(t.aten_names) > 100 and "mm" in t.aten_names

    def strategies():
        plain, _ = prepare(TINY, VOCAB)
        pipe, _ = prepare(TINY.replace(layers=2, microbatches=2), VOCAB, pipelined=True)
        return plain, pipe

    plain, pipe = mt.launch(strategies, mesh="stage:2")[0]
    assert isinstance(plain, PlainStep) and isinstance(plain, Step) and plain.pipeline is None
    assert isinstance(pipe, PipelinedStep) and isinstance(pipe, Step)
    assert pipe.pipeline == piped.pipelined(2).pipeline


def _mlp(batch: str, hidden: str, units: str):
    def step():
        ff = mt.nn.Dense(mt.Dim(hidden, 64), mt.Dim(units, 256), bias=False)
        with mt.plan.measure():
            mt.reduce_sum(ff(mt.random.normal(f"{batch}:32,{hidden}:64", seed=1))).backward()

    return step


def test_the_search_takes_the_models_dim_names_from_the_program():
    ours = mt.plan.search(_mlp("batch", "d_model", "d_ff"), 4, device="a100")
    roles = SpaceDims(batch="rows", model=("units",), hidden="width")
    named = program_of(_mlp("rows", "width", "units"), roles)
    theirs = mt.plan.search(named, 4, device="a100")
    rename = {"rows": "batch", "width": "d_model", "units": "d_ff"}
    renamed = [(c.mesh, " ".join(rename.get(w, w) for w in c.rules.replace(":", " : ").split()))
               for c in theirs.ranking()]
    assert theirs.space == ours.space > 10
    assert renamed == [(c.mesh, " ".join(c.rules.replace(":", " : ").split())) for c in ours.ranking()]
    assert theirs.best.step_seconds == ours.best.step_seconds
    # told nothing, the search knows no dim of this model to split: each mesh keeps it replicated
    blind = mt.plan.search(_mlp("rows", "width", "units"), 4, device="a100")
    assert sorted((c.mesh, c.rules) for c in blind.ranking()) == [("b:2,m:2", ""), ("b:4", "")]


@pytest.mark.parametrize("missing", PROGRAM_MEMBERS)
def test_a_program_declaring_part_of_the_protocol_is_refused_naming_what_it_lacks(missing):
    """The planner reads a program only through :class:`Program` (no ``getattr`` with a default): an
    object that declares all of it but one member would be wrapped as a plain callable and its
    declarations silently unused, so it is refused, naming the member."""
    from meshtorch.errors import PlanError

    declared = {"layers": 0, "period": 1, "pipeline": None, "dims": SpaceDims(),
                **{m: lambda self, *a: None for m in PROGRAM_MEMBERS[4:]}, "__call__": lambda self: None}
    assert set(declared) == {*PROGRAM_MEMBERS, "__call__"}
    whole = type("Whole", (), declared)()
    assert program_of(whole) is whole  # all declared: a Program as it is
    partial = type("Partial", (), {k: v for k, v in declared.items() if k != missing})()
    with pytest.raises(PlanError, match=rf"declares .* but not {missing}: a meshtorch.plan.program.Program"):
        program_of(partial)
