"""One training step of a meshtorch model, as an SPMD program the planner can trace.

:func:`training_step` builds the model, optimizer and a synthetic batch from a
:class:`~meshtorch.recipes.lm.config.TrainConfig` (the options of ``meshtorch train``),
then runs a steady-state step in the order of the training loop:
forward, ``zero_grad(set_to_none=True)``, backward, global-norm clipping,
``optimizer.step()``. A warm-up ``optimizer.step()`` on zero gradients first
creates the optimizer state, so that the measured step holds what every step
but the first holds: parameters, optimizer state, the previous step's
gradients during the forward pass, and the activations.

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

from collections.abc import Callable
from typing import Any

import torch

from meshtorch.comm.device import auto_device, parse_device
from meshtorch.errors import TrainingError
from meshtorch.plan import devices
from meshtorch.plan.estimate import _fmt_bytes
from meshtorch.plan.tracing import measure, staging_for, trace
from meshtorch.recipes.lm.config import TrainConfig
from meshtorch.recipes.lm.optimizer import make_optimizer
from meshtorch.recipes.lm.strategies import precision_context


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


def optimizer_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()``, also on meta parameters.

    Optimizers keep their step counter on the host and read it with
    ``float()``/``.item()``; under the meta backend the default device is meta,
    so the counter would have no value. Adafactor makes its counter lazily with
    the default device: give it a host one. torch's optimizers make theirs
    with ``torch.tensor``: let factories default to the host while they step
    (their moments follow the parameters' device, meta).
    """
    from meshtorch.optim import Adafactor

    params = [p for g in opt.param_groups for p in g["params"]]
    if not params or params[0].device.type != "meta":
        opt.step()
        return
    if isinstance(opt, Adafactor):
        for p in params:
            if p.grad is not None:
                opt.state[p].setdefault("step", torch.zeros((), dtype=torch.float32, device="cpu"))
        opt.step()
        return
    with torch.device("cpu"):
        opt.step()


def prepare(cfg: TrainConfig, vocab: int = 264) -> tuple[torch.nn.Module, torch.optim.Optimizer, tuple]:
    """``cfg``'s model, optimizer and a synthetic batch, after the warm-up: a first
    ``optimizer.step()`` on zero gradients has created the optimizer state."""
    model = build_model(cfg, vocab)
    opt = make_optimizer(cfg, model)
    batch = synthetic_batch(cfg, vocab)
    with torch.no_grad():
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    optimizer_step(opt)
    return model, opt, batch


