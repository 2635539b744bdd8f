"""The pipeline and the placer used as docs/pipeline.md and docs/placement.md tell a user to:
frozen parameters, dropout, uneven chunks, odd micro-batch counts, a step inside torch.no_grad()
and evaluation with every synchronous schedule; weights tied across stages (the documented
``after_backward`` recipe); gradient accumulation; a checkpoint written and resumed per stage; a
plain module cut by a placement on thread-processors; and the errors for what cannot work. Each
against the unsplit model trained by plain torch in this process."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import meshtorch as mt
from meshtorch.cli import main
from meshtorch.errors import ProcessorError
from meshtorch.pipeline import Pipeline

pytestmark = pytest.mark.timeout(120)

F = torch.nn.functional


def _linear(i: int, o: int, g: torch.Generator) -> torch.nn.Linear:
    lin = torch.nn.Linear(i, o).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(o, i, generator=g, dtype=torch.float64) * 0.5)
        lin.bias.copy_(torch.randn(o, generator=g, dtype=torch.float64) * 0.1)
    return lin


def user_chunks() -> list[torch.nn.Module]:
    """Four model chunks of different widths: chunk 0's weight and chunk 3's bias frozen, dropout in
    chunk 2 (the only one drawing random numbers, so the threads share torch's generator safely)."""
    g = torch.Generator().manual_seed(0)
    c0 = torch.nn.Sequential(_linear(4, 7, g), torch.nn.Tanh())
    c1 = torch.nn.Sequential(_linear(7, 5, g), torch.nn.Tanh())
    c2 = torch.nn.Sequential(_linear(5, 6, g), torch.nn.Dropout(0.3), torch.nn.Tanh())
    c3 = _linear(6, 2, g)
    c0[0].weight.requires_grad_(False)
    c3.bias.requires_grad_(False)
    return [c0, c1, c2, c3]


def user_data(steps: int = 2, n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g,
                                                                              dtype=torch.float64))
            for _ in range(steps)]


def dense_microbatched(chunks, data, m, lr=0.05):
    """The unsplit model, Adam on each whole batch, its gradient summed over the m micro-batches in
    order (dropout draws one mask per micro-batch, as each stage does): losses, then state."""
    model = torch.nn.Sequential(*copy.deepcopy(chunks))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, y in data:
        opt.zero_grad()
        total = 0.0
        for xi, yi in zip(x.chunk(m), y.chunk(m)):
            loss = F.mse_loss(model(xi), yi) / m
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    model.eval()
    evaluated = F.mse_loss(model(data[0][0]), data[0][1]).item()
    return losses, evaluated, model.state_dict()


def _synchronous(chunks, data, schedule, v, m, recompute, seed=None):
    if seed is not None:  # a process of its own: its own generator
        torch.manual_seed(seed)
    built = chunks if v == 2 else [torch.nn.Sequential(*chunks[:2]), torch.nn.Sequential(*chunks[2:])]
    pipe = Pipeline(lambda i: copy.deepcopy(built[i]), microbatches=m, schedule=schedule, virtual_stages=v,
                    recompute=recompute, loss_fn=F.mse_loss,
                    optimizer=lambda ps: torch.optim.Adam(ps, lr=0.05))
    losses = [pipe.step(*data[0])]
    with torch.no_grad():  # a step trains inside the caller's no_grad too
        losses.append(pipe.step(*data[1]))
    pipe.module.eval()
    evaluated = pipe.loss(*data[0])
    chunk_states = [c.state_dict() for c in (pipe.module if v == 2 else [pipe.module])]
    return pipe.stage, losses, evaluated, chunk_states


def _recomputed(chunks, data):
    # one spawn for the three: process start-up dominates
    return [_synchronous(chunks, data, schedule, v, m, True, seed=7)
            for schedule, v, m in (("1f1b", 1, 6), ("zb", 1, 2), ("zbv", 2, 3))]


@pytest.mark.parametrize("schedule,v,m,recompute", [
    ("gpipe", 1, 3, False), ("1f1b", 1, 4, False), ("zb", 1, 3, False), ("interleaved", 2, 2, False),
    ("zbv", 2, 6, False), ("1f1b", 1, 6, True), ("zb", 1, 2, True), ("zbv", 2, 3, True)])
