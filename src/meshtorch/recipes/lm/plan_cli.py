"""``meshtorch plan``: predict (or ``--search``) a model's layout on a mesh of devices.

The model and its training step are those of ``meshtorch train`` (same flag
names); the step is traced once on the meta backend, so a 512-processor mesh
plans on a laptop. Defaults follow the Mesh-TensorFlow paper's language
models: untied embedding and output layer, Adafactor, float32.

Example:
    $ meshtorch plan --model lm --layers 6 --d-model 1024 --d-kv 256 --d-ff 262144 --heads 256 \\
        --batch 256 --length 256 --vocab 32768 --mesh batch:16,model:32 \\
        --rules "batch:batch; heads:model; d_ff:model; vocab:model" --hardware tpu-v2

``--hardware`` names the hardware priced (``meshtorch train --device`` is where a run computes);
``--device``, its old name here, still works for one release and prints a deprecation notice.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from meshtorch.errors import PlanError
from meshtorch.mesh import Mesh
from meshtorch.plan.devices import calibrate, calibration_path
from meshtorch.plan.estimate import Estimate, estimate
from meshtorch.plan.pipeline import estimate_pipeline
from meshtorch.plan.search import search
from meshtorch.plan.tracing import staging_for
from meshtorch.recipes.lm.config import (
    MODELS,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    PRECISIONS,
    ModelSection,
    TrainConfig,
    check_layout,
)
from meshtorch.recipes.lm.steps import pipelined_training_step, training_step


def config_of(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` that ``meshtorch plan``'s model options describe."""
    return TrainConfig.of(model=args.model, batch=args.batch, length=args.length, d_model=args.d_model,
                          heads=args.heads, d_kv=args.d_kv, d_ff=args.d_ff, layers=args.layers,
                          encoder_layers=args.encoder_layers, experts=args.experts, top_k=args.top_k,
                          tie_embeddings=args.tie_embeddings, optimizer=args.optimizer,
                          precision=args.precision, mesh=args.mesh or "b:1", rules=args.rules,
                          pipeline_stages=args.pipeline_stages, microbatches=args.microbatches,
                          schedule=args.schedule, dropout=args.dropout, recompute=args.recompute)


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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    """``meshtorch plan``: print the estimate (or the search's ranking); the exit status."""
    if args.calibrate:
        machine = calibrate()
        print(f"meshtorch plan: stored this machine's calibration in {calibration_path()}: "
              f"{machine.peak_flops['float32'] / 1e9:.1f} GFLOP/s float32, "
              f"{machine.memory_bandwidth / 1e9:.1f} GB/s copies, "
              f"{machine.op_seconds * 1e6:.0f} µs an aten op, "
              f"{machine.memory_bytes / 2 ** 30:.1f} GiB; "
              "--hardware cpu uses it from now on", file=sys.stderr)
        if not (args.mesh or args.search):
            return 0
    cfg = config_of(args)
    step = training_step(cfg, args.vocab)
    if args.pipeline_stages > 1 and args.search:
        raise PlanError("--search tries pipeline stages itself (--no-pipeline leaves them out); "
                        "--pipeline-stages N prices one pipelined layout: drop one of the two")
    if args.pipeline_stages > 1:
        if cfg.model.name != "lm":
            raise PlanError(f"--pipeline-stages plans --model lm (the model meshtorch train pipelines); "
                            f"got --model {cfg.model.name!r}")
        layout = cfg.parallelism.parsed  # --mesh with the stage axis, parsed with the config
        if args.rules:
            per_stage = layout.stage_mesh
            check_layout(cfg, args.vocab, per_stage if per_stage.axis_names else Mesh({"b": 1}))
        # without --mesh the stages are the whole mesh (the config's placeholder b:1 is not priced)
        mesh = layout.mesh if args.mesh else Mesh(layout.mesh.axes[:1])
        est = estimate_pipeline(pipelined_training_step(cfg, args.vocab), mesh, layout.rules,
                                device=args.hardware, algorithm=args.algorithm)
        ests: list[Estimate] = [est]
        out = est.to_json()
        if not args.json:
            print(est.table())
    elif args.search:
        target: int | str = args.mesh if args.mesh and args.fixed_mesh else (
            args.processors or (cfg.parallelism.parsed.mesh.size if args.mesh else 0))
        if not target:
            raise PlanError("--search needs --processors N (or --mesh, whose size is used)")
        res = search(step, target, device=args.hardware, algorithm=args.algorithm, pipeline=args.pipeline,
                     staging=staging_for(args.backend), axes=args.axes)
        if not args.json:
            print(res.table(args.top))
        ests = res.candidates
        out = {**res.best.to_json(), "search_seconds": res.seconds, "why": res.why(),
               "candidates": [{**e.to_json(), "why": res.why(e)} for e in ests[: args.top]],
               "pruned": [p.to_json() for p in res.pruned_candidates]}
    else:
        if not args.mesh:
            raise PlanError("pass --mesh (e.g. batch:16,model:32) or --search --processors N")
        layout = cfg.parallelism.parsed
        check_layout(cfg, args.vocab)
        est = estimate(step, layout.mesh, layout.rules, device=args.hardware, algorithm=args.algorithm,
                       staging=staging_for(args.backend))
        ests = [est]
        out = est.to_json()
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


