"""``meshtorch plan``: predict (or ``--search``) the layout of what ``meshtorch train`` runs.

``meshtorch plan`` takes every flag of ``meshtorch train`` through the same
parser (:func:`meshtorch.recipes.lm.flags.add_train_flags`, also ``--config``
TOML and ``--init-from DIR``) with the same defaults, and traces the trainer's
own step (:func:`~meshtorch.recipes.lm.steps.training_step`) of the config
those flags make: replace ``train`` by ``plan`` in a command line and the plan
is of that run. Flags that do not change one step's work (``--steps``,
``--out``, ``--data``, ``--lr``, logging, checkpoints, the sample) are accepted
and change nothing. ``--init-from DIR`` reads only ``DIR/config.json`` (a Llama
family model; the weights need not be there). The step is traced once on the
meta backend, so a 512-processor mesh plans on a laptop.

Example:
    $ meshtorch plan --layers 6 --d-model 1024 --d-kv 256 --d-ff 262144 --heads 256 \\
        --batch 256 --length 256 --vocab 32768 --no-tie-embeddings --optimizer adafactor \\
        --mesh batch:16,model:32 --rules "batch:batch; heads:model; d_ff:model; vocab:model" \\
        --hardware tpu-v2

``--hardware`` names the hardware priced; ``--device`` is ``meshtorch train``'s (where the run
computes: ``auto``, ``cpu``, ``cuda``). A hardware name given to ``--device`` (its old meaning here,
e.g. ``--device h100``) still prices that hardware for one release, with a deprecation notice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from meshtorch.errors import PlanError
from meshtorch.files import save_figure
from meshtorch.mesh import Mesh
from meshtorch.plan.devices import DeviceSpec, calibrate, calibration_path, save_spec
from meshtorch.plan.estimate import Estimate, from_trace
from meshtorch.plan.gpu_calibration import device_name, gpu_calibration_path, measure_gpu
from meshtorch.plan.gpus import FALLBACK_LINK, GPUS, assumed, gpu_kind, not_known
from meshtorch.plan.kernels import matmul_efficiency
from meshtorch.plan.layered import layered_trace, whole_trace
from meshtorch.plan.pipeline import PipelineEstimate, estimate_pipeline
from meshtorch.plan.search import search
from meshtorch.plan.tracing import Trace, staging_for
from meshtorch.recipes.lm.config import TRAIN_DEVICES, TrainConfig, check_config
from meshtorch.recipes.lm.steps import TrainingProgram, pipelined_training_step, training_step
from meshtorch.recipes.lm.strategies import overlaps

# the options of the plan itself (not of the run planned), besides meshtorch train's
PLAN_ONLY = ("vocab", "hardware", "calibrate", "calibrate_out", "algorithm", "search", "pipeline", "axes",
             "fixed_mesh", "processors", "top", "json", "png", "layered")


def config_of(args: argparse.Namespace) -> tuple[TrainConfig, int]:
    """The :class:`TrainConfig` that ``meshtorch train`` would run with ``args``' flags (defaults,
    then ``--config``, then the flags, then ``--init-from``'s config.json, as the trainer builds it)
    and its vocabulary size (``--vocab``, else what the trainer's would be before a tokenizer is
    fitted: :func:`~meshtorch.recipes.lm.pretrained.planned_vocab`)."""
    from meshtorch.recipes.lm.flags import config_from_args
    from meshtorch.recipes.lm.pretrained import planned_vocab, with_pretrained_model

    if args.vocab is not None and args.vocab < 1:
        raise PlanError(f"--vocab {args.vocab}: the model needs at least one token id; pass --vocab N >= 1, "
                        "or drop it for the vocabulary meshtorch train's tokenizer would have")
    cfg = with_pretrained_model(config_from_args(args))
    vocab = planned_vocab(cfg)
    if args.vocab is not None and cfg.run.init_from and args.vocab != vocab:
        raise PlanError(f"--vocab {args.vocab} conflicts with --init-from {cfg.run.init_from!r}, whose "
                        f"config.json has {vocab} ids; drop --vocab")
    return cfg, vocab if args.vocab is None else args.vocab


def traced(step: TrainingProgram, mesh: Any, rules: Any, staging: str = "none", compiled: bool = False,
           layered: bool = False, device: str = "cpu") -> Trace:
    """``step``'s meta trace (``compiled``: its kernels as ``torch.compile`` fuses them); ``layered``:
    extrapolated from two shallow depths as the search does (:mod:`meshtorch.plan.layered`: exact for
    parameters, FLOPs, bytes and kernels), so that a deep model plans in seconds; ``device``: where the
    run computes (the priced spec's ``device_type``), so that the trace picks the run's kernels."""
    how = layered_trace if layered else whole_trace
    return how(step, str(mesh), str(rules), staging=staging, compiled=compiled, device=device)


def _calibrates_gpu(args: argparse.Namespace) -> bool:
    """Whether ``meshtorch plan --calibrate`` measures a GPU: with ``--device cuda`` (without it, the
    host, for ``--hardware cpu``, on any machine)."""
    return args.device == "cuda"


def hardware_of_run(cfg: TrainConfig, processes: int, *, flag: str = "--rules auto") -> tuple[str, str]:
    """The hardware spec that prices ``cfg``'s run on this machine, and where it comes from: the CPU's
    stored calibration (``--hardware cpu``) when the run computes on the CPU; on a GPU its own
    measurement if ``meshtorch plan --calibrate`` stored one (:func:`gpu_calibration_path`), else the
    built-in spec of its kind (its data sheet's rates: :func:`meshtorch.plan.gpus.spec_of_gpu`, e.g.
    ``h100-pcie`` for an H100 PCIe, ``l4`` for an L4). A GPU not in :data:`meshtorch.plan.gpus.GPUS`
    without a calibration raises :class:`~meshtorch.errors.PlanError` naming the fix (``meshtorch plan
    --calibrate --device cuda`` on it, or explicit ``--rules``): no GPU is priced as another.
    ``processes``: the run's processors on this machine (``--device auto`` picks CUDA when it has a GPU
    for each). ``flag``: what asked, named by the errors with its own fixes (``meshtorch plan
    --hardware cuda`` prices this machine's GPU through here too: :func:`planned_hardware`)."""
    import torch

    from meshtorch.comm.device import auto_device, parse_device

    kind, _ = parse_device(cfg.parallelism.device)
    if (auto_device(processes) if kind == "auto" else kind) != "cuda":
        return "cpu", "this machine's stored CPU calibration, meshtorch plan --calibrate"
    planning = flag.startswith("--hardware")
    other = "name the hardware to price (--hardware h100, or a device file)" if planning else \
        "pass explicit --rules"
    try:
        name = torch.cuda.get_device_name(0)
    except (AssertionError, RuntimeError) as e:  # a torch without CUDA / a machine without a GPU
        if planning:
            raise PlanError(f"{flag} prices this machine's GPU, but torch sees no CUDA GPU on this machine "
                            f"({e}); name the GPU to price (--hardware h100, its name as CUDA gives it, or "
                            "the device file `meshtorch plan --calibrate --device cuda` wrote on it), or "
                            "--hardware cpu for this machine's CPU") from None
        raise PlanError(f"{flag}: --device {cfg.parallelism.device} asked for, but torch sees no CUDA "
                        f"GPU on this machine ({e}), so there is no GPU to pick a layout for; use --device "
                        "auto or cpu") from None
    calibrated = gpu_calibration_path(device_name(torch.device("cuda", 0)))
    if calibrated.exists():
        return str(calibrated), f"{name} as meshtorch plan --calibrate measured it ({calibrated})"
    gpu = gpu_kind(name)
    if gpu is None:
        raise PlanError(f"{flag}: the GPU {name!r} {not_known(name)} and has no "
                        f"calibration at {calibrated}, so the planner has no rates to "
                        f"{'price it' if planning else 'pick a layout'} with; run `meshtorch plan "
                        "--calibrate --device cuda` on this machine once (it measures the GPU and stores "
                        f"that file), or {other}")
    reported = _reported_memory()
    if reported is not None and reported < 0.9 * gpu.memory_bytes:
        raise PlanError(
            f"{flag}: the GPU {name!r} reports {reported / 1e9:.1f} GB of memory, but its row of "
            f"meshtorch.plan.gpus.GPUS ({gpu.spec}) has {gpu.memory_bytes / 1e9:.0f} GB: a smaller variant "
            "the table does not know, whose layouts would be planned to run out of memory; run `meshtorch "
            "plan --calibrate --device cuda` on this machine once (it measures this GPU's memory and rates), "
            f"or {other}")
    spec, note = gpu.spec, assumed(gpu)
    return spec, f"the built-in {spec} spec for {name} (its data sheet's rates{'; ' + note if note else ''})"


# --hardware values that mean "this machine": its GPU (cuda), or what the run computes on (auto)
THIS_MACHINE = ("cuda", "auto")


def planned_hardware(hardware: str, cfg: TrainConfig) -> tuple[str, str | None]:
    """``meshtorch plan --hardware``'s spec and, for ``cuda`` and ``auto``, where it comes from:
    ``cuda`` is this machine's GPU, ``auto`` the hardware ``cfg``'s ``--device`` computes on (the GPU
    where ``auto`` finds one, else the CPU's calibration), as ``meshtorch train --rules auto`` picks
    it (:func:`hardware_of_run`: a stored ``--calibrate`` of the GPU, else its row of the GPU table).
    Any other value is a hardware name or file, as it is.

    Example:
        >>> planned_hardware("h100", TrainConfig.of())
        ('h100', None)
        >>> planned_hardware("auto", TrainConfig.of(device="cpu"))[0]
        'cpu'
    """
    if hardware.lower() not in THIS_MACHINE:
        return hardware, None
    run = cfg.replace(device="cuda") if hardware.lower() == "cuda" else cfg
    # one processor: the kind of GPU this machine has prices every processor of the mesh planned
    return hardware_of_run(run, 1, flag=f"--hardware {hardware}")


def _reported_memory() -> int | None:
    """Bytes of memory the run's first GPU reports; ``None`` where CUDA cannot say (a CPU-only torch)."""
    import torch

    try:
        return torch.cuda.get_device_properties(0).total_memory
    except (AssertionError, RuntimeError):  # torch raises AssertionError when built without CUDA
        return None


def assumed_note(hardware: str) -> str | None:
    """What ``meshtorch plan --hardware`` prints about a built-in GPU spec's assumptions (a key of
    :data:`~meshtorch.plan.devices.DEVICES` or a GPU's CUDA name: :func:`meshtorch.plan.gpus.assumed`);
    ``None`` for a device file, ``cpu``, a TPU or a GPU priced by its data sheet alone.

    Example:
        >>> assumed_note("h100"), assumed_note("l4")[:40], assumed_note("tpu-v2")
        (None, 'meshtorch plan: l4 is priced at its data', None)
    """
    text = os.fspath(hardware)
    if text.endswith(".json") or os.sep in text:
        return None
    kind = gpu_kind(text)
    if kind is None or not assumed(kind):
        return None
    return f"meshtorch plan: {kind.spec} is priced at its data sheet's rates with {assumed(kind)}"


def budgeted(hardware: str | DeviceSpec, cfg: TrainConfig, processors: int) -> str | DeviceSpec:
    """``hardware`` (a name, a device file or a spec, priced for ``processors`` processors) with the
    memory ``--memory-budget`` gives a processor, where ``cfg`` states one: the limit ``meshtorch
    train``'s memory check holds the run to (:func:`meshtorch.recipes.lm.fit.check_memory`; on a GPU
    the allocator's peak with its margin and the CUDA context must fit it, as the spec's
    ``usable_memory`` says), so that a plan's ``fits`` and a search's layouts are the run's.

    Example:
        >>> spec = budgeted("tpu-v2", TrainConfig.of(memory_budget=2.0), 4)
        >>> spec.memory_bytes / 2 ** 30, spec.name
        (2.0, 'tpu-v2 (--memory-budget 2 GiB)')
        >>> budgeted("tpu-v2", TrainConfig.of(), 4)
        'tpu-v2'
    """
    import dataclasses

    from meshtorch.plan.devices import device

    budget = cfg.run.memory_budget
    if budget <= 0:
        return hardware
    spec = device(hardware, processors=processors)
    return dataclasses.replace(spec, memory_bytes=int(budget * 2 ** 30),
                               name=f"{spec.name} (--memory-budget {budget:g} GiB)")


def choose_rules(cfg: TrainConfig, vocab: int, processes: int) -> tuple[TrainConfig, dict[str, Any] | None]:
    """``meshtorch train --rules auto``: the planner's search (:func:`meshtorch.plan.search`) over the
    layout rules of ``--mesh`` for the trainer's own step (:func:`training_step`, over ``vocab`` ids)
    on the hardware the run computes on (:func:`hardware_of_run`); ``cfg`` with the rules it picks
    (real rules, not ``auto``: what the checkpoint records, so ``--resume`` and ``meshtorch
    generate`` read them as any others) and what to report (the rules, the runner-up and their step
    times, why). A config with explicit rules comes back as it is, with ``None``.

    Only the rules of the given mesh are searched (seconds for the sizes trained here); ``--mesh
    auto:N`` (``auto``: torchrun's ``WORLD_SIZE`` processes) searches the one- and two-axis meshes of
    ``N`` processors too and, for ``--model lm`` without ``--compile`` (which pipelines refuse), their
    pipeline splits (stages, schedule, micro-batches: the search's pipelined family), and ``cfg``
    gets the mesh picked and, where a pipeline wins, its ``--pipeline-stages``, ``--schedule``,
    ``--microbatches`` and ``--virtual-stages``. The search is
    deterministic given the hardware spec, so every process of a torchrun world runs it and gets the
    same rules (the trainer checks that they agree).

    Example:
        >>> cfg = TrainConfig.of(d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, batch=4, length=8,
        ...                      mesh="b:2", rules="batch:b")
        >>> choose_rules(cfg, 16, 2) == (cfg, None)
        True
    """
    par = cfg.parallelism
    if not par.auto_rules:
        return cfg, None
    target: int | str = str(Mesh("" if par.auto_mesh else par.mesh))
    if par.auto_mesh:
        world = os.environ.get("WORLD_SIZE")
        count = par.processors or (int(world) if world else None)
        if count is None:
            raise PlanError(f"--mesh {par.mesh} needs a processor count: --mesh auto:N (e.g. auto:4), or "
                            "the processes torchrun starts")
        target = count
    if par.pipeline_stages > 1:
        raise PlanError(f"--rules auto searches the layout of a plain step; --pipeline-stages "
                        f"{par.pipeline_stages} needs explicit --rules (meshtorch plan --search also tries "
                        "pipeline stages and prints the flags of the best)")
    # the config's own errors first, not the search's
    check_config(cfg.replace(mesh=str(target) if isinstance(target, str) else "", rules=""), vocab)
    hardware, source = hardware_of_run(cfg, processes)
    on_gpu = hardware != "cpu"
    staging = staging_for(par.backend, "cuda" if on_gpu else "cpu")
    # --mesh auto searches the meshes of its processors too, and their pipeline splits where the
    # trainer can pipeline the run (the LM, eager); a run that compiles is priced compiled: the
    # layout that wins may differ from the eager step's
    pipelined = par.auto_mesh and cfg.model.name == "lm" and not cfg.run.compile
    # a --memory-budget is the limit the run's memory check holds it to: the layouts that fit are those
    n = target if isinstance(target, int) else Mesh(target).size
    res = search(training_step(cfg, vocab), target, device=budgeted(hardware, cfg, n), pipeline=pipelined,
                 staging=staging, compiled=cfg.run.compile)
    ranked = res.ranking()
    best = res.best

    def entry(c: Any) -> dict[str, Any]:
        if isinstance(c, Estimate):
            return {"mesh": c.mesh, "rules": c.rules, "step_seconds": c.step_seconds,
                    "memory_bytes": c.memory_bytes["total"], "fits": c.fits, "why": res.why(c),
                    **({"reshard_after_forward": True} if c.reshard_after_forward else {}),
                    **(pipeline_flags(c) if isinstance(c, PipelineEstimate) else {})}
        return {"mesh": c.mesh, "rules": c.rules, "step_seconds_lower_bound": c.seconds, "why": res.why(c)}

    chosen = {"asked": f"--mesh {par.mesh} --rules auto", "mesh": best.mesh, "hardware": res.device,
              "hardware_source": source, "compiled": cfg.run.compile,
              "candidates": res.space, "traced": len(res.candidates), "search_seconds": round(res.seconds, 2),
              **entry(best), "runner_up": entry(ranked[1]) if len(ranked) > 1 else None}
    # the search frees gathered parameters after forward where the layout fits only so
    reshard = par.reshard_after_forward or best.reshard_after_forward
    piped = pipeline_flags(best) if isinstance(best, PipelineEstimate) else {}
    return cfg.replace(mesh=best.mesh, rules=best.rules, reshard_after_forward=reshard, **piped), chosen


def pipeline_flags(est: PipelineEstimate) -> dict[str, Any]:
    """The ``meshtorch train`` options of a pipelined layout the search priced (``est.mesh`` has
    its ``stage`` axis, which ``--pipeline-stages`` of the same size keeps)."""
    return {"pipeline_stages": est.stages, "schedule": est.schedule, "microbatches": est.microbatches,
            "virtual_stages": est.virtual_stages}


def describe_choice(chosen: dict[str, Any]) -> str:
    """The lines ``meshtorch train --rules auto`` prints about the rules it picked and why."""
    c = chosen
    step = "compiled step" if c.get("compiled") else "step"
    lines = [f"{c['asked']}: picked --mesh {c['mesh']} --rules \"{c['rules']}\""
             + (" --reshard-after-forward" if c.get("reshard_after_forward") else "") + _piped(c)
             + ": planned "
             f"{c['step_seconds'] * 1e3:.2f} ms a {step} on {c['hardware']} ({c['hardware_source']}; "
             f"{c['candidates']} candidates, {c['traced']} traced, in {c['search_seconds']} s); {c['why']}"]
    if not chosen["fits"]:
        lines.append("  no layout of this mesh fits the planned memory: this is the one that needs least")
    r = chosen["runner_up"]
    if r is not None:
        cost = (f"{r['step_seconds'] * 1e3:.2f} ms" if "step_seconds" in r
                else f">= {r['step_seconds_lower_bound'] * 1e3:.2f} ms")
        lines.append(f"  runner-up --mesh {r['mesh']} --rules \"{r['rules']}\"{_piped(r)}: {cost}, "
                     f"{r['why']}")
    return "\n".join(lines)


def _piped(c: dict[str, Any]) -> str:
    """The pipeline flags of a chosen layout's entry, as a command line takes them ("" unpipelined)."""
    if c.get("pipeline_stages", 1) <= 1:
        return ""
    chunks = f" --virtual-stages {c['virtual_stages']}" if c.get("virtual_stages", 1) > 1 else ""
    return (f" --pipeline-stages {c['pipeline_stages']} --schedule {c['schedule']} "
            f"--microbatches {c['microbatches']}{chunks}")


def plot(path: str, ests: list[Estimate]) -> bool:
    """Step time (compute + communication) and memory per candidate as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{e.mesh}\n{e.rules}".replace("; ", "\n") for e in ests]
    x = range(len(ests))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(6, 1.6 * len(ests)), 4.5))
    comp = [e.compute_seconds * 1e3 for e in ests]
    comm = [e.comm_total_seconds * 1e3 for e in ests]
    a1.bar(x, comp, label="compute")
    a1.bar(x, comm, bottom=comp, label="communication")
    a1.set_ylabel("step time (ms)")
    a1.legend()
    bottom = [0.0] * len(ests)
    for kind in ("parameters", "gradients", "optimizer", "activations"):
        vals = [e.memory_bytes[kind] / 2 ** 30 for e in ests]
        a2.bar(x, vals, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a2.axhline(ests[0].memory_capacity / 2 ** 30, color="k", ls="--", label=f"{ests[0].device} memory")
    a2.set_ylabel("memory per processor (GiB)")
    a2.legend(fontsize=7)
    for ax in (a1, a2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=6)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    """``meshtorch plan``: print the estimate (or the search's ranking); the exit status."""
    if args.calibrate and _calibrates_gpu(args):
        import torch

        spec = measure_gpu("cuda")
        path = args.calibrate_out or gpu_calibration_path(spec.name)
        save_spec(spec, path)
        # the fit's rate at two shapes, not its asymptote alone: x / (x + knee) per dimension
        # leaves a large knee's asymptote above any rate the GPU reaches (an H100's fit: 1179
        # TFLOP/s at knee 512, 983 at 8192³; its data sheet says 989 dense)
        bf16 = spec.peak_flops["bfloat16"]
        print(f"meshtorch plan: stored {spec.name}'s kernel numbers in {path}: bf16 matmuls "
              f"fitted at {bf16 * matmul_efficiency(8192, 8192, 8192, spec.matmul_knee) / 1e12:.0f} "
              f"TFLOP/s at 8192³ and {bf16 * matmul_efficiency(8192, 768, 768, spec.matmul_knee) / 1e12:.0f} "
              f"at [8192, 768] x [768, 768] ({bf16 / 1e12:.0f} x x/(x + {spec.matmul_knee:g}) per "
              f"dimension), fused "
              f"attention {spec.attention_efficiency:.2f} of it, copies "
              f"{spec.copy_bandwidth / 1e12:.2f} TB/s, {spec.launch_seconds * 1e6:.1f} µs a kernel, "
              f"{spec.op_seconds * 1e6:.1f} µs of host an op, {spec.sync_seconds * 1e6:.1f} µs a sync, "
              f"{spec.context_bytes / 2 ** 30:.2f} GiB of CUDA context, links "
              f"{spec.default_link.bandwidth / 1e9:.0f} GB/s and {spec.default_link.latency * 1e6:.1f} µs "
              f"a hop ({_link_source(spec.name, torch.cuda.device_count())}); "
              f"plan with --hardware {path} "
              "(meshtorch train --rules auto uses it on this GPU)", file=sys.stderr)
        if not (args.mesh or args.search):
            return 0
    elif args.calibrate:
        machine = calibrate()
        print(f"meshtorch plan: stored this machine's calibration in {calibration_path()}: "
              f"{machine.peak_flops['float32'] / 1e9:.1f} GFLOP/s float32, "
              f"{machine.memory_bandwidth / 1e9:.1f} GB/s copies, "
              f"{machine.op_seconds * 1e6:.0f} µs an aten op, "
              f"{machine.memory_bytes / 2 ** 30:.1f} GiB; "
              "--hardware cpu uses it from now on", file=sys.stderr)
        if not (args.mesh or args.search):
            return 0
    cfg, vocab = config_of(args)
    args.hardware, source = planned_hardware(args.hardware, cfg)
    note = f"meshtorch plan: pricing {source}" if source else assumed_note(args.hardware)
    if note:
        print(note, file=sys.stderr)
    par = cfg.parallelism
    compiled = cfg.run.compile
    # the collective buffers of the run planned: NCCL's with --backend torch --device cuda
    staging = staging_for(par.backend, "cuda" if par.device == "cuda" else "cpu")
    if par.pipeline_stages > 1 and args.search:
        raise PlanError("--search tries pipeline stages itself (--no-pipeline leaves them out); "
                        "--pipeline-stages N prices one pipelined layout: drop one of the two")
    if par.auto_rules:
        as_rules_auto(args, cfg)
    check_search_flags(args, cfg)
    if not args.search:
        check_config(cfg, vocab)  # meshtorch train's own checks (layout, --compile with pipelines, ...)
    if par.pipeline_stages > 1:
        if cfg.model.name != "lm":
            raise PlanError(f"--pipeline-stages plans --model lm (the model meshtorch train pipelines); "
                            f"got --model {cfg.model.name!r}")
        est = estimate_pipeline(pipelined_training_step(cfg, vocab), par.parsed.mesh, par.parsed.rules,
                                device=budgeted(args.hardware, cfg, par.parsed.mesh.size),
                                algorithm=args.algorithm, staging=staging)
        ests: list[Estimate] = [est]
        out = est.to_json()
        if not args.json:
            print(est.table())
    elif args.search:
        step = training_step(cfg, vocab)
        target: int | str = args.mesh if args.mesh and args.fixed_mesh else (
            args.processors or (Mesh(par.mesh).size if args.mesh else 0))
        if not target:
            raise PlanError("--search needs --processors N (or --mesh, whose size is used)")
        # meshtorch train's own checks of the model flags (the search picks the mesh and rules)
        check_config(cfg.replace(mesh=target if isinstance(target, str) else "", rules=""), vocab)
        n = target if isinstance(target, int) else Mesh(target).size
        res = search(step, target, device=budgeted(args.hardware, cfg, n), algorithm=args.algorithm,
                     pipeline=args.pipeline is not False, staging=staging, axes=args.axes or 2,
                     compiled=compiled)
        if not args.json:
            print(res.table(args.top))
        ests = res.candidates
        out = {**res.best.to_json(), "search_seconds": res.seconds, "why": res.why(),
               "candidates": [{**e.to_json(), "why": res.why(e)} for e in ests[: args.top]],
               "pruned": [p.to_json() for p in res.pruned_candidates]}
    else:
        from meshtorch.plan.devices import device as get_device

        mesh, rules = par.parsed.mesh, par.parsed.rules
        spec = get_device(budgeted(args.hardware, cfg, mesh.size), processors=mesh.size)
        t = traced(training_step(cfg, vocab), mesh, rules, staging, compiled=compiled, layered=args.layered,
                   device=spec.device_type)
        est = from_trace(t, mesh, spec, args.algorithm)
        ests = [est]
        out = {**est.to_json(), "compiled": compiled, "overlap": overlaps(cfg),
               "reshard_after_forward": overlaps(cfg) and par.reshard_after_forward}
        if not args.json:
            print(est.table())
    if args.png:
        if not plot(args.png, ests[: args.top]):
            print("meshtorch plan: matplotlib is not installed; no PNG written", file=sys.stderr)
        elif not args.json:
            print(f"wrote {args.png}")
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0


def as_rules_auto(args: argparse.Namespace, cfg: TrainConfig) -> None:
    """``meshtorch plan`` of a ``meshtorch train --rules auto`` command line: the search that run
    makes when it starts (:func:`choose_rules`), priced on ``--hardware``: the rules of ``--mesh``
    (``--search --fixed-mesh``), or with ``--mesh auto:N`` the meshes of ``N`` processors and, for
    ``--model lm``, their pipeline splits (``--search --processors N``). It was refused, advising
    ``--search --fixed-mesh``, which ``--mesh auto:N`` refused in turn."""
    par = cfg.parallelism
    if par.pipeline_stages > 1:
        raise PlanError(f"--rules auto searches the layout of a plain step; --pipeline-stages "
                        f"{par.pipeline_stages} needs explicit --rules (--search also tries pipeline stages "
                        "and prints the flags of the best)")
    if not par.auto_mesh:
        args.search, args.fixed_mesh, args.mesh = True, True, par.mesh
        return
    if par.processors is None:
        raise PlanError(f"--mesh {par.mesh} takes its processor count from torchrun; here pass --mesh "
                        "auto:N (e.g. auto:4)")
    if args.processors and args.processors != par.processors:
        raise PlanError(f"--processors {args.processors} and --mesh {par.mesh} disagree: drop --processors")
    args.search, args.processors, args.mesh = True, par.processors, None


def check_search_flags(args: argparse.Namespace, cfg: TrainConfig) -> None:
    """Refuse the options of ``--search`` without it, and ``--fixed-mesh`` without a mesh to keep or
    with a processor count or meshes of its own, naming the flag and the fix (each was dropped
    unsaid: ``meshtorch plan --processors 4`` planned ``--mesh b:2``)."""
    mesh = cfg.parallelism.mesh
    if not args.search:
        if args.processors:
            raise PlanError(f"--processors {args.processors} is the processor count --search lays out; "
                            f"without --search the plan is of --mesh {mesh}: add --search, or pass a "
                            f"--mesh of {args.processors} processors (e.g. --mesh b:{args.processors})")
        for flag, given in (("--fixed-mesh", args.fixed_mesh), (f"--axes {args.axes}", args.axes is not None),
                            ("--pipeline" if args.pipeline else "--no-pipeline", args.pipeline is not None)):
            if given:
                raise PlanError(f"{flag} is an option of --search; without it the plan is of --mesh {mesh} "
                                f"--rules {cfg.parallelism.rules!r}: add --search, or drop {flag.split()[0]}")
        return
    if not args.fixed_mesh:
        return
    if not args.mesh:
        raise PlanError("--fixed-mesh keeps --mesh and searches its rules, but no --mesh was given: pass "
                        "--mesh (e.g. --mesh b:2,m:2), or drop --fixed-mesh to search the meshes of "
                        "--processors N")
    size = Mesh(mesh).size  # (the rules may be auto: the mesh alone)
    if args.processors and args.processors != size:
        raise PlanError(f"--processors {args.processors} and --fixed-mesh --mesh {mesh} ({size} processors) "
                        "disagree: drop --processors (the fixed mesh's size is searched), or --fixed-mesh to "
                        f"search the meshes of {args.processors} processors")
    for flag, given in ((f"--axes {args.axes}", args.axes is not None), ("--pipeline", bool(args.pipeline))):
        if given:
            raise PlanError(f"{flag} chooses the meshes --search tries, but --fixed-mesh keeps --mesh "
                            f"{mesh}: drop {flag.split()[0]} or --fixed-mesh")


def _link_source(name: str, gpus: int) -> str:
    """Where a GPU calibration's link comes from, for its printout (:func:`measure_gpu`)."""
    if gpus > 1:
        return "an all_reduce over its GPUs"
    kind = gpu_kind(name)
    if kind is not None:
        return f"one GPU: the data sheet's {kind.link} of the {kind.spec} spec"
    return (f"one GPU, not in meshtorch.plan.gpus.GPUS: {FALLBACK_LINK['link']} assumed; put the real link "
            "in the file's \"link\" if it differs")


class _Device(argparse.Action):
    """``meshtorch plan --device``: ``meshtorch train``'s (where the planned run computes: auto, cpu,
    cuda); any other value is the old meaning of the flag here, the hardware to price (now
    ``--hardware``), kept for one release with a notice."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values in TRAIN_DEVICES:
            namespace.device = values
            return
        print(f"meshtorch plan: --device {values} is deprecated, pass --hardware {values} (the hardware to "
              "price; --device is meshtorch train's: where the run computes, auto, cpu or cuda)",
              file=sys.stderr)
        namespace.hardware = values


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``meshtorch plan`` to the ``meshtorch`` command line: every flag of ``meshtorch train``
    (the same definitions) and the planner's own (:data:`PLAN_ONLY`)."""
    from meshtorch.recipes.lm.flags import add_train_flags

    ap = subparsers.add_parser(
        "plan", help="predict FLOPs, bytes, memory and step time of a meshtorch train run; "
        "--search for the fastest layout that fits",
        description="Predict (or --search) the layout of the run meshtorch train would make of the same "
        "flags, on a mesh of devices: FLOPs, bytes per axis, memory and step time. Every flag of "
        "meshtorch train is taken, with its defaults; the ones that do not change one step's work "
        "(--steps, --out, --data, --lr, logging, checkpoints, the sample) change nothing here.")
    add_train_flags(ap, skip=("device", "nnodes", "node_rank", "master_addr", "master_port"))
    g = ap.add_argument_group("plan (the planner's own options)")
    g.add_argument("--device", dest="device", action=_Device, default=None,
                   help="meshtorch train's --device (auto, cpu, cuda: where the planned run computes; cuda "
                   "with --backend torch plans NCCL's buffers); a hardware name here is the deprecated "
                   "spelling of --hardware")
    g.add_argument("--vocab", type=int, default=None,
                   help="token ids (default: what meshtorch train's tokenizer would have: --init-from's "
                   "vocabulary, 264 for bytes, N for bpe:N, 2048 for auto)")
    g.add_argument("--hardware", default="tpu-v2",
                   help="the hardware to price: tpu-v2, tpu-v3, a GPU by its data sheet ("
                   + ", ".join(kind.spec for kind in GPUS) + ": meshtorch.plan.gpus; or its name as CUDA "
                   "gives it), cuda (this machine's GPU: its --calibrate file, else its row), auto (cuda "
                   "where --device finds a GPU, else cpu), cpu (this machine, as stored by "
                   "--calibrate) or a JSON device file (peak_flops by dtype, memory_bytes, link, links per "
                   "axis: docs/planner.md)")
    g.add_argument("--calibrate", action="store_true",
                   help="measure this machine once and store it for --hardware cpu (alone: only that); with "
                   "--device cuda measure the GPU instead: matmul rates "
                   "by shape and dtype, fused attention, copy bandwidth, launch, host and sync costs, "
                   "into a device file for --hardware FILE")
    g.add_argument("--calibrate-out", default=None,
                   help="with --calibrate on a GPU: the device file to write (default: "
                   "<cache>/<gpu name>.json, which meshtorch train --rules auto uses on that GPU)")
    g.add_argument("--algorithm", choices=("ring", "tree"), default="ring")
    g.add_argument("--layered", action=argparse.BooleanOptionalAction, default=True,
                   help="trace two shallow copies of a deep model and extrapolate (parameters, FLOPs, bytes "
                   "and kernels as the full trace's, the peak too without overlap, within 10%% with it; "
                   "what --search does); --no-layered traces every layer")
    g.add_argument("--processors", type=int, default=0, help="with --search: the processors to lay out")
    g.add_argument("--top", type=int, default=10, help="with --search: candidates shown")
    g.add_argument("--search", action="store_true", help="search meshes and rules for the fastest that fits")
    # (None: not given, so that a search option given without --search is refused, not dropped)
    g.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                   help="with --search: also try pipeline stages (2, 4, ...) x the layouts of the "
                   "processors left x micro-batch counts (--model lm; the default)")
    g.add_argument("--axes", type=int, choices=(1, 2, 3), default=None,
                   help="with --search: meshes of up to this many axes (3 adds b:x,m:y,x:z; default 2)")
    g.add_argument("--fixed-mesh", action="store_true", help="with --search: keep --mesh, search rules only")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    g.add_argument("--png", default=None, help="write time and memory per candidate to this PNG")
    ap.set_defaults(func=run)