def test_user_models_train_like_the_unsplit_model(schedule, v, m, recompute):
    """With recompute, a stage restores torch's generator to re-draw its dropout masks: thread-processors
    share that generator (docs/pipeline.md), so those cases run on 2 gloo processes (one spawn)."""
    chunks, data = user_chunks(), user_data()
    torch.manual_seed(7)
    want_losses, want_eval, want = dense_microbatched(chunks, data, m)
    if recompute:
        if not torch.distributed.is_available():
            pytest.skip("torch.distributed is not available")
        out = _gloo_recomputed(chunks, data)[(schedule, v, m)]
    else:
        torch.manual_seed(7)  # the dropout chunk's stage draws the same masks from torch's generator
        out = mt.launch(_synchronous, chunks, data, schedule, v, m, recompute, mesh="stage:2")
    got = {}
    for stage, losses, evaluated, states in out:
        assert losses == pytest.approx(want_losses, rel=1e-12)
        assert evaluated == pytest.approx(want_eval, rel=1e-12)
        for k, state in enumerate(states):
            c = (stage if k == 0 else 3 - stage) if schedule == "zbv" else k * 2 + stage
            for name, t in state.items():
                # unsplit names: "2.0.weight"; with one chunk per stage, "0.0.weight" is model chunk 2s
                key = f"{c}.{name}" if v == 2 else f"{2 * stage + int(name[0])}{name[1:]}"
                got[key] = t
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-10, atol=1e-12, msg=name)
    assert torch.equal(want["0.0.weight"], chunks[0][0].weight)  # frozen
    assert torch.equal(want["3.bias"], chunks[3].bias)
    assert not torch.equal(want["1.0.weight"], chunks[1][0].weight)


_GLOO: dict = {}


def _gloo_recomputed(chunks, data) -> dict:
    if not _GLOO:
        out = mt.launch(_recomputed, chunks, data, mesh="stage:2", backend="torch", timeout=120)
        for k, key in enumerate((("1f1b", 1, 6), ("zb", 1, 2), ("zbv", 2, 3))):
            _GLOO[key] = [stage_out[k] for stage_out in out]
    return _GLOO


# ------------------------------------------------------------------ weights tied across stages
class Head(torch.nn.Module):
    """The output projection, reading the embedding's table."""

    def __init__(self, emb: torch.nn.Embedding):
        super().__init__()
        self.emb = emb

    def forward(self, h):
        return h @ self.emb.weight.t()


def tied_stages() -> list[torch.nn.Module]:
    g = torch.Generator().manual_seed(2)
    emb = torch.nn.Embedding(10, 6).double()
    with torch.no_grad():
        emb.weight.copy_(torch.randn(10, 6, generator=g, dtype=torch.float64))
    return [torch.nn.Sequential(emb, _linear(6, 6, g), torch.nn.Tanh()),
            torch.nn.Sequential(_linear(6, 6, g), Head(emb))]


def _tied(stages, ids, targets, schedule, given="factory"):
    built = stages if given == "list" else lambda i: copy.deepcopy(stages[i])
    pipe = Pipeline(built, microbatches=2, schedule=schedule,
                    loss_fn=F.cross_entropy, optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1))
    table = pipe.module[0].weight if pipe.stage == 0 else pipe.module[1].emb.weight

    def sum_tied_grad():  # docs/pipeline.md, "Weights shared by stages"
        g = table.grad if table.grad is not None else torch.zeros_like(table)
        table.grad = mt.current().comm.all_reduce(g, "stage")

    pipe.after_backward = sum_tied_grad
    return [pipe.step(ids, targets) for _ in range(3)], table.detach().clone()


def _tied_case():
    """The tied stages, their data, and the unsplit model's losses and trained table."""
    stages = tied_stages()
    g = torch.Generator().manual_seed(3)
    ids, targets = torch.randint(0, 10, (8,), generator=g), torch.randint(0, 10, (8,), generator=g)
    ref = copy.deepcopy(torch.nn.Sequential(*stages))
    opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(ref(ids), targets)
        loss.backward()
        opt.step()
        want.append(loss.item())
    return stages, ids, targets, want, ref[0][0].weight.detach()


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_weights_tied_across_stages(schedule):
    stages, ids, targets, want, want_table = _tied_case()
    for losses, table in mt.launch(_tied, stages, ids, targets, schedule, mesh="stage:2"):
        assert losses == pytest.approx(want, rel=1e-12)
        torch.testing.assert_close(table, want_table, rtol=1e-10, atol=1e-12)
    # the list itself, whose stages share the table: on threads both stages' optimizers would step it
    shared = (r"parameter '1.emb.weight' of model chunk 1 \(stage 1\) is also '0.weight' of model chunk 0 "
              r"\(stage 0\): on the threads backend .*lambda i: copy.deepcopy\(stages\[i\]\).*after_backward")
    with pytest.raises(ProcessorError, match=shared):
        mt.launch(lambda: Pipeline(stages, microbatches=2, loss_fn=F.cross_entropy), mesh="stage:2")


