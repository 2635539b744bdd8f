"""``meshtorch train --pipeline-stages N``: the LM trained as a pipeline along a ``stage`` axis.

:func:`train_pipeline` is what :func:`meshtorch.train.train` runs when
``pipeline_stages > 1``. The mesh gets a ``stage:N`` axis in front unless it
has one (so ``--mesh b:2 --pipeline-stages 2`` runs on ``stage:2,b:2``, four
processors); the layout rules are the usual ones and never mention it.
``--schedule gpipe|1f1b|2bw`` picks the pipeline schedule (``--lr-schedule``
the learning rate's), ``--microbatches`` the micro-batches per batch.
Gradient clipping uses the norm over all stages (the tied embedding table
counted once). The batches between two log (or checkpoint) steps run as one
table, so 2BW does not flush inside it. Processor 0 writes ``metrics.jsonl``,
``summary.json`` and ``loss.png``; every processor gathers the whole model
(and optimizer state) from the stages for ``checkpoint/``, the unsplit run's
format (``meshtorch generate`` and ``--resume`` read it), the held-out loss
and the generated sample. Under 2BW the checkpoint also holds the previous
weight version ``W(t-1)`` (tensors ``model/previous.<name>``, which loading
into the plain LM ignores), so ``--resume`` continues exactly like the
uninterrupted run; a checkpoint without them resumes with ``W(t-1) = W(t)``.

Example:
    >>> from meshtorch.pipeline.train import pipeline_mesh
    >>> pipeline_mesh("b:2", 2), pipeline_mesh("b:2,stage:2", 2)
    ('stage:2,b:2', 'b:2,stage:2')
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from meshtorch.context import current
from meshtorch.errors import PipelineError
from meshtorch.mesh import Mesh

AXIS = "stage"


def pipeline_mesh(mesh: str, stages: int) -> str:
    """``mesh`` with a ``stage:<stages>`` axis in front, unless it has a ``stage`` axis of that size."""
    m = Mesh(mesh)
    if AXIS in m.axis_names:
        if m.axis_size(AXIS) != stages:
            raise PipelineError(f"--mesh {mesh!r} has a {AXIS!r} axis of size {m.axis_size(AXIS)} but "
                                f"--pipeline-stages is {stages}; make them equal or drop the axis")
        return mesh
    return f"{AXIS}:{stages}" + (f",{mesh}" if mesh else "")


def _clip(pipe, max_norm: float) -> None:
    """Scale every stage's gradients so that the norm over the whole model is at most ``max_norm``."""
    from meshtorch.optim.clip import global_grad_norm

    mod = pipe.module
    # the tied table sits on the first and the last stage with equal gradients: count it once
    params = [p for n, p in mod.named_parameters() if not (n.startswith("table.") and not mod.first)]
    local = global_grad_norm(params).to(torch.float64) ** 2
    total = current().comm.all_reduce(local.reshape(1), AXIS)[0].sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in mod.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))


PREVIOUS = "previous"  # 2BW's W(t-1) in the checkpoint: tensors model/previous.<name>


def _with_previous(model, previous):
    """A module whose parameters are ``model``'s (same names, so the optimizer state keeps its
    names) and ``previous``'s under ``previous.``: what a 2BW checkpoint saves and loads."""
    from meshtorch.nn.module import Module

    both = Module()
    # torch's add_module: Module.add_module would re-derive the children's values from their new paths
    for name, child in [*model.named_children(), (PREVIOUS, previous)]:
        torch.nn.Module.add_module(both, name, child)
    return both


