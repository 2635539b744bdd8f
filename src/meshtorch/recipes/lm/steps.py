"""``meshtorch train``'s step as a program the planner traces, prices and searches.

:func:`training_step` (and :func:`pipelined_training_step`) is a
:class:`TrainingProgram`: it builds the model, optimizer and a synthetic batch
from a :class:`~meshtorch.recipes.lm.config.TrainConfig` (the options of
``meshtorch train``), the trainer's own strategy around them
(:func:`~meshtorch.recipes.lm.strategies.strategy_for`), warms up, and runs the
strategy's ``run`` (what the training loop calls: learning-rate schedule,
``zero_grad(set_to_none=True)``, forward, backward, global-norm clipping,
``optimizer.step()``) on one batch inside :func:`meshtorch.plan.measure`. The
warm-up leaves what every step but the first holds: parameters, optimizer state,
the previous step's gradients until the step's ``zero_grad`` frees them, before
its forward (as in a plain PyTorch loop). There is no second step
function: the step planned is the step that trains
(``tests/test_plan_program.py`` checks their ops and collectives are the same).

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.recipes.lm import TrainConfig
    >>> from meshtorch.recipes.lm.steps import training_step
    >>> cfg = TrainConfig.of(d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, batch=4, length=8)
    >>> out = mt.plan.trace(training_step(cfg, vocab=16), mesh="b:2", rules="batch:b").result
    >>> out["parameters"]   # embedding, positions, attention, feed-forward, 3 layer norms
    752
    >>> 16 * 8 + 8 * 8 + 4 * 8 * 2 * 4 + 2 * 8 * 16 + 3 * 2 * 8
    752
"""

from __future__ import annotations

from typing import Any

import torch

from meshtorch.plan.program import Pipelining, SpaceDims, measured_run
from meshtorch.plan.tracing import measure
from meshtorch.recipes.lm.config import TrainConfig, check_model_flags
from meshtorch.recipes.lm.optimizer import make_optimizer, optimizer_step
from meshtorch.recipes.lm.strategies import TrainStep, overlaps, pipelining, precision_context, strategy_for


def build_model(cfg: TrainConfig, vocab: int) -> torch.nn.Module:
    """The model of ``cfg`` (``lm``, ``seq2seq`` or ``moe``) with ``vocab`` token ids."""
    from meshtorch.models import DecoderLM
    from meshtorch.models.seq2seq import EncoderDecoder

    mcfg, seed = cfg.model_config(vocab), cfg.run.seed
    return EncoderDecoder(mcfg, seed=seed) if cfg.model.name == "seq2seq" else DecoderLM(mcfg, seed=seed)


def synthetic_batch(cfg: TrainConfig, vocab: int) -> tuple:
    """Random token ids shaped like a real batch of ``cfg`` (values do not change the plan)."""
    from meshtorch import random
    from meshtorch.ops.elementwise import cast

    def ids(seed: int):
        u = random.uniform(f"batch:{cfg.run.batch},length:{cfg.run.length}", 0, vocab, seed=seed)
        return cast(u * 0.999, torch.int64)

    if cfg.model.name == "seq2seq":
        return ids(1), ids(2), ids(3)
    return ids(1), ids(2)


def prepare(cfg: TrainConfig, vocab: int = 264, pipelined: bool = False) -> tuple[TrainStep, tuple]:
    """The trainer's step strategy for ``cfg`` (:func:`~meshtorch.recipes.lm.strategies.strategy_for`:
    a :class:`~meshtorch.recipes.lm.strategies.PipelinedStep` on a mesh with a ``stage`` axis when
    ``pipelined``, else a :class:`~meshtorch.recipes.lm.strategies.PlainStep`) and a synthetic
    batch, after the warm-up that leaves what every step but the first holds: the plain step's
    optimizer state, made by an ``optimizer.step()`` on zero gradients (no step's work, so that a
    trace stays cheap); a plain step that overlaps (``--overlap``) and the pipelined step run one
    whole step (the plan of grouped gathers that :func:`meshtorch.overlap` takes from the step
    before; 2BW's second weight version). A synthetic step resumes nothing (``--resume`` is dropped)."""
    cfg = cfg.replace(resume=None)
    model = build_model(cfg, vocab)
    step = strategy_for(cfg, model, make_optimizer(cfg, model), pipelined=pipelined)
    step.resume(None, lead=False)
    batch = synthetic_batch(cfg, vocab)
    if step.pipeline is None and overlaps(cfg):
        # the run's first step: mt.overlap groups a step's gathers as the step before read them
        step.run([batch], 0)
    elif step.pipeline is None:
        with torch.no_grad():
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        optimizer_step(step.opt)
    else:
        step.run([batch], 0)
    return step, batch


