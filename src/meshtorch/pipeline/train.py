"""``meshtorch train --pipeline-stages N``: the LM trained as a pipeline along a ``stage`` axis.

:func:`train_pipeline` is what :func:`meshtorch.train.train` runs when
``pipeline_stages > 1``. The mesh gets a ``stage:N`` axis in front unless it
has one (so ``--mesh b:2 --pipeline-stages 2`` runs on ``stage:2,b:2``, four
processors); the layout rules are the usual ones and never mention it.
``--schedule gpipe|1f1b|2bw`` picks the pipeline schedule (``--lr-schedule``
the learning rate's), ``--microbatches`` the micro-batches per batch.
Gradient clipping uses the norm over all stages (the tied embedding table
counted once). Processor 0 writes ``metrics.jsonl`` and ``summary.json``;
checkpoints and the generated sample of the unsplit run are not produced.

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


def program(cfg, corpus, out: str) -> dict[str, Any]:
    """One processor's part of a pipeline training run."""
    from meshtorch.data import ByteTokenizer, LMBatches
    from meshtorch.pipeline.lm import lm_pipeline
    from meshtorch.train import lr_at, make_optimizer

    lead = current().rank == 0
    tok = ByteTokenizer()
    mcfg = cfg.model_config(tok.vocab_size)
    pipe = lm_pipeline(mcfg, seed=cfg.seed, axis=AXIS, microbatches=cfg.microbatches,
                       schedule=cfg.schedule)
    pipe.optimizer = make_optimizer(cfg, pipe.module)
    if cfg.clip:
        sync = pipe.after_backward

        def after_backward():
            sync()
            _clip(pipe, cfg.clip)

        pipe.after_backward = after_backward
    train = LMBatches(corpus.train, cfg.batch, cfg.length, seed=cfg.seed)
    heldout = LMBatches(corpus.heldout, cfg.batch, cfg.length, seed=12345)
    metrics: list[dict] = []
    if lead:
        os.makedirs(out, exist_ok=True)
        print(f"pipeline of {pipe.num_stages} stages ({pipe.schedule.name}, {cfg.microbatches} "
              f"micro-batches) on mesh '{current().mesh}' rules '{cfg.rules}'; {cfg.steps} steps of "
              f"{cfg.batch}x{cfg.length} tokens")
    t0, loss = time.perf_counter(), float("nan")
    window = time.perf_counter()
    for step in range(cfg.steps):
        for g in pipe.optimizer.param_groups:
            g["lr"] = lr_at(cfg, step)
        loss = pipe.step(*train.next())
        done = step + 1
        if lead and (done % cfg.log_every == 0 or done == cfg.steps):
            dt = (time.perf_counter() - window) / (done - (metrics[-1]["step"] if metrics else 0))
            window = time.perf_counter()
            metrics.append({"step": done, "loss": round(loss, 5), "step_time_s": round(dt, 4),
                            "tokens_per_s": round(cfg.batch * cfg.length / dt, 1)})
            print(f"step {done}: loss {loss:.3f}, {dt * 1e3:.0f} ms/step", flush=True)
    wall = time.perf_counter() - t0
    held = sum(pipe.loss(*heldout.at(i)) for i in range(cfg.eval_batches)) / cfg.eval_batches
    result = {"steps": cfg.steps, "final_loss": loss, "heldout_loss": held, "out": out,
              "unigram_entropy": corpus.unigram_entropy("heldout"), "schedule": pipe.schedule.name,
              "pipeline_stages": pipe.num_stages, "microbatches": cfg.microbatches, "train_s": round(wall, 2)}
    if lead:
        from meshtorch.train import plot_losses

        result["loss_png"] = plot_losses(os.path.join(out, "loss.png"), metrics, [(cfg.steps, held)],
                                         result["unigram_entropy"])
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in metrics)
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(f"held-out loss {held:.3f} nats/byte vs byte-unigram entropy {result['unigram_entropy']:.3f}")
    return result


def train_pipeline(cfg) -> dict[str, Any]:
    """Run :func:`program` on every processor of the pipeline mesh; return processor 0's summary."""
    import dataclasses

    from meshtorch.data import Corpus
    from meshtorch.launch import launch
    from meshtorch.train import default_out

    if cfg.model != "lm":
        raise PipelineError(f"--pipeline-stages trains --model lm; got --model {cfg.model!r}")
    if cfg.resume:
        raise PipelineError("--resume is not supported with --pipeline-stages (pipeline runs write no "
                            "checkpoint)")
    cfg = dataclasses.replace(cfg, mesh=pipeline_mesh(cfg.mesh, cfg.pipeline_stages))
    out = cfg.out or default_out()
    corpus = Corpus.from_path(cfg.data)
    kwargs: dict[str, Any] = {"mesh": cfg.mesh, "rules": cfg.rules}
    if cfg.backend != "threads":
        kwargs["backend"] = cfg.backend
    t0 = time.time()
    threads = torch.get_num_threads()
    result = launch(program, cfg, corpus, out, **kwargs)[0]
    torch.set_num_threads(threads)
    result["wall_s"] = round(time.time() - t0, 1)
    return result
