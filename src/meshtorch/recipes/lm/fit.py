"""Will the step fit? ``meshtorch train``'s memory check before it starts, from the planner's trace.

:func:`check_memory` traces the run's own step (:func:`~meshtorch.recipes.lm.steps.training_step`)
on the meta backend for the device the run computes on and compares one processor's peak with
what that device has: on GPUs, the peak of torch's caching allocator (each storage a block,
:mod:`meshtorch.plan.allocator`) plus its fragmentation margin and the CUDA context, against
the GPU's free memory; on the host, the peak times the processors sharing it, against the memory
the host has available. ``--memory-budget GIB`` states the limit instead (per processor), and
``--no-memory-check`` skips the check. A run that does not fit is refused with the planned peak
by kind, the limit and its source, and what would make it fit (each change planned).
"""

from __future__ import annotations

from meshtorch.comm.device import auto_device, parse_device
from meshtorch.errors import TrainingError
from meshtorch.plan import devices
from meshtorch.plan.allocator import CUDA_CONTEXT_BYTES, FRAGMENTATION, reserved_bytes
from meshtorch.plan.estimate import _fmt_bytes
from meshtorch.plan.tracing import KINDS, Trace, staging_for, trace
from meshtorch.recipes.lm.config import TrainConfig, check_model_flags
from meshtorch.recipes.lm.steps import training_step

GiB = 2 ** 30


def _traced(cfg: TrainConfig, vocab: int, runs_on: str) -> Trace:
    # a --compile run holds what inductor keeps (plan/compiled_memory.py), less than its eager step
    par = cfg.parallelism
    return trace(training_step(cfg, vocab), mesh=par.parsed.mesh, rules=par.parsed.rules,
                 staging=staging_for(par.backend, runs_on), device=runs_on, compiled=cfg.run.compile)


def _on_gpu(cfg: TrainConfig, processes: int) -> bool:
    """Whether ``processes`` processors of ``cfg``'s run compute on GPUs (``--device cuda``, or
    ``auto`` with a GPU per processor)."""
    kind, _ = parse_device(cfg.parallelism.device)
    return (auto_device(processes) if kind == "auto" else kind) == "cuda"


def _machine_memory(on_gpu: bool, processes: int) -> tuple[int, str] | None:
    """The memory this machine has for the run, and where that number comes from: the fullest GPU's
    free memory (one per processor), or the host's available memory (shared); ``None``: unknown."""
    return devices.gpu_free_memory(processes) if on_gpu else devices.available_memory()


def processor_need(t: Trace, on_gpu: bool) -> int:
    """Bytes one processor of a run needs for the step traced in ``t``: on a GPU the allocator's
    peak with its fragmentation margin and the CUDA context
    (:func:`~meshtorch.plan.allocator.reserved_bytes`), on the host the peak.

    Example:
        >>> from meshtorch.plan.tracing import Trace
        >>> t = Trace(mesh="b:1", rules="", backend="meta", peak_bytes=10 * 2 ** 30)
        >>> processor_need(t, on_gpu=False) / 2 ** 30, processor_need(t, on_gpu=True) / 2 ** 30
        (10.0, 11.5)
    """
    return reserved_bytes(t.peak_bytes) if on_gpu else t.peak_bytes


