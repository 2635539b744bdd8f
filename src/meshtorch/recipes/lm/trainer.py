"""``meshtorch train``: one training loop; a plain step or a pipelined step are its two strategies.

:func:`train` runs one SPMD program per processor (``mt.launch``): build the
model from the seed, read this processor's part of each batch, step the
optimizer, log, evaluate held-out loss against the byte-unigram entropy,
checkpoint, and print a generated sample. Processor 0 writes ``--out``:
``checkpoint/``, ``metrics.jsonl`` (a record per ``--log-every`` steps, as
they happen), ``summary.json`` and ``loss.png`` (when matplotlib is installed).

The loop runs the steps between two log (or checkpoint) steps as one window.
:class:`PlainStep` steps them one by one; with ``--pipeline-stages N``
:class:`PipelinedStep` runs the window as one pipeline table along a ``stage``
mesh axis (so PipeDream-2BW does not flush inside it). Both get
``--precision bf16`` autocast, the same metrics and the utilisation figure.

Example:
    >>> from meshtorch.recipes.lm import TrainConfig, train
    >>> try:
    ...     train(TrainConfig.of(model="moe", pipeline_stages=2))
    ... except Exception as e:
    ...     print(e)
    --pipeline-stages trains --model lm; got --model 'moe'
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import time
from typing import Any

import torch

from meshtorch.context import current, processor_device
from meshtorch.data import Corpus, LMBatches
from meshtorch.data.tokenizer import Tokenizer
from meshtorch.errors import MeshTorchError, PipelineError
from meshtorch.files import write_atomic
from meshtorch.launcher.elastic import restart_count
from meshtorch.models import DecoderLM
from meshtorch.recipes.lm.config import TrainConfig, check_config, check_layout
from meshtorch.recipes.lm.fit import check_memory, check_model_size
from meshtorch.recipes.lm.guards import RunDirLock, check_loss
from meshtorch.recipes.lm.nodes import agree_on_options, check_shared_out
from meshtorch.recipes.lm.optimizer import lr_at, make_optimizer
from meshtorch.recipes.lm.plan_cli import choose_rules, describe_choice
from meshtorch.recipes.lm.pretrained import (
    model_vocab,
    planned_vocab,
    pretrained_model,
    resolve_tokenizer_once,
    tokenizer_of,
    with_pretrained_model,
)
from meshtorch.recipes.lm.report import (
    Progress,
    matmul_peak_flops,
    plot_losses,
    report,
    step_flops,
)
from meshtorch.recipes.lm.restarts import (
    continued,
    launcher_holds,
    maybe_crash,
    restart_record,
    train_restarting,
    worker_failed,
)
from meshtorch.recipes.lm.run_files import check_resume, json_text, save_run, start_metrics
from meshtorch.recipes.lm.strategies import strategy_for
from meshtorch.recipes.lm.telemetry import MetricsBoard, throughput


def build_task(cfg: TrainConfig, corpus: Corpus | None,
               tok: Tokenizer) -> tuple[torch.nn.Module, Any, Any]:
    """Model, train batches and held-out batches for ``cfg.model`` (on this processor)."""
    mcfg = cfg.model_config(model_vocab(cfg, tok))
    run = cfg.run
    if cfg.model.name == "seq2seq":
        from meshtorch.data.seq2seq import SpellingTask
        from meshtorch.models.seq2seq import EncoderDecoder

        task = SpellingTask(batch=run.batch, seed=run.seed)
        mcfg = dataclasses.replace(mcfg, max_length=max(task.max_target, task.max_source))
        return EncoderDecoder(mcfg, seed=run.seed, pad=task.tok.pad), task, task.heldout(run.eval_batches)
    if run.init_from:
        model = pretrained_model(cfg, mcfg)
    else:
        model = DecoderLM(mcfg, seed=run.seed)
    train = LMBatches(corpus.train, run.batch, run.length, seed=run.seed)
    heldout = LMBatches(corpus.heldout, run.batch, run.length, seed=12345)
    return model, train, heldout


def default_out() -> str:
    return os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def program(cfg: TrainConfig, corpus: Corpus | None, out: str,
            chosen: dict[str, Any] | None = None) -> dict[str, Any]:
    """One processor's part of a training run; processor 0 reports and writes files. ``chosen``: what
    ``--rules auto``'s search picked and why (:func:`~meshtorch.recipes.lm.plan_cli.choose_rules`),
    for summary.json."""
    lead = current().rank == 0
    run = cfg.run
    tok = tokenizer_of(cfg)
    if corpus is None and cfg.model.name != "seq2seq":
        # each process of the torch backend reads its own copy
        corpus = Corpus.from_path(run.data, tokenizer=tok)
    model, batches, heldout = build_task(cfg, corpus, tok)
    opt = make_optimizer(cfg, model)
    strategy = strategy_for(cfg, model, opt)
    start = strategy.resume(batches, lead)
    params = model.num_parameters()
    # the yardstick: every processor's matmul rate measured at once, under the same contention
    comm = current().comm
    # on a GPU the yardstick is its matmul in the run's precision (its tensor cores)
    gpu_bf16 = run.precision == "bf16" and processor_device().type == "cuda"
    mine = matmul_peak_flops(torch.bfloat16 if gpu_bf16 else torch.float32)
    peak = comm.all_reduce(torch.tensor([mine], dtype=torch.float64), comm.mesh.axis_names, "sum").item()
    tokens = run.batch * run.length
    flops = step_flops(model.cfg, tokens, run.length, params)
    metrics_path = os.path.join(out, "metrics.jsonl")
    metrics: list[dict] = []
    restarted = restart_record(start)
    if lead:
        metrics = start_metrics(cfg, out, start)
        if restarted:
            metrics.append(restarted)
            with open(metrics_path, "a") as f:
                f.write(json_text(restarted, metrics_path) + "\n")
        print(f"{strategy.banner()} on {processor_device()}; {run.steps} steps of "
              f"{run.batch}x{run.length} tokens")
    board = MetricsBoard(out, lead and run.tensorboard)
    bar = Progress(run.steps, start, lead and run.progress)
    t0, loss, step = time.perf_counter(), None, start
    # what a non-finite loss leaves behind, for its error
    resumed_here = run.resume and os.path.realpath(run.resume) == os.path.realpath(out)
    saved_at = f"{out} holds the checkpoint of step {start}" if resumed_here else "no checkpoint was written"
    while step < run.steps:
        stops = [run.steps, (step // run.log_every + 1) * run.log_every]
        if run.checkpoint_every:
            stops.append((step // run.checkpoint_every + 1) * run.checkpoint_every)
        n = min(stops) - step
        window = time.perf_counter()
        loss = strategy.run([batches.next() for _ in range(n)], step)
        check_loss(loss, step, step + n, saved_at)  # the loss is on the host already: no extra sync
        step += n
        dt = (time.perf_counter() - window) / n
        if step % run.log_every == 0 or step == run.steps:
            rec = {"step": step, "loss": round(loss, 5), "tokens_per_s": round(tokens / dt, 1),
                   "step_time_s": round(dt, 4), "lr": lr_at(cfg, step - 1),
                   "flop_utilisation": round(flops / dt / peak, 4) if peak else None}
            if lead:
                metrics.append(rec)
                with open(metrics_path, "a") as f:
                    f.write(json_text(rec, metrics_path) + "\n")
            bar.update(step, {"loss": f"{loss:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}",
                              "step": f"{dt * 1e3:.0f}ms", "util": f"{100 * flops / dt / peak:.1f}%"})
            board.write(rec)
        if run.checkpoint_every and step % run.checkpoint_every == 0 and step != run.steps:
            save_run(cfg, out, model, opt, batches, step, saved=strategy.saved(),
                     background=run.async_checkpoint)
            saved_at = f"{out} holds the checkpoint of step {step}"
        maybe_crash(step, current().rank)
    bar.close()
    wall = time.perf_counter() - t0
    if step > start or os.path.realpath(out) != os.path.realpath(run.resume or ""):
        # the step the run is at: a resumed run never relabels what it holds
        save_run(cfg, out, model, opt, batches, step, saved=strategy.saved())
    result = {"steps": step, "final_loss": loss, "parameters": params, "out": out,
              "device": str(processor_device()), "mesh": str(cfg.parallelism.parsed.mesh),
              "rules": str(cfg.parallelism.parsed.rules),
              "train_s": round(wall, 2), "checkpoint": os.path.join(out, "checkpoint"), **strategy.summary()}
    logged = [m for m in metrics if "loss" in m]
    if logged and logged[-1]["step"] == run.steps:
        result["flop_utilisation"] = logged[-1]["flop_utilisation"]
    if cfg.parallelism.max_restarts or restarted:
        result["restarts"] = restarted["restart"] if restarted else 0
        result["restarted_at_steps"] = [m["step"] for m in metrics if m.get("event") == "restart"]
    if chosen is not None:
        result["rules_auto"] = chosen
    result.update(throughput(tokens * (step - start), flops * (step - start), wall, peak))
    result.update(report(cfg, model, heldout, corpus, tok, lead))
    board.close(result)
    if lead:
        hl = [(step, result["heldout_loss"])]
        result["loss_png"] = plot_losses(os.path.join(out, "loss.png"), logged, hl,
                                         result.get("unigram_entropy", float("nan")),
                                         "byte" if cfg.run.tokenizer == "bytes" else "token")
        # a rerun's summary replaces the last one whole: a summary that cannot be written keeps it
        write_atomic(os.path.join(out, "summary.json"),
                     json_text(result, os.path.join(out, "summary.json"), indent=1).encode())
    return result


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Check ``cfg``, fit or load the tokenizer, load the corpus, run the program on every processor;
    return processor 0's summary (``final_loss``, ``heldout_loss``, ``unigram_entropy``, ``sample``,
    ``out``, ...)."""
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    given = cfg
    cfg = with_pretrained_model(cfg)
    # a tokenizer fitted to the data is known only once fitted (in --out): check with its largest size
    planned = planned_vocab(cfg)
    # a model too large for this machine's memory fails now, before any search, trace or build runs away
    processors = cfg.parallelism.processors or world or 1
    check_model_size(cfg, planned, processors,
                     int(os.environ.get("LOCAL_WORLD_SIZE", world or processors)))
    # --rules auto: the planner's search picks the rules now, before anything reads them (on the
    # hardware of this machine's processors); every process of a torchrun world runs the same
    # deterministic search (checked below once joined)
    cfg, chosen = choose_rules(cfg, planned, int(os.environ.get("LOCAL_WORLD_SIZE", world or
                                                                 cfg.parallelism.processors or 1)))
    par, run = cfg.parallelism, cfg.run
    # the mesh (with the stage axis when pipelined) and the rules, parsed once when cfg was built:
    # everything below takes these objects
    layout = par.parsed
    error: type[MeshTorchError] = MeshTorchError
    if par.pipeline_stages > 1:
        if cfg.model.name != "lm":
            raise PipelineError(f"--pipeline-stages trains --model lm; got --model {cfg.model.name!r}")
        error = PipelineError
    check_config(cfg, vocab=planned, world=world)
    if run.resume:
        check_resume(cfg, error)
    out = run.out or run.resume or default_out()
    # every processor of this machine holds its slices: all of them under threads or a spawn
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world or layout.mesh.size))
    check_memory(cfg, planned, here)
    if (par.max_restarts or par.nnodes > 1) and world is None:
        # this process runs torchrun's elastic agent, whose workers (this node's part of the mesh) run the
        # checks above again, join the world and train; on node 0 it holds --out for all of their starts
        return train_restarting(given, out, layout.mesh.size // par.nnodes)
    # under torchrun every process runs this; processor 0 alone writes --out, so it alone holds it
    if par.backend == "torch" and (world or 1) > 1:
        # join the world now (the launch below reuses it): processor 0 fits the tokenizer, the others wait
        from meshtorch.launcher import init_distributed

        init_distributed(layout.mesh, layout.rules, timeout=par.timeout, device=par.device)
        # every node must run the same run: a flag given otherwise on one node is named now
        agree_on_options(given.options())
        if chosen is not None:
            # a pipeline split the search picked is part of the layout (its stage axis is in the mesh)
            split = (f" --schedule {par.schedule} --microbatches {par.microbatches} --virtual-stages "
                     f"{par.virtual_stages}" if par.pipeline_stages > 1 else "")
            agree_on_rules(f"--mesh {layout.mesh} --rules '{layout.rules}'{split}")
    # processor 0 of the world joined above holds --out; the threads backend's process always does
    # (a stray RANK variable never skips the lock and the earlier-run check)
    lead = par.backend != "torch" or (world or 1) == 1 or torch.distributed.get_rank() == 0
    # (a worker of --max-restarts finds --out held for it by the launcher that started it)
    lock = RunDirLock(cfg, out) if lead and not launcher_holds(out) else contextlib.nullcontext()
    if chosen is not None and lead:
        print(describe_choice(chosen))
    with lock:
        if par.backend == "torch" and (world or 1) > 1:
            # processors on other nodes write their slices of the checkpoint in --out (and read the
            # tokenizer processor 0 fits there): it must be the same directory for all of them
            check_shared_out(out)
        cfg = resolve_tokenizer_once(cfg, out)
        tok = tokenizer_of(cfg)
        vocab = model_vocab(cfg, tok)
        if vocab != planned:  # the fitted tokenizer's size: only the layout's vocab split depends on it
            check_layout(cfg, vocab)
        # threads share one corpus in memory; torch-backend processes each read it themselves
        corpus = (None if cfg.model.name == "seq2seq" or par.backend != "threads"
                  else Corpus.from_path(run.data, tokenizer=tok))
        kwargs: dict[str, Any] = {"mesh": layout.mesh, "rules": layout.rules, "timeout": par.timeout,
                                  "device": par.device}
        if par.backend != "threads":
            kwargs["backend"] = par.backend
        result = _run(cfg, corpus, out, kwargs, chosen)
    return result


def restarting_worker() -> None:
    """One worker process of ``meshtorch train --max-restarts`` (:mod:`meshtorch.recipes.lm.restarts`):
    ``python -c`` runs it with the run's options (JSON) as its argument; a restarted start continues
    from ``--out``."""
    import json
    import sys

    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from meshtorch.launcher.lifeline import die_with_launcher

    die_with_launcher()
    cfg = TrainConfig.of(**json.loads(sys.argv[1]))
    if restart_count():
        cfg = continued(cfg, cfg.run.out)
    errors = get_error_handler()
    errors.initialize()
    try:
        train(cfg)
    except Exception as e:
        errors.record_exception(e)  # its message (and traceback) reach the launcher through torchrun's file
        print(worker_failed(e, cfg), file=sys.stderr, flush=True)
        sys.exit(1)


def agree_on_rules(rules: str) -> None:
    """Raise on every process of the torch world unless all of them picked the same ``rules`` (and mesh)
    (``--rules auto``: each process searched on its own; a different hardware spec, e.g. a CPU
    calibration measured by each process under load, could make them differ)."""
    picks: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(picks, rules)
    if len(set(picks)) > 1:
        raise MeshTorchError(f"--rules auto picked different rules on different processes ({picks}, by "
                             "rank); store one CPU calibration first (meshtorch plan --calibrate) or pass"
                             " the rules of processor 0 with --rules")


def _run(cfg: TrainConfig, corpus: Corpus | None, out: str, kwargs: dict[str, Any],
         chosen: dict[str, Any] | None = None) -> dict[str, Any]:
    from meshtorch.launcher import launch

    t0 = time.time()
    threads = torch.get_num_threads()
    result = launch(program, cfg, corpus, out, chosen, **kwargs)[0]
    torch.set_num_threads(threads)
    result["wall_s"] = round(time.time() - t0, 1)
    return result