def program(cfg, corpus, out: str) -> dict[str, Any]:
    """One processor's part of a pipeline training run."""
    from meshtorch.checkpoint.format import read_index
    from meshtorch.data import ByteTokenizer, LMBatches
    from meshtorch.models import DecoderLM
    from meshtorch.pipeline.lm import gather_whole, lm_pipeline, restore_previous
    from meshtorch.train import earlier_metrics, lr_at, make_optimizer, report, resume_run, save_run

    lead = current().rank == 0
    tok = ByteTokenizer()
    mcfg = cfg.model_config(tok.vocab_size)
    train = LMBatches(corpus.train, cfg.batch, cfg.length, seed=cfg.seed)
    heldout = LMBatches(corpus.heldout, cfg.batch, cfg.length, seed=12345)
    # every processor holds the whole model and an optimizer over it, so the checkpoint is the
    # unsplit run's (any mesh can load it, `meshtorch generate` reads it); the stage trains its share
    # (the others have no gradients, so the optimizer skips them)
    model = DecoderLM(mcfg, seed=cfg.seed)
    opt = make_optimizer(cfg, model)
    # 2BW: the whole model's W(t-1), gathered from the stages for the checkpoint
    previous = DecoderLM(mcfg, seed=cfg.seed) if cfg.schedule == "2bw" else None
    resumed_previous = bool(cfg.resume) and previous is not None and any(
        k.startswith(f"model/{PREVIOUS}.")
        for k in read_index(os.path.join(cfg.resume, "checkpoint"))["tensors"])
    start = resume_run(cfg, model, opt, train, lead,
                       saved=_with_previous(model, previous) if resumed_previous else None)
    pipe = lm_pipeline(mcfg, model=model, axis=AXIS, microbatches=cfg.microbatches, schedule=cfg.schedule)
    pipe.optimizer, pipe.batches_trained = opt, start
    if resumed_previous:
        restore_previous(pipe, previous)
    if cfg.clip:
        sync = pipe.after_backward

        def after_backward():
            sync()
            _clip(pipe, cfg.clip)

        pipe.after_backward = after_backward

    def set_lr(t: int) -> None:
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, t)

    pipe.before_step = set_lr
    metrics: list[dict] = []
    if lead:
        metrics = earlier_metrics(cfg, out, start)
        print(f"pipeline of {pipe.num_stages} stages ({pipe.schedule.name}, {cfg.microbatches} "
              f"micro-batches) on mesh '{current().mesh}' rules '{cfg.rules}'; {cfg.steps} steps of "
              f"{cfg.batch}x{cfg.length} tokens")

    def save(step: int) -> None:
        gather_whole(pipe, model, opt, previous)
        save_run(cfg, out, model, opt, train, step,
                 saved=None if previous is None else _with_previous(model, previous))

    t0, loss, step = time.perf_counter(), float("nan"), start
    while step < cfg.steps:
        # one table up to the next log or checkpoint step: 2BW runs it without a flush
        stops = [cfg.steps, (step // cfg.log_every + 1) * cfg.log_every]
        if cfg.checkpoint_every:
            stops.append((step // cfg.checkpoint_every + 1) * cfg.checkpoint_every)
        n = min(stops) - step
        window = time.perf_counter()
        loss = pipe.train([train.next() for _ in range(n)])[-1]
        step += n
        dt = (time.perf_counter() - window) / n
        if step % cfg.log_every == 0 or step == cfg.steps:
            rec = {"step": step, "loss": round(loss, 5), "step_time_s": round(dt, 4),
                   "tokens_per_s": round(cfg.batch * cfg.length / dt, 1), "lr": lr_at(cfg, step - 1)}
            metrics.append(rec)
            if lead:
                print(f"step {step}: loss {loss:.3f}, {dt * 1e3:.0f} ms/step", flush=True)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step != cfg.steps:
            save(step)
    wall = time.perf_counter() - t0
    save(cfg.steps)
    result = {"steps": cfg.steps, "final_loss": loss, "out": out, "schedule": pipe.schedule.name,
              "pipeline_stages": pipe.num_stages, "microbatches": cfg.microbatches, "train_s": round(wall, 2),
              "checkpoint": os.path.join(out, "checkpoint")}
    # held-out loss and the sample from the whole model, as in the unsplit run
    result.update(report(cfg, model, heldout, corpus, tok, lead))
    if lead:
        from meshtorch.train import plot_losses

        result["loss_png"] = plot_losses(os.path.join(out, "loss.png"), metrics,
                                         [(cfg.steps, result["heldout_loss"])], result["unigram_entropy"])
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in metrics)
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


def train_pipeline(cfg) -> dict[str, Any]:
    """Run :func:`program` on every processor of the pipeline mesh; return processor 0's summary."""
    import dataclasses

    from meshtorch.data import Corpus
    from meshtorch.train import check_resume, default_out, launch_run

    if cfg.model != "lm":
        raise PipelineError(f"--pipeline-stages trains --model lm; got --model {cfg.model!r}")
    check_resume(cfg, PipelineError)
    cfg = dataclasses.replace(cfg, mesh=pipeline_mesh(cfg.mesh, cfg.pipeline_stages))
    out = cfg.out or cfg.resume or default_out()
    return launch_run(program, cfg, Corpus.from_path(cfg.data), out)