def _changes(cfg: TrainConfig, vocab: int, t: Trace, runs_on: str, sharing: int, have: int) -> list[str]:
    """What would make the step fit, biggest lever first; the cheap changes planned
    (--recompute, half the batch), the ones that need more processors or other rules said."""
    on_gpu = runs_on == "cuda"
    out: list[str] = []
    tried: list[tuple[str, TrainConfig]] = []
    if not cfg.model.recompute:
        tried.append(("--recompute", cfg.replace(recompute=True)))
    mesh = cfg.parallelism.parsed.mesh
    if cfg.run.batch % 2 == 0 and cfg.run.batch // 2 >= mesh.size:
        tried.append((f"--batch {cfg.run.batch // 2}", cfg.replace(batch=cfg.run.batch // 2)))
    for flag, changed in tried:
        try:
            need = processor_need(_traced(changed, vocab, runs_on), on_gpu) * sharing
        except Exception:  # a change this model or layout refuses: not advice
            continue
        verdict = "fits" if need <= have else "still too much"
        out.append(f"{flag}: {_fmt_bytes(need)} ({verdict})")
    states = sum(t.peak_by_kind[k] for k in ("parameters", "gradients", "optimizer"))
    out.append(f"FSDP rules (e.g. --rules 'batch:b; d_model:b') split the {_fmt_bytes(states)} of "
               "parameters, gradients and optimizer state over the axis b")
    out.append("more processors (a larger --mesh axis that --rules splits batch or model dims over) divide "
               "what they split")
    if not cfg.run.precision.startswith("bf16"):
        out.append("--precision bf16 halves the activations")
    return out


def check_memory(cfg: TrainConfig, vocab: int, processes: int) -> dict[str, int] | None:
    """Raise :class:`TrainingError` if ``processes`` processors of ``cfg``'s step on this machine
    need more memory than they have, as the planner predicts; return the prediction (one
    processor's peak by kind, its ``total``, and ``need``: what the check compared), or ``None``
    where nothing is checked.

    On GPUs (``--device cuda``, or ``auto`` with a GPU per processor) each processor's need
    (:func:`processor_need`: the allocator's peak, its margin, the CUDA context) must fit its
    GPU's free memory (:func:`meshtorch.plan.devices.gpu_free_memory`, the fullest GPU's); on the
    host the processors share its available memory (:func:`meshtorch.plan.devices.available_memory`).
    ``--memory-budget`` (GiB a processor) replaces either limit. Nothing is checked without a known
    limit, with ``--no-memory-check``, or for a pipelined run (its stages hold parts of the model,
    which the plain step's trace does not model).

    Example:
        >>> from meshtorch.recipes.lm import TrainConfig
        >>> from meshtorch.recipes.lm.fit import check_memory
        >>> cfg = TrainConfig.of(d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, batch=4, length=8)
        >>> check_memory(cfg, vocab=16, processes=2)["parameters"] >= 4 * 752
        True
    """
    if not cfg.run.memory_check or cfg.parallelism.pipeline_stages > 1:
        return None
    on_gpu = _on_gpu(cfg, processes)
    runs_on = "cuda" if on_gpu else "cpu"
    budget = cfg.run.memory_budget
    if budget > 0:
        limit: tuple[int, str] | None = (int(budget * GiB), f"--memory-budget {budget:g} GiB a processor")
        sharing = 1
    else:
        # on GPUs each processor has one of its own; on the host they share its memory
        limit = _machine_memory(on_gpu, processes)
        sharing = 1 if on_gpu else processes
    if limit is None:
        return None
    have, source = limit
    t = _traced(cfg, vocab, runs_on)
    need = processor_need(t, on_gpu)
    if need * sharing > have:
        kinds = ", ".join(f"{k} {_fmt_bytes(t.peak_by_kind[k])}"
                          for k in sorted(KINDS, key=lambda k: -t.peak_by_kind[k]))
        if on_gpu:
            what = (f"{_fmt_bytes(need)} a GPU: the allocator's planned peak {_fmt_bytes(t.peak_bytes)} "
                    f"({kinds}) + {FRAGMENTATION:.0%} for its fragmentation + "
                    f"{_fmt_bytes(CUDA_CONTEXT_BYTES)} of CUDA context")
        else:
            what = (f"{_fmt_bytes(need * sharing)}: {sharing} processor(s) on this machine x the planned "
                    f"peak {_fmt_bytes(t.peak_bytes)} ({kinds})")
        fixes = "; ".join(_changes(cfg, vocab, t, runs_on, sharing, have))
        raise TrainingError(
            f"this step does not fit: it needs about {what}, as meshtorch plan predicts, but "
            f"{_fmt_bytes(have)} is available ({source}). To fit: {fixes}. To run anyway: "
            "--no-memory-check (or state the limit with --memory-budget GIB)")
    return {**t.peak_by_kind, "total": t.peak_bytes, "need": need}


def parameters_at_least(cfg: TrainConfig, vocab: int) -> dict[str, int]:
    """A lower bound on the parameters of ``cfg``'s model over ``vocab`` ids, by the flag that makes
    them (counted from the sizes alone, nothing built): the embedding, and per block the query and
    output projections and the two feed-forward matrices (keys, values, norms, biases and
    cross-attention only add to it).

    Example:
        >>> from meshtorch.recipes.lm import TrainConfig
        >>> from meshtorch.recipes.lm.fit import parameters_at_least
        >>> from meshtorch.recipes.lm.steps import build_model
        >>> cfg = TrainConfig.of(model="moe", d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, experts=3)
        >>> bound = parameters_at_least(cfg, vocab=16)
        >>> bound
        {'--d-model': 128, '--layers': 768, '--experts': 512}
        >>> sum(bound.values()) <= build_model(cfg, vocab=16).num_parameters()
        True
    """
    m = cfg.model_config(vocab)
    block = 2 * m.d_model * m.heads * m.d_kv + 2 * m.d_model * m.d_ff
    moe_layers = m.layers // m.moe_every if m.experts else 0
    parts = {"--d-model": vocab * m.d_model, "--layers": m.layers * block,
             "--encoder-layers": m.encoder_layers * block,
             "--experts": moe_layers * max(m.experts - 1, 0) * 2 * m.d_model * m.d_ff}
    return {k: v for k, v in parts.items() if v}


def check_model_size(cfg: TrainConfig, vocab: int, processors: int, processes: int) -> None:
    """Raise :class:`TrainingError` at once, before anything is built or traced, if the fp32 weights alone
    of ``cfg``'s model (:func:`parameters_at_least`), split as finely as ``processors`` processors can,
    cannot fit the memory of this machine's ``processes`` processors: a model of a billion layers fails
    here in milliseconds instead of running away building it. Without a known limit nothing is checked.

    Example:
        >>> from meshtorch.recipes.lm import TrainConfig
        >>> from meshtorch.recipes.lm.fit import check_model_size
        >>> try:
        ...     check_model_size(TrainConfig.of(layers=10**12), 264, processors=2, processes=2)
        ... except Exception as e:
        ...     print(type(e).__name__, str(e)[-14:])
        TrainingError lower --layers
    """
    check_model_flags(cfg)
    on_gpu = _on_gpu(cfg, processes)
    limit = _machine_memory(on_gpu, processes)
    if limit is None:
        return
    have, source = limit
    parts = parameters_at_least(cfg, vocab)
    params = sum(parts.values())
    per_processor = 4 * -(-params // max(processors, 1))
    need = per_processor * (1 if on_gpu else processes)
    if need <= have:
        return
    part = max(parts, key=parts.__getitem__)
    # the sizes that make the largest part; the one furthest above its default is the one to lower
    factors = {"--d-model": ("d_model",), "--layers": ("layers", "d_model", "d_ff", "heads", "d_kv"),
               "--encoder-layers": ("encoder_layers", "d_model", "d_ff", "heads", "d_kv"),
               "--experts": ("experts", "layers", "d_model", "d_ff")}[part]
    default = TrainConfig().model
    sizes = {f: getattr(cfg.model, f) for f in factors}
    worst = max(sizes, key=lambda f: sizes[f] / max(getattr(default, f) or 1, 1))
    made = ", ".join(f"--{f.replace('_', '-')} {v}" for f, v in sizes.items())
    where = "one processor per GPU" if on_gpu else f"{processes} processor(s) on this machine"
    raise TrainingError(f"the model has at least {params:,} parameters, mostly from {made}: their "
                        f"fp32 weights alone need {_fmt_bytes(need)} ({where}, each holding at least "
                        f"1/{processors} of them) but only {_fmt_bytes(have)} is available ({source}); "
                        f"lower --{worst.replace('_', '-')}")

__all__ = ["check_memory", "check_model_size", "parameters_at_least", "processor_need"]
