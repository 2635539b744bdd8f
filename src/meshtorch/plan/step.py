"""One training step of a meshtorch model, as an SPMD program the planner can trace.

:func:`training_step` builds the model, optimizer and a synthetic batch from a
:class:`~meshtorch.train.TrainConfig` (the options of ``meshtorch train``),
then runs a steady-state step in the order of :func:`meshtorch.train.program`:
forward, ``zero_grad(set_to_none=True)``, backward, global-norm clipping,
``optimizer.step()``. A warm-up ``optimizer.step()`` on zero gradients first
creates the optimizer state, so that the measured step holds what every step
but the first holds: parameters, optimizer state, the previous step's
gradients during the forward pass, and the activations.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.plan.step import training_step
    >>> from meshtorch.train import TrainConfig
    >>> cfg = TrainConfig(d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, batch=4, length=8)
    >>> out = mt.plan.trace(training_step(cfg, vocab=16), mesh="b:2", rules="batch:b").result
    >>> out["parameters"]   # embedding, positions, attention, feed-forward, 3 layer norms
    752
    >>> 16 * 8 + 8 * 8 + 4 * 8 * 2 * 4 + 2 * 8 * 16 + 3 * 2 * 8
    752
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from meshtorch.plan.tracing import measure
from meshtorch.train import TrainConfig, make_optimizer


def model_dims(cfg: TrainConfig, vocab: int) -> dict[str, int]:
    """Every dim name the model of ``cfg`` uses, with its size (what rules may split)."""
    dims = {"batch": cfg.batch, "length": cfg.length, "d_model": cfg.d_model, "heads": cfg.heads,
            "d_kv": cfg.d_kv, "d_ff": cfg.d_ff, "vocab": vocab}
    if cfg.model == "moe":
        dims["experts"] = cfg.experts
    if cfg.model == "seq2seq":
        dims["memory_length"] = cfg.length
    return dims


def build_model(cfg: TrainConfig, vocab: int) -> torch.nn.Module:
    """The model of ``cfg`` (``lm``, ``seq2seq`` or ``moe``) with ``vocab`` token ids."""
    from meshtorch.models import DecoderLM
    from meshtorch.models.seq2seq import EncoderDecoder

    mcfg = cfg.model_config(vocab)
    return EncoderDecoder(mcfg, seed=cfg.seed) if cfg.model == "seq2seq" else DecoderLM(mcfg, seed=cfg.seed)


def synthetic_batch(cfg: TrainConfig, vocab: int) -> tuple:
    """Random token ids shaped like a real batch of ``cfg`` (values do not change the plan)."""
    from meshtorch import random
    from meshtorch.ops.elementwise import cast

    def ids(seed: int):
        u = random.uniform(f"batch:{cfg.batch},length:{cfg.length}", 0, vocab, seed=seed)
        return cast(u * 0.999, torch.int64)

    if cfg.model == "seq2seq":
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


def training_step(cfg: TrainConfig, vocab: int = 264) -> Callable[[], dict[str, Any]]:
    """An SPMD program: build ``cfg``'s model and run one steady-state training step.

    It returns ``{"parameters": global parameter count, "loss": the loss tensor's
    local value}``; the step itself is inside :func:`meshtorch.plan.measure`.
    """
    from meshtorch import amp, optim

    def program() -> dict[str, Any]:
        model = build_model(cfg, vocab)
        opt = make_optimizer(cfg, model)
        batch = synthetic_batch(cfg, vocab)
        with torch.no_grad():
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        optimizer_step(opt)
        precision = amp.autocast(torch.bfloat16) if cfg.precision == "bf16" else nullcontext()
        with measure():
            with precision:
                loss = model.loss(*batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.clip:
                optim.clip_grad_norm_(model, cfg.clip)
            optimizer_step(opt)
        return {"parameters": model.num_parameters(), "loss": loss.local.detach()}

    # the search traces shallow copies and extrapolates (identical blocks cost the same)
    program.layers = cfg.layers
    program.with_layers = lambda n: training_step(dataclasses.replace(cfg, layers=n), vocab)
    program.config = cfg
    return program