def train_step(cfg: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> Any:
    """One steady-state step of the training loop on ``batch``; the loss MeshTensor."""
    from meshtorch import optim

    with precision_context(cfg):
        loss = model.loss(*batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.optimizer.clip:
        optim.clip_grad_norm_(model, cfg.optimizer.clip)
    optimizer_step(opt)
    return loss


class TrainingStep:
    """The SPMD program :func:`training_step` returns: picklable, so that it also runs in
    fresh processes (``mt.plan.trace(step, backend="torch")`` measures a gloo step).

    ``layers``, ``period`` and :meth:`with_layers` let the search trace shallower
    copies and extrapolate: blocks repeat with ``period`` (an MoE model alternates
    dense and expert feed-forward blocks).
    """

    def __init__(self, cfg: TrainConfig, vocab: int, update: bool = True) -> None:
        self.cfg, self.vocab, self.update = cfg, vocab, update
        self.layers = cfg.model.layers
        self.period = cfg.model.moe_every if cfg.model.name == "moe" and cfg.model.experts else 1
        if cfg.model.name != "lm":  # only the LM is pipelined by meshtorch train: no stages to price
            self.pipelined = None

    def pipelined(self, microbatches: int, schedule: str | None = None) -> Callable[[], dict[str, Any]]:
        """This step pipelined over ``microbatches`` (the search prices stages too)."""
        return pipelined_training_step(
            self.cfg.replace(microbatches=microbatches, schedule=schedule or self.cfg.parallelism.schedule),
            self.vocab)

    def with_layers(self, n: int) -> TrainingStep:
        return TrainingStep(self.cfg.replace(layers=n), self.vocab, update=self.update)

    def without_update(self) -> TrainingStep:
        """This step's forward and backward alone (no optimizer, no warm-up): a part of the
        step's work, so its cost bounds the whole step's from below (the search prunes with it)."""
        return TrainingStep(self.cfg, self.vocab, update=False)

    def __call__(self) -> dict[str, Any]:
        if not self.update:
            model, batch = build_model(self.cfg, self.vocab), synthetic_batch(self.cfg, self.vocab)
            with measure():
                with precision_context(self.cfg):
                    loss = model.loss(*batch)
                loss.backward()
            return {"parameters": model.num_parameters(), "loss": loss.local.detach()}
        model, opt, batch = prepare(self.cfg, self.vocab)
        with measure():
            loss = train_step(self.cfg, model, opt, batch)
        return {"parameters": model.num_parameters(), "loss": loss.local.detach()}


def training_step(cfg: TrainConfig, vocab: int = 264) -> TrainingStep:
    """An SPMD program: build ``cfg``'s model and run one steady-state training step.

    It returns ``{"parameters": global parameter count, "loss": the loss tensor's
    local value}``; the step itself is inside :func:`meshtorch.plan.measure`
    (the warm-up of :func:`prepare` is not).
    """
    return TrainingStep(cfg, vocab)


class _PlannableOptimizer:
    """The pipeline's optimizer, stepped with :func:`optimizer_step` (which also works on meta
    parameters): all the pipeline asks of it is ``step()``."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt = opt

    def step(self) -> None:
        optimizer_step(self.opt)


def prepare_pipelined(cfg: TrainConfig, vocab: int = 264) -> tuple[Any, tuple]:
    """``meshtorch train --pipeline-stages``'s step strategy for ``cfg`` (a
    :class:`~meshtorch.recipes.lm.strategies.PipelinedStep`, on a mesh with a ``stage`` axis) and a
    synthetic batch, after one warm-up step (optimizer state, 2BW's second weight version)."""
    from meshtorch.recipes.lm.strategies import PipelinedStep

    model = build_model(cfg, vocab)
    step = PipelinedStep(cfg, model, make_optimizer(cfg, model))
    step.resume(None, lead=False)
    step.pipe.optimizer = _PlannableOptimizer(step.opt)
    batch = synthetic_batch(cfg, vocab)
    step.run([batch], 0)
    return step, batch


def pipelined_training_step(cfg: TrainConfig, vocab: int = 264) -> Callable[[], dict[str, Any]]:
    """An SPMD program: ``meshtorch train --pipeline-stages``'s step of ``cfg`` on a synthetic batch.

    It runs on a mesh with a ``stage`` axis (the stages; see
    :func:`meshtorch.recipes.lm.strategies.pipeline_mesh`) and is the trainer's own
    :class:`~meshtorch.recipes.lm.strategies.PipelinedStep`: ``--schedule``,
    ``--microbatches``, clipping over all stages, every processor holding the whole model (and under
    2BW its previous version) for the checkpoint. After the warm-up of :func:`prepare_pipelined`,
    one step runs inside :func:`meshtorch.plan.measure`. It returns ``{"parameters": global count,
    "comm": that step's collectives as this processor's communicator counts them}``.
    :func:`meshtorch.plan.pipeline.estimate_pipeline` traces it once per stage.

    Example:
        >>> from meshtorch.plan.pipeline import stage_traces
        >>> cfg = TrainConfig.of(d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, batch=4, length=8,
        ...                      microbatches=2, schedule="gpipe")
        >>> first, last = stage_traces(pipelined_training_step(cfg, vocab=16), "stage:2", "")
        >>> first.comm.calls("stage", "send"), last.comm.calls("stage", "recv")  # header + activation
        (4, 4)
    """
    from meshtorch.context import comm_stats

    par = cfg.parallelism

    def program() -> dict[str, Any]:
        step, batch = prepare_pipelined(cfg, vocab)
        with measure():
            before = comm_stats().copy()
            step.run([batch], 1)
            counted = comm_stats() - before
        return {"parameters": step.model.num_parameters(), "comm": counted.as_dict()}

    program.pipeline = {"axis": "stage", "schedule": par.schedule, "microbatches": par.microbatches,
                        "recompute": False}
    program.layers = cfg.model.layers
    return program


def check_memory(cfg: TrainConfig, vocab: int, processes: int) -> dict[str, int] | None:
    """Raise :class:`TrainingError` if ``processes`` processors of ``cfg``'s step on this machine
    need more memory than it has available, as the planner predicts; return the prediction
    (per processor, by kind, and ``total``), or ``None`` where nothing is checked.

    On the host the processors share its memory; on GPUs (``--device cuda``, or ``auto`` with a
    GPU per processor) each processor's peak must fit its GPU's free memory
    (:func:`meshtorch.plan.devices.gpu_free_memory`). Nothing is checked without a known limit
    (:func:`meshtorch.plan.devices.available_memory`),
    with ``--no-memory-check``, or for a pipelined run (its stages hold parts of the model, which
    the plain step's trace does not model).

    Example:
        >>> from meshtorch.recipes.lm import TrainConfig
        >>> from meshtorch.recipes.lm.steps import check_memory
        >>> cfg = TrainConfig.of(d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, batch=4, length=8)
        >>> check_memory(cfg, vocab=16, processes=2)["parameters"] >= 4 * 752
        True
    """
    if not cfg.run.memory_check or cfg.parallelism.pipeline_stages > 1:
        return None
    par = cfg.parallelism
    kind, _ = parse_device(par.device)
    on_gpu = (auto_device(processes) if kind == "auto" else kind) == "cuda"
    # on GPUs each processor has one of its own; on the host they share its memory
    limit = devices.gpu_free_memory(processes) if on_gpu else devices.available_memory()
    if limit is None:
        return None
    have, source = limit
    sharing = 1 if on_gpu else processes
    t = trace(training_step(cfg, vocab), mesh=par.parsed.mesh, rules=par.parsed.rules,
              staging=staging_for(par.backend, "cuda" if on_gpu else "cpu"))
    need = {**t.peak_by_kind, "total": t.peak_bytes}
    if t.peak_bytes * sharing > have:
        kinds = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in t.peak_by_kind.items())
        where = "one processor per GPU" if on_gpu else f"{processes} processor(s) on this machine"
        raise TrainingError(
            f"this step needs about {_fmt_bytes(t.peak_bytes * sharing)} ({where} x "
            f"{_fmt_bytes(t.peak_bytes)}: {kinds}, as meshtorch plan predicts) but only "
            f"{_fmt_bytes(have)} is available ({source}); lower --batch or --length, split more dims "
            "over the mesh (--rules), use --precision bf16, or free memory (--no-memory-check skips "
            "this check)")
    return need