class _DeprecatedDevice(argparse.Action):
    """``meshtorch plan --device``: the old name of ``--hardware`` (``meshtorch train --device`` is where
    a run computes, so the planner's flag got its own name); kept for one release, with a notice."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"meshtorch plan: --device is deprecated, pass --hardware {values} (the hardware to price; "
              "meshtorch train --device is where a run computes)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``meshtorch plan`` to the ``meshtorch`` command line."""
    d = ModelSection()
    ap = subparsers.add_parser("plan", help="predict FLOPs, bytes, memory and step time of a layout; "
                               "--search for the fastest that fits",
                               description="Predict (or --search) the layout of a meshtorch train model "
                               "on a mesh of devices: FLOPs, bytes per axis, memory and step time.")
    ap.add_argument("--model", choices=MODELS, default="lm")
    for name, default in (("layers", 6), ("encoder-layers", d.encoder_layers), ("d-model", 1024),
                          ("d-kv", 256), ("d-ff", 4096), ("heads", 4), ("batch", 256), ("length", 256),
                          ("vocab", 32768), ("experts", d.experts), ("top-k", d.top_k),
                          ("processors", 0), ("top", 10)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=False,
                    help="share the embedding and output layer (the paper's models do not)")
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adafactor")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="dropout rate (its masks and draws are planned)")
    ap.add_argument("--recompute", action="store_true",
                    help="activation recomputation: one more forward of FLOPs, blocks' activations not kept")
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32")
    ap.add_argument("--mesh", default="", help="e.g. batch:16,model:32")
    ap.add_argument("--rules", default="", help='e.g. "batch:batch; heads:model; d_ff:model; vocab:model"')
    ap.add_argument("--hardware", default="tpu-v2",
                    help="the hardware to price: tpu-v2, tpu-v3, a100, h100, cpu (this machine, as stored by "
                    "--calibrate) or a JSON device file (peak_flops by dtype, memory_bytes, link, links per "
                    "axis: docs/planner.md)")
    ap.add_argument("--device", dest="hardware", action=_DeprecatedDevice, help=argparse.SUPPRESS)
    ap.add_argument("--calibrate", action="store_true",
                    help="measure this machine once and store it for --hardware cpu (alone: only that)")
    ap.add_argument("--algorithm", choices=("ring", "tree"), default="ring")
    ap.add_argument("--pipeline-stages", type=int, default=1,
                    help="plan --model lm pipelined over this many stages along a 'stage' mesh axis "
                    "(added in front of --mesh if absent), as meshtorch train --pipeline-stages runs it")
    ap.add_argument("--microbatches", type=int, default=4,
                    help="micro-batches per batch with --pipeline-stages")
    ap.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default="1f1b",
                    help="pipeline schedule with --pipeline-stages, and the one --search tries")
    ap.add_argument("--backend", choices=("threads", "torch"), default="threads",
                    help="the backend of the planned run: torch plans gloo's collective buffers too")
    ap.add_argument("--search", action="store_true", help="search meshes and rules for the fastest that fits")
    ap.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=True,
                    help="with --search: also try pipeline stages (2, 4, ...) x the layouts of the "
                    "processors left x micro-batch counts (--model lm)")
    ap.add_argument("--axes", type=int, choices=(1, 2, 3), default=2,
                    help="with --search: meshes of up to this many axes (3 adds b:x,m:y,x:z)")
    ap.add_argument("--fixed-mesh", action="store_true", help="with --search: keep --mesh, search rules only")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--png", default=None, help="write time and memory per candidate to this PNG")
    ap.set_defaults(func=run)
