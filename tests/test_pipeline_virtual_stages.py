"""Virtual stages in the executor: interleaved 1F1B with v model chunks per stage (chunk c on stage
c mod p), ZB-V (chunks c and 2p-1-c on stage c) and ZB-H1 train exactly like the unsplit model, on
threads and on gloo processes, with data-parallel replicas, for plain stages and for the MeshTensor
LM, also on a mesh with a data and a model axis; untagged messages (NCCL's matching) arrive right;
and ``meshtorch train --virtual-stages``."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.errors import PipelineError
from meshtorch.pipeline import Pipeline, build_schedule
from meshtorch.pipeline.executor import chunks_of
from meshtorch.pipeline.lm import lm_pipeline, named_model_parameters, owner_stage
from meshtorch.pipeline.schedule import BACKWARD, FORWARD, model_chunk_of
from test_pipeline import reference
from test_pipeline_lm import _unsplit, config, data

pytestmark = pytest.mark.timeout(180)

WIDTHS = [5, 7, 6, 4, 3, 6, 5, 4]  # chunk boundaries of different widths: activations of different shapes


def make_chunks(n: int, seed: int = 0) -> list[torch.nn.Module]:
    """``n`` float64 MLP model chunks; chunk ``c`` maps WIDTHS[c] -> WIDTHS[c + 1] (tanh between)."""
    g = torch.Generator().manual_seed(seed)
    widths = WIDTHS[:n] + [2]
    chunks = []
    for i in range(n):
        lin = torch.nn.Linear(widths[i], widths[i + 1]).double()
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g, dtype=torch.float64) * 0.5)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g, dtype=torch.float64) * 0.1)
        chunks.append(torch.nn.Sequential(lin, torch.nn.Tanh()) if i < n - 1 else lin)
    return chunks


def make_data(steps: int, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, WIDTHS[0], generator=g, dtype=torch.float64),
             torch.randn(n, 2, generator=g, dtype=torch.float64)) for _ in range(steps)]


def _interleaved(chunks, data, v, m, recompute=False, replicas=1, schedule="interleaved"):
    pipe = Pipeline(lambda c: copy.deepcopy(chunks[c]), microbatches=m, schedule=schedule,
                    virtual_stages=v, recompute=recompute, loss_fn=torch.nn.functional.mse_loss,
                    optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    r = mt.current().coords.get("dp", 0)
    x0, y0 = data[0][0].chunk(replicas)[r], data[0][1].chunk(replicas)[r]
    before = pipe.loss(x0, y0)  # the forwards only (evaluation): the first step's loss
    losses = [pipe.step(x.chunk(replicas)[r], y.chunk(replicas)[r]) for x, y in data]
    order = [(k, i, c) for (k, i, *_), c in zip(pipe.trace, pipe.executor.trace_chunks)]
    assert before == pytest.approx(losses[0], rel=1e-12)
    return pipe.stage, [c.state_dict() for c in chunks_of(pipe.module)], losses, order


def _check(out, chunks, data, p, v, m, schedule="interleaved"):
    want, want_losses = reference(chunks, data)
    table = build_schedule(schedule, p, m, virtual_stages=v)
    for s, states, losses, order in out:
        assert order == [(a.kind, a.microbatch, a.chunk) for a in table.for_stage(s)]  # the table's order
        assert losses == pytest.approx(want_losses, rel=1e-12)
        assert len(states) == v
        for k, state in enumerate(states):  # local chunk k is model chunk k·p + s (the V's: s, 2p-1-s)
            for name, value in want[model_chunk_of(s, k, p, table.placement)].items():
                torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=f"{s}.{k}.{name}")
    assert not torch.allclose(want[0]["0.weight"], chunks[0][0].weight)  # the test can fail: Adam moved it


@pytest.mark.parametrize("schedule,p,v,m,recompute", [
    ("interleaved", 2, 2, 4, False), ("interleaved", 3, 2, 3, False), ("interleaved", 1, 3, 2, False),
    ("interleaved", 2, 3, 2, True),
    # ZB-V: chunk c and 2p-1-c on stage c; fewer micro-batches than the 2p - 1 that fill the V, too
    ("zbv", 2, 2, 4, False), ("zbv", 3, 2, 6, False), ("zbv", 3, 2, 2, False), ("zbv", 1, 2, 2, False),
    ("zbv", 2, 2, 3, True),
])
def test_chunked_schedules_train_like_the_unsplit_model(schedule, p, v, m, recompute):
    # one stage: its chunks hand values to each other in memory (and under ZB-V, the last stage its two)
    chunks, batch = make_chunks(p * v), make_data(3, 12)
    out = mt.launch(_interleaved, chunks, batch, v, m, recompute, 1, schedule, mesh=f"stage:{p}")
    _check(out, chunks, batch, p, v, m, schedule)


def _zbv_in_one_table(chunks, data, m):
    pipe = Pipeline(lambda c: copy.deepcopy(chunks[c]), microbatches=m, schedule="zbv", virtual_stages=2,
                    loss_fn=torch.nn.functional.mse_loss, optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    losses = pipe.train(data)  # one table of every batch: each flushed, its update at the table's slot
    return pipe.stage, [c.state_dict() for c in pipe.module], losses, None


def test_zbv_trains_several_batches_in_one_table():
    chunks, batch = make_chunks(6), make_data(3, 12)
    out = mt.launch(_zbv_in_one_table, chunks, batch, 3, mesh="stage:3")
    want, want_losses = reference(chunks, batch)
    for s, states, losses, _ in out:
        assert losses == pytest.approx(want_losses, rel=1e-12)
        for k, state in enumerate(states):
            for name, value in want[model_chunk_of(s, k, 3, "v")].items():
                torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=f"{s}.{k}.{name}")


@pytest.mark.parametrize("schedule,v", [("interleaved", 2), ("zb", 1), ("zbv", 2)])
def test_synchronous_schedules_with_data_parallel_replicas(schedule, v):
    # plain torch.nn chunks replicated over dp: each replica's weight gradients (W under zb) are
    # averaged over dp before the update, as the unsplit model's gradient of the whole batch
    p, m = 2, 2
    chunks, batch = make_chunks(p * v), make_data(3, 16)
    out = mt.launch(_interleaved, chunks, batch, v, m, False, 2, schedule, mesh="dp:2,stage:2")
    assert [o[0] for o in out] == [0, 1, 0, 1]
    _check(out, chunks, batch, p, v, m, schedule)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 3),
       st.sampled_from(["interleaved", "zb", "1f1b"]))
def test_each_pair_receives_in_the_order_it_sends(p, v, rounds, name):
    # Tags keep the chunks' messages apart on gloo; NCCL ignores tags and matches a pair's messages in
    # order. These tables make every stage need a peer's messages in the order the peer sends them
    # (ZB-V's do not: the executor takes them in the sender's order, test_untagged_messages_...)
    v = v if name == "interleaved" else 1
    t = build_schedule(name, p, rounds * p, batches=2, virtual_stages=v)
    n = p * v
    sent: dict[tuple[int, int], list] = {}
    got: dict[tuple[int, int], list] = {}
    for a in t.actions:
        c, s = t.model_chunk(a), a.stage
        if a.kind == FORWARD:
            if c > 0:
                got.setdefault((t.where(c - 1)[0], s), []).append(("F", c, a.microbatch, a.slot))
            if c < n - 1:
                sent.setdefault((s, t.where(c + 1)[0]), []).append(("F", c + 1, a.microbatch, a.slot))
        elif a.kind == BACKWARD:
            if c < n - 1:
                got.setdefault((t.where(c + 1)[0], s), []).append(("B", c, a.microbatch, a.slot))
            if c > 0:
                sent.setdefault((s, t.where(c - 1)[0]), []).append(("B", c - 1, a.microbatch, a.slot))
    for pair in set(sent) | set(got):
        if pair[0] == pair[1]:
            continue
        order = [x[:3] for x in sorted(sent.get(pair, []), key=lambda x: x[3])]
        assert order == [x[:3] for x in sorted(got.get(pair, []), key=lambda x: x[3])], pair


@pytest.mark.parametrize("schedule,p,v,m", [("zbv", 2, 2, 4), ("zbv", 3, 2, 6), ("interleaved", 2, 2, 4),
                                             ("zb", 3, 1, 4)])
def test_untagged_messages_arrive_in_the_senders_order(monkeypatch, schedule, p, v, m):
    # NCCL ignores tags: with every message's tag 0 each pair's messages match only in the order sent.
    # Under ZB-V stage 1 needs stage 0's gradient for chunk 2 before its activation for chunk 1 of a later
    # micro-batch, sent before it; the executor takes them in the sender's order and keeps the early one.
    from meshtorch.pipeline import executor

    send, recv = executor.send_value, executor.recv_value
    monkeypatch.setattr(executor, "send_value", lambda comm, value, axis, dst, _: send(comm, value, axis, dst,
                                                                                       0))
    monkeypatch.setattr(executor, "recv_value", lambda comm, axis, src, _: recv(comm, axis, src, 0))
    chunks, batch = make_chunks(p * v), make_data(2, 12)
    out = mt.launch(_interleaved, chunks, batch, v, m, False, 1, schedule, mesh=f"stage:{p}")
    _check(out, chunks, batch, p, v, m, schedule)


def _lm(cfg, v, schedule, m=2):
    pipe = lm_pipeline(cfg, microbatches=m, schedule=schedule, virtual_stages=v,
                       optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    losses = []
    for seq in data():
        ids = mt.from_global(seq[:, :-1].contiguous(), "batch:8,length:6")
        tgt = mt.from_global(seq[:, 1:].contiguous(), "batch:8,length:6")
        losses.append(pipe.step(ids, tgt))
    params = {n: p.mesh_tensor.to_global() for n, p in named_model_parameters(pipe.module)}
    owners = {n: owner_stage(n, cfg, pipe.num_stages, v, pipe.schedule.placement) for n in params}
    return losses, params, owners, pipe.stage, pipe.last_stage


@pytest.mark.parametrize("mesh,rules,v,schedule", [
    ("stage:2,b:2", "batch:b", 2, "interleaved"),   # tied table on chunks 0 (stage 0) and 3 (stage 1)
    ("stage:1", "", 4, "interleaved"),              # one stage: the first and the last chunk share it
    ("stage:2,m:2", "heads:m; d_ff:m; vocab:m", 1, "zb"),
    # 3-D: each schedule composed with a data axis and a model axis at once
    ("stage:2,b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m", 2, "interleaved"),
    ("stage:2,b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m", 1, "zb"),
    # ZB-V: stage 0 holds chunks 0 and 3, so the embedding and the tied output table; stage 1 chunks 1, 2
    ("stage:2,b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m", 2, "zbv"),
])
def test_lm_chunks_train_like_the_unsplit_lm(mesh, rules, v, schedule):
    cfg = config(True, layers=4)
    (want_losses, want), = mt.launch(_unsplit, cfg)
    out = mt.launch(_lm, cfg, v, schedule, mesh=mesh, rules=rules)
    seen = set()
    for losses, params, owners, stage, last in out:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        assert last == (0 if schedule == "zbv" else mt.Mesh(mesh).axis_size("stage") - 1)  # the loss's stage
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-5, msg=name)
            seen.add(name)
        # each stage holds what owner_stage says (the tied table on the last stage too)
        assert {n for n, s in owners.items() if s == stage} == {n for n in params if not (
            n == "embed.table" and stage != 0)}
    assert seen == set(want)
    assert want_losses[-1] < want_losses[0]


def _gloo(chunks, stages, batch):
    # one spawn for all: process start-up dominates (the LM on gloo: the 8-process test below)
    return {"plain": _interleaved(chunks, batch, 2, 4),
            "plain_zb": _interleaved(stages, batch, 1, 4, schedule="zb"),
            "plain_zbv": _interleaved(chunks, batch, 2, 4, schedule="zbv")}


def _assert_lm(out, want_losses, want):
    seen = set()
    for losses, params in out:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-5, msg=name)
            seen.add(name)
    assert seen == set(want)


def test_interleaved_zb_and_zbv_on_two_gloo_processes():
    chunks, stages, batch = make_chunks(4), make_chunks(2), make_data(3, 8)
    out = mt.launch(_gloo, chunks, stages, batch, mesh="stage:2", backend="torch", timeout=120)
    _check([o["plain"] for o in out], chunks, batch, 2, 2, 4)
    _check([o["plain_zb"] for o in out], stages, batch, 2, 1, 4, "zb")
    _check([o["plain_zbv"] for o in out], chunks, batch, 2, 2, 4, "zbv")


def _gloo_3d(lm_cfg):
    return {"interleaved": _lm(lm_cfg, 2, "interleaved")[:2], "zb": _lm(lm_cfg, 1, "zb")[:2],
            "zbv": _lm(lm_cfg, 2, "zbv")[:2]}


def test_interleaved_zb_and_zbv_on_gloo_processes_with_data_and_model_axes():
    # 8 processes: each stage data-parallel over b and its heads, d_ff and vocab split over m; the
    # collectives over b and m run on gloo subgroups between the stages' point-to-point messages
    cfg = config(True, layers=4)
    (want_losses, want), = mt.launch(_unsplit, cfg)
    out = mt.launch(_gloo_3d, cfg, mesh="stage:2,b:2,m:2", rules="batch:b; heads:m; d_ff:m; vocab:m",
                    backend="torch", timeout=180)
    for name in ("interleaved", "zb", "zbv"):
        _assert_lm([o[name] for o in out], want_losses, want)


def test_virtual_stages_refuse_what_they_cannot_do():
    chunks = make_chunks(4)

    def build(n, **kw):
        return Pipeline(chunks[:n], microbatches=2, loss_fn=torch.nn.functional.mse_loss, **kw)

    with pytest.raises(PipelineError,
                       match=r"3 model chunks but axis 'stage' has 2 processors × 2 virtual stages"):
        mt.launch(build, 3, schedule="interleaved", virtual_stages=2, mesh="stage:2")
    with pytest.raises(PipelineError, match="needs schedule='interleaved'"):
        mt.launch(build, 4, schedule="1f1b", virtual_stages=2, mesh="stage:2")
    with pytest.raises(PipelineError, match="3 layers cannot fill 4 pipeline stages"):
        mt.launch(lambda: lm_pipeline(config(True, layers=3), schedule="interleaved", virtual_stages=2),
                  mesh="stage:2")


def test_meshtorch_train_interleaved_zb_and_zbv_reach_the_unsplit_runs_loss(tmp_path, capsys):
    import json
    import os

    from meshtorch import cli
    from run_harness import checkpoint_tensors, tiny_train, write_corpus

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    tiny = tiny_train(layers=4, batch=8, eval_batches=2, log_every=1, warmup=2, steps=3,
                      data=write_corpus(corpus, 4), mesh="b:1", rules="")
    runs = {"plain": [], "interleaved": ["--pipeline-stages", "2", "--virtual-stages", "2", "--schedule",
                                         "interleaved", "--microbatches", "2"],
            "zb": ["--pipeline-stages", "2", "--schedule", "zb", "--microbatches", "2"],
            "zbv": ["--pipeline-stages", "2", "--virtual-stages", "2", "--schedule", "zbv", "--microbatches",
                    "2"]}
    for name, flags in runs.items():
        assert cli.main(["train", "--out", str(tmp_path / name), *tiny, *flags]) == 0
    assert "pipeline of 2 stages × 2 chunks (interleaved, 2 micro-batches)" in capsys.readouterr().out

    def losses(name):
        with open(tmp_path / name / "metrics.jsonl") as f:
            return [json.loads(line)["loss"] for line in f]

    plain = checkpoint_tensors(str(tmp_path / "plain"))
    for name in ("interleaved", "zb", "zbv"):
        # synchronous schedules: AdamW, warm-up, clipping over all stages (the tied table once) as unsplit
        assert losses(name) == pytest.approx(losses("plain"), abs=2e-4)
        summary = json.load(open(os.path.join(tmp_path, name, "summary.json")))
        assert (summary["schedule"], summary["virtual_stages"]) == (name, 1 if name == "zb" else 2)
        got = checkpoint_tensors(str(tmp_path / name))  # gathered from the chunks: the unsplit run's
        assert sorted(got) == sorted(plain)
        for k in plain:
            torch.testing.assert_close(got[k], plain[k], rtol=1e-3, atol=2e-4, msg=f"{name} {k}")


@pytest.mark.parametrize("flags,match", [
    (dict(layers=6, virtual_stages=2, schedule="interleaved"),
     "--layers 6 do not divide into --pipeline-stages 2 × --virtual-stages 2 = 4 model chunks"),
    (dict(layers=4, virtual_stages=2, schedule="1f1b"), "--virtual-stages 2 needs --schedule interleaved"),
    (dict(layers=4, virtual_stages=2, schedule="interleaved", microbatches=3),
     "--microbatches 3 must be a multiple of 2"),
    (dict(layers=1, schedule="zb"), "--layers 1 do not divide into --pipeline-stages 2"),
    (dict(layers=4, virtual_stages=2, pipeline_stages=1),
     "--virtual-stages 2 .* needs --pipeline-stages > 1"),
    (dict(layers=4, schedule="zbv"), "--schedule zbv places 2 model chunks on each stage .* got 1"),
])
def test_stage_flags_that_cannot_work_are_named(flags, match):
    from meshtorch.recipes.lm import TrainConfig, check_config

    with pytest.raises(PipelineError, match=match):
        check_config(TrainConfig.of(**{"pipeline_stages": 2, **flags}))
