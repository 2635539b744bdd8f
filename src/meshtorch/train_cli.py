"""``meshtorch train`` and ``meshtorch generate``: the command-line front of :mod:`meshtorch.train`.

Every :class:`~meshtorch.train.TrainConfig` field is a flag (``--d-model 256``)
and a key of the ``--config`` TOML file; flags override the file, the file
overrides the defaults.

Example:
    >>> from meshtorch.train_cli import config_from_args, build
    >>> import argparse
    >>> p = argparse.ArgumentParser(); sub = p.add_subparsers(dest="command")
    >>> build(sub)
    >>> cfg = config_from_args(p.parse_args(["train", "--steps", "5", "--no-tie-embeddings"]))
    >>> cfg.steps, cfg.tie_embeddings, cfg.model
    (5, False, 'lm')
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from meshtorch.errors import MeshTorchError
from meshtorch.train import MODEL_FIELDS, TrainConfig

HELP = {
    "model": "lm (decoder-only), seq2seq (encoder-decoder on a spelling task) or moe (LM with experts)",
    "mesh": "processor mesh, e.g. 'b:2,m:2'",
    "rules": "layout rules, e.g. 'batch:b; heads:m; d_ff:m; vocab:m' (add 'experts:b' for moe)",
    "backend": "threads (one process) or torch (under meshtorch launch / torchrun)",
    "precision": "fp32 or bf16 (autocast, fp32 master weights)",
    "optimizer": "adamw or adafactor",
    "out": "output directory (default runs/<date-time>/)",
    "resume": "continue the run in this --out directory from its checkpoint",
    "data": "a text file or a directory of text files (default: the Python stdlib .py files)",
    "config": "a TOML file of these options (flags override it)",
    "positions": "learned or rotary",
    "norm": "layer or rms",
    "activation": "gelu, gelu_tanh, relu or silu",
    "encoder_layers": "encoder blocks (--model seq2seq)",
    "experts": "experts per MoE layer (--model moe)",
    "moe_every": "every n-th block is an MoE layer (--model moe)",
    "pipeline_stages": "pipeline stages along a 'stage' mesh axis (added in front of --mesh if absent)",
    "microbatches": "micro-batches per batch with --pipeline-stages > 1",
    "lr_schedule": "learning rate after the warm-up: cosine or constant",
    "schedule": "pipeline schedule with --pipeline-stages > 1: gpipe, 1f1b or 2bw (PipeDream-2BW, no flush "
                "between batches)",
}


def _add_flags(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model options (the fields of meshtorch.models.TransformerConfig)")
    for f in dataclasses.fields(TrainConfig):
        group = model if f.name in MODEL_FIELDS else p
        flag = "--" + f.name.replace("_", "-")
        h = HELP.get(f.name, "") + f" (default: {f.default})"
        if f.type in ("bool", bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=h)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            group.add_argument(flag, type=kind, default=None, help=h, dest=f.name)
    p.add_argument("--config", default=None, help=HELP["config"])


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then ``--config`` TOML, then the flags given."""
    values: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    if getattr(args, "config", None):
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise MeshTorchError("--config needs Python >= 3.11 (tomllib); pass options as flags") from None
        try:
            with open(args.config, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise MeshTorchError(f"--config {args.config!r}: {e}") from None
        data = data.get("train", data)
        for k, v in data.items():
            key = k.replace("-", "_")
            if key not in names:
                raise MeshTorchError(f"--config {args.config!r}: unknown option {k!r}; "
                                     f"known: {sorted(names)}")
            values[key] = v
    for k in names:
        v = getattr(args, k, None)
        if v is not None:
            values[k] = v
    return TrainConfig(**values)


def run_train(args: argparse.Namespace) -> int:
    from meshtorch.train import train

    cfg = config_from_args(args)
    result = train(cfg)
    png = "loss.png" if result.get("loss_png") else "loss.png skipped: matplotlib is not installed " \
        "(pip install 'meshtorch[plot]')"
    wrote = [f for f in ("checkpoint/", "metrics.jsonl", "summary.json")
             if os.path.exists(os.path.join(result["out"], f.rstrip("/")))]
    print(f"done in {result['wall_s']}s; wrote {', '.join(wrote)}, {png}")
    print(f"run directory: {os.path.abspath(result['out'])}")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from meshtorch.generate import generate_from_checkpoint

    text = generate_from_checkpoint(args.checkpoint, args.prompt, max_new_tokens=args.tokens,
                                    temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                                    mesh=args.mesh, rules=args.rules)
    print(text)
    return 0


def build(sub: argparse._SubParsersAction) -> None:
    """Add the ``train`` and ``generate`` parsers to ``sub``."""
    p = sub.add_parser("train", help="train a Transformer on text (defaults: the Python stdlib, ~3 min)",
                       description=__doc__.splitlines()[0])
    _add_flags(p)
    p.set_defaults(func=run_train)
    g = sub.add_parser("generate", help="continue a prompt with a trained checkpoint")
    g.add_argument("--checkpoint", required=True, help="a run directory (or its checkpoint/)")
    g.add_argument("--prompt", default="def ", help="text to continue")
    g.add_argument("--tokens", type=int, default=200, help="bytes to generate")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest (0 = all)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--mesh", default="", help="mesh to load onto (default: one processor)")
    g.add_argument("--rules", default="", help="layout rules for --mesh")
    g.set_defaults(func=run_generate)


register = build