def test_weights_tied_across_stages_of_a_list_on_processes():
    """Each process holds its own copy of the list, and runs only its own stage: the documented
    after_backward recipe is right there, and the list was refused as on threads."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    stages, ids, targets, want, want_table = _tied_case()
    out = mt.launch(_tied, stages, ids, targets, "1f1b", "list", mesh="stage:2", backend="torch", timeout=120)
    for losses, table in out:
        assert losses == pytest.approx(want, rel=1e-12)
        torch.testing.assert_close(table, want_table, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ accumulation, checkpoints
def _accumulate_and_resume(chunks, data, schedule):
    built = [torch.nn.Sequential(*chunks[:2]), torch.nn.Sequential(*chunks[2:])]

    def make():  # an nn.ModuleList of stages, as a user holding the model in one may pass it
        return Pipeline(torch.nn.ModuleList(copy.deepcopy(built)), microbatches=2, schedule=schedule,
                        loss_fn=F.mse_loss, optimizer=lambda ps: torch.optim.Adam(ps, lr=0.05))

    acc = make()
    sgd = torch.optim.SGD(acc.parameters(), lr=0.1)
    for x, y in data[:2]:
        acc.forward_backward(x, y)
    sgd.step()

    straight = make()
    for x, y in data:
        straight.step(x, y)
    first = make()
    for x, y in data[:2]:
        first.step(x, y)
    buf = io.BytesIO()  # one file per stage
    torch.save({"model": first.module.state_dict(), "optimizer": first.optimizer.state_dict(),
                "previous": first.weight_versions()[-1]}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    resumed = make()
    resumed.module.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    resumed.set_weight_versions(saved["previous"])  # a no-op but under 2BW
    for x, y in data[2:]:
        resumed.step(x, y)
    return acc.module.state_dict(), straight.module.state_dict(), resumed.module.state_dict()


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_accumulation_and_a_resumed_checkpoint(schedule):
    chunks = [c.eval() for c in user_chunks()]  # no dropout here
    data = user_data(steps=4, n=8)
    model = torch.nn.Sequential(*copy.deepcopy(chunks))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data[:2]:
        F.mse_loss(model(x), y).backward()  # two batches' gradients summed, one step
    sgd.step()
    out = mt.launch(_accumulate_and_resume, chunks, data, schedule, mesh="stage:2")
    for s, (acc, straight, resumed) in enumerate(out):
        for name, t in acc.items():
            torch.testing.assert_close(t, model.state_dict()[f"{2 * s + int(name[0])}{name[1:]}"],
                                       rtol=1e-10, atol=1e-12)
        for name, t in straight.items():
            torch.testing.assert_close(resumed[name], t, rtol=1e-12, atol=1e-14, msg=name)


# ------------------------------------------------------------------ a placed plain module
def _placed(model, placement, data):
    pipe = Pipeline(model, placement, microbatches=2, loss_fn=F.mse_loss,
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    return [pipe.step(x, y) for x, y in data]


def test_a_placed_plain_module_runs_on_thread_processors(monkeypatch):
    """Each thread-processor traces the module with torch.fx, which patches nn.Module.__call__ for
    every thread while it runs: the traces once raced each other and the other stages' forwards.
    A slow tracer makes the race certain."""
    import time

    from meshtorch.placement import Problem, place
    from meshtorch.placement.trace import DeviceSpec, trace

    g = torch.Generator().manual_seed(4)
    layers = [m for i in range(6) for m in (_linear(6, 6, g), torch.nn.Tanh())] + [_linear(6, 2, g)]
    model = torch.nn.Sequential(*layers)
    data = [(torch.randn(8, 6, generator=g, dtype=torch.float64),
             torch.randn(8, 2, generator=g, dtype=torch.float64)) for _ in range(2)]
    want, state = _dense_sgd(model, data)
    placement = place(trace(torch.fx.symbolic_trace(model), data[0][0], spec=DeviceSpec(link_bandwidth=1e18)),
                      Problem(devices=3))
    assert len(placement.stages) == 3
    call_module = torch.fx.Tracer.call_module

    def slow(self, *args, **kwargs):
        time.sleep(0.005)
        return call_module(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Tracer, "call_module", slow)
    for losses in mt.launch(_placed, model, placement, data, mesh="stage:3"):
        assert losses == pytest.approx(want, rel=1e-12)
    for name, t in state.items():
        torch.testing.assert_close(model.state_dict()[name], t, rtol=1e-10, atol=1e-12)
    with pytest.raises(ProcessorError, match=r"the placement has 3 stages but axis 'stage' has 2 processors "
                                             r"\(the placer uses fewer stages .*use a mesh with 'stage:3'"):
        mt.launch(lambda: Pipeline(model, placement, microbatches=2), mesh="stage:2")


def test_a_placement_of_too_few_chunks_for_virtual_stages_names_a_problem_that_fits():
    """The hint was Problem(devices=p), which gives p chunks where p·v are needed; following it
    failed again. The interleaved problem cuts exactly p·v chunks, and the pipeline takes them."""
    from meshtorch.placement import Problem, place
    from meshtorch.placement.trace import DeviceSpec, trace

    model, data = _replica_model_and_data()
    graph = trace(torch.fx.symbolic_trace(model), data[0][0], spec=DeviceSpec(link_bandwidth=1e18))
    three = place(graph, Problem(devices=3))
    assert len(three.stages) == 3
    hint = (r"the placement has 3 model chunks but axis 'stage' has 2 processors × 2 virtual stages .*; "
            r"place with Problem\(devices=2, schedule='interleaved', virtual_stages=2, "
            r"microbatches=<a multiple of 2>\), which cuts exactly 4 chunks "
            r"\(Problem\(devices=4\) may return fewer")
    with pytest.raises(ProcessorError, match=hint):
        mt.launch(lambda: Pipeline(model, three, microbatches=2, schedule="interleaved", virtual_stages=2),
                  mesh="stage:2")
    four = place(graph, Problem(devices=2, schedule="interleaved", virtual_stages=2, microbatches=2))
    assert len(four.stages) == 4
    want, _ = _dense_sgd(model, data)

    def train():
        pipe = Pipeline(copy.deepcopy(model), four, microbatches=2, schedule="interleaved", virtual_stages=2,
                        loss_fn=F.mse_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        return [pipe.step(x, y) for x, y in data]

    for losses in mt.launch(train, mesh="stage:2"):
        assert losses == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------ data-parallel replicas on threads
def _dense_sgd(model, data, lr=0.1):
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    want = []
    for x, y in data:
        opt.zero_grad()
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    return want, ref.state_dict()


def _replicated(stages, placement, data):
    dp = mt.current().coords["dp"]
    pipe = Pipeline(stages, placement, microbatches=2, loss_fn=F.mse_loss, data_axes=("dp",),
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    losses = [pipe.step(x.chunk(2)[dp], y.chunk(2)[dp]) for x, y in data]
    return losses, {n: p.detach().clone() for n, p in pipe.module.named_parameters()}


def _replica_model_and_data():
    g = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(_linear(4, 6, g), torch.nn.Tanh(), _linear(6, 6, g), torch.nn.Tanh(),
                                _linear(6, 1, g))
    data = [(torch.randn(8, 4, generator=g, dtype=torch.float64),
             torch.randn(8, 1, generator=g, dtype=torch.float64)) for _ in range(3)]
    return model, data


def test_data_parallel_replicas_of_a_list_train_like_the_unsplit_model_on_threads():
    """On stage:2,dp:2 threads, both dp replicas of a stage got the list's one module object, so two
    optimizers stepped the same tensors (each replica's averaged gradient applied twice): the losses
    left the unsplit model's from the second step. Each replica but the first now trains its own copy,
    made before training (the first trains the objects given, as on one replica)."""
    model, data = _replica_model_and_data()
    want, state = _dense_sgd(model, data)
    stages = [model[:2], model[2:]]
    out = mt.launch(_replicated, stages, None, data, mesh="stage:2,dp:2")
    for losses, _ in out:
        assert losses == pytest.approx(want, rel=1e-12)
    got = {**out[0][1], **out[2][1]}  # a Sequential's slices keep its names: stage 1 holds "2.weight", ...
    assert sorted(got) == sorted(state)
    for name, t in state.items():
        torch.testing.assert_close(got[name], t, rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(model.state_dict()[name], t, rtol=1e-10, atol=1e-12, msg=name)
    for a, b in ((0, 1), (2, 3)):  # the replicas hold equal weights
        assert all(torch.equal(out[a][1][n], out[b][1][n]) for n in out[a][1])


def test_data_parallel_replicas_of_a_placed_module_train_like_the_unsplit_model_on_threads():
    """A placed module is traced on every thread: the stage's cut parts held the module's own
    parameters on both dp replicas, stepped twice per step."""
    from meshtorch.placement import Problem, place
    from meshtorch.placement.trace import DeviceSpec, trace

    model, data = _replica_model_and_data()
    want, state = _dense_sgd(model, data)
    placement = place(trace(torch.fx.symbolic_trace(model), data[0][0], spec=DeviceSpec(link_bandwidth=1e18)),
                      Problem(devices=2))
    assert len(placement.stages) == 2
    for losses, _ in mt.launch(_replicated, model, placement, data, mesh="stage:2,dp:2"):
        assert losses == pytest.approx(want, rel=1e-12)
    for name, t in state.items():
        torch.testing.assert_close(model.state_dict()[name], t, rtol=1e-10, atol=1e-12, msg=name)


# ------------------------------------------------------------------ what cannot work
def _make(stages, v=1, schedule="1f1b", loss_fn=F.mse_loss, m=2):
    return Pipeline(stages, microbatches=m, schedule=schedule, virtual_stages=v, loss_fn=loss_fn,
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def _two(i):
    return torch.nn.Linear(4, 4).double() if i == 0 else torch.nn.Linear(4, 1).double()


def _inference_mode_step():
    with torch.inference_mode():
        _make(_two).step(torch.zeros(4, 4, dtype=torch.float64), torch.zeros(4, 1, dtype=torch.float64))


X, Y = torch.zeros(4, 4, dtype=torch.float64), torch.zeros(4, 1, dtype=torch.float64)
I = torch.nn.Identity


@pytest.mark.parametrize("run,match", [
    (lambda: _make([I(), I()], v=0, schedule="interleaved"),
     r"needs >= 1 .* virtual stage, got 2, 2, 1 and 0"),
    # 3 chunks fit no mesh with 2 per stage: the message names no mesh (it once said 'stage:3')
    (lambda: _make([I(), I(), I()], v=2, schedule="interleaved"),
     r"3 model chunks but axis 'stage' has 2 processors × 2 virtual stages; split the model into 4 model "
     r"chunks$"),
    (lambda: _make(torch.nn.Sequential(I(), I())),
     r"stages is one Sequential and no placement: .*list\(model\)"),
    (lambda: _make(_two, loss_fn=lambda o, t: (o - t) ** 2).step(X, Y),
     r"stage 1 .* forward of micro-batch 0: loss_fn returned shape \[2, 1\]; it must return a scalar"),
    (lambda: _make(_two, loss_fn=lambda o, t: (o - t) ** 2).loss(X, Y),
     r"stage 1 .* forward of micro-batch 0: loss_fn returned shape \[2, 1\]; it must return a scalar"),
    (lambda: _make(_two, m=8).step(X, Y), r"shape \[4, [14]\] cannot be cut into 8 equal micro-batches"),
    (_inference_mode_step, r"cannot run under torch.inference_mode\(\).*Pipeline.loss\(\)"),
], ids=["v=0", "chunks-fit-no-mesh", "sequential", "vector-loss", "vector-loss-eval", "m>batch",
        "inference-mode"])
def test_what_cannot_work_is_named(run, match):
    with pytest.raises(ProcessorError, match=match):
        mt.launch(run, mesh="stage:2")


# ------------------------------------------------------------------ meshtorch place on nn modules
class NeedsArgs(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x)


class BuggyInit(torch.nn.Module):
    """Builds without arguments, but its own constructor has a bug (Linear's out_features missing)."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.lin = torch.nn.Linear(width)

    def forward(self, x):
        return self.lin(x)


class TokenModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)

    def forward(self, ids):
        return self.lin(torch.relu(self.emb(ids)))


class TokenModelWithInputs(TokenModel):
    def example_inputs(self):
        return (torch.randint(0, 50, (4, 8)),)


def test_place_cli_names_what_a_model_needs(capsys):
    here = "tests.test_pipeline_user_probes"
    assert main(["place", f"{here}:NeedsArgs", "--input-shape", "4,8", "--devices", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"meshtorch place: error: cannot build {here}:NeedsArgs without arguments (")
    assert "'width'" in err and "module:net, net = Net(...)" in err and "Traceback" not in err
    # a TypeError the constructor's own code raises was reported as missing arguments: it is its own
    with pytest.raises(TypeError, match=r"Linear.__init__\(\) missing 1 required positional argument: "
                                        r"'out_features'"):
        main(["place", f"{here}:BuggyInit", "--input-shape", "4,4", "--devices", "2"])
    # token ids: --input-shape makes floats; the error points at example_inputs()
    assert main(["place", f"{here}:TokenModel", "--input-shape", "4,8", "--devices", "2"]) == 2
    err = capsys.readouterr().err
    assert "its layer 'emb' (Embedding)" in err and "give the model an example_inputs() method" in err
    assert main(["place", f"{here}:TokenModelWithInputs", "--devices", "2", "--training"]) == 0
    assert "max load" in capsys.readouterr().out