# the dims of meshtorch's LM, seq2seq and MoE models that the search's layouts split, by role
LM_DIMS = SpaceDims(batch="batch", model=("heads", "d_ff", "vocab"), experts="experts", hidden="d_model",
                    sequence="length")


class TrainingProgram:
    """``meshtorch train``'s step of ``cfg`` on a synthetic batch, as the planner traces it: a
    :class:`meshtorch.plan.program.Program`.

    Calling it builds the model and the trainer's own strategy (:func:`prepare`), warms up,
    and runs the strategy's ``run`` on one batch inside :func:`meshtorch.plan.measure`
    (:func:`meshtorch.plan.program.measured_run`), returning ``{"parameters": global count,
    "comm": that step's collectives as this processor counts them}``. It is picklable, so
    that it also runs in fresh processes (``mt.plan.trace(program, backend="torch")``
    measures a gloo step).

    With ``--compile`` the strategy's step is traced eagerly (the same ops and collectives).

    ``layers``, ``period`` and :meth:`with_layers` let the search trace shallower copies and
    extrapolate: blocks repeat with ``period`` (an MoE model alternates dense and expert
    feed-forward blocks). A pipelined program (:meth:`pipelined`; ``meshtorch train
    --pipeline-stages``) runs on a mesh with a ``stage`` axis (see
    :func:`~meshtorch.recipes.lm.strategies.pipeline_mesh`); :mod:`meshtorch.plan.pipeline` traces it
    once per stage.
    """

    def __init__(self, cfg: TrainConfig, vocab: int, *, update: bool = True, pipelined: bool = False,
                 probe: bool = False) -> None:
        # the model flags meshtorch train refuses (an MoE without an expert layer was planned as a
        # dense LM, its search's space without experts)
        check_model_flags(cfg)
        # --compile runs the same ops and collectives (a meta trace of the compiled step counts the
        # eager one's, and compiling it on meta costs ~15 s even for a tiny model): trace it eagerly
        # a compiled run does not overlap (strategies.overlapped): neither does its eager trace
        if cfg.run.compile:
            par = cfg.parallelism
            eager = {k: False for k in ("overlap", "reshard_after_forward") if getattr(par, k)}
            cfg = cfg.replace(compile=False, **eager)  # (a run that does not compile keeps its parsed cfg)
        self.cfg, self.vocab, self.update = cfg, vocab, update
        self.probe = probe  # one micro-batch's forwards and backwards only (one_microbatch)
        self.layers = cfg.model.layers
        self.period = cfg.model.moe_every if cfg.model.name == "moe" and cfg.model.experts else 1
        self.pipeline: Pipelining | None = pipelining(cfg) if pipelined else None
        self.dims = LM_DIMS

    def with_layers(self, n: int) -> TrainingProgram:
        return TrainingProgram(self.cfg.replace(layers=n), self.vocab, update=self.update,
                               pipelined=self.pipeline is not None)

    def without_update(self) -> TrainingProgram | None:
        """This step's forward and backward alone (no optimizer, no warm-up): a part of the
        step's work, so its cost bounds the whole step's from below (the search prunes with it).
        None for a step that overlaps (``--overlap``): without the step before it, its gathers
        would not be grouped, and it could cost more than the whole step."""
        if self.pipeline is not None or overlaps(self.cfg):
            return None
        return TrainingProgram(self.cfg, self.vocab, update=False)

    def one_microbatch(self) -> TrainingProgram | None:
        """One micro-batch of this pipelined step: the same stages, rules and schedule on a batch of
        ``batch / microbatches`` sequences in one micro-batch, whose measured block runs only the
        forwards and backwards (:meth:`meshtorch.pipeline.Pipeline.microbatches_only`; no warm-up, no
        update, no loss reduction). The step runs each of its ops and collectives once per
        micro-batch on tensors of the same shapes, so each stage's work is at least
        ``microbatches`` times this one's (:func:`meshtorch.plan.pipeline.microbatch_work`: the
        search prunes pipelined candidates with it, for a fraction of a stage trace). None for an
        SPMD step, and under virtual stages (their schedule needs a round of micro-batches)."""
        how = self.pipeline
        if how is None or how.virtual_stages > 1 or self.cfg.run.batch % how.microbatches:
            return None
        cfg = self.cfg.replace(batch=self.cfg.run.batch // how.microbatches, microbatches=1)
        return TrainingProgram(cfg, self.vocab, pipelined=True, probe=True)

    def resharded(self) -> TrainingProgram | None:
        """This step with ``--reshard-after-forward`` (less memory, more bytes), or None where that
        changes nothing (it does not overlap, or reshards already): what a search tries where a
        layout does not fit."""
        par = self.cfg.parallelism
        if self.pipeline is not None or not overlaps(self.cfg) or par.reshard_after_forward:
            return None
        return TrainingProgram(self.cfg.replace(reshard_after_forward=True), self.vocab, update=self.update)

    def pipelined(self, microbatches: int, schedule: str | None = None) -> TrainingProgram | None:
        """This step pipelined over ``microbatches`` (``schedule``: this config's unless given);
        None for the models ``meshtorch train`` does not pipeline (all but ``lm``)."""
        if self.cfg.model.name != "lm":
            return None
        cfg = self.cfg.replace(microbatches=microbatches, schedule=schedule or self.cfg.parallelism.schedule)
        return TrainingProgram(cfg, self.vocab, pipelined=True)

    def __call__(self) -> dict[str, Any]:
        if self.probe:
            model = build_model(self.cfg, self.vocab)
            step = strategy_for(self.cfg, model, make_optimizer(self.cfg, model), pipelined=True)
            step.resume(None, lead=False)
            inputs, targets = synthetic_batch(self.cfg, self.vocab)
            with measure():
                with precision_context(self.cfg):
                    step.pipe.microbatches_only(inputs, targets)
            return {"parameters": model.num_parameters()}
        if not self.update:
            model, batch = build_model(self.cfg, self.vocab), synthetic_batch(self.cfg, self.vocab)
            with measure():
                with precision_context(self.cfg):
                    loss = model.loss(*batch)
                loss.backward()
            return {"parameters": model.num_parameters()}
        step, batch = prepare(self.cfg, self.vocab, pipelined=self.pipeline is not None)
        return measured_run(step, batch)


def training_step(cfg: TrainConfig, vocab: int = 264) -> TrainingProgram:
    """``meshtorch train``'s step of ``cfg`` as a program the planner traces (:class:`TrainingProgram`)."""
    return TrainingProgram(cfg, vocab)


def pipelined_training_step(cfg: TrainConfig, vocab: int = 264) -> TrainingProgram:
    """``meshtorch train --pipeline-stages``'s step of ``cfg`` (``--schedule``, ``--microbatches``,
    clipping over all stages, every processor holding the whole model, and under 2BW its previous
    version, for the checkpoint) as a program the planner traces stage by stage.

    Example:
        >>> from meshtorch.plan.pipeline import stage_traces
        >>> cfg = TrainConfig.of(d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, batch=4, length=8,
        ...                      microbatches=2, schedule="gpipe")
        >>> first, last = stage_traces(pipelined_training_step(cfg, vocab=16), "stage:2", "")
        >>> first.comm.calls("stage", "send"), last.comm.calls("stage", "recv")  # header + activation
        (4, 4)
    """
    return TrainingProgram(cfg, vocab, pipelined=True)
