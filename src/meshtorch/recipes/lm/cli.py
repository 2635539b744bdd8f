"""``meshtorch train``, ``meshtorch generate`` and ``meshtorch plan``: the LM recipe's command line.

Every option of :class:`~meshtorch.recipes.lm.config.TrainConfig` is a flag
(``--d-model 256``) and a key of the ``--config`` TOML file (at the top level,
under ``[train]``, or under its section: ``[model]``, ``[parallelism]``,
``[optimizer]``, ``[run]``; all of them merge, and an option set in two places
is an error); flags override the file, the file overrides the defaults.

Example:
    >>> from meshtorch.recipes.lm.cli import config_from_args, register
    >>> import argparse
    >>> p = argparse.ArgumentParser(); sub = p.add_subparsers(dest="command")
    >>> register(sub)
    >>> cfg = config_from_args(p.parse_args(["train", "--steps", "5", "--no-tie-embeddings"]))
    >>> cfg.run.steps, cfg.model.tie_embeddings, cfg.model.name
    (5, False, 'lm')
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from meshtorch.errors import MeshTorchError
from meshtorch.recipes.lm import plan_cli
from meshtorch.recipes.lm.config import CHOICES, OPTIONS, SECTIONS, TrainConfig

HELP = {
    "model": "lm: decoder-only; seq2seq: encoder-decoder on a spelling task; moe: LM with experts",
    "mesh": "processor mesh, e.g. 'b:2,m:2'; auto:N (auto under torchrun) with --rules auto: meshtorch "
            "train's planner search picks a mesh of N processors",
    "rules": "layout rules, e.g. 'batch:b; heads:m; d_ff:m; vocab:m' (add 'experts:b' for moe; "
             "'batch:b; length:m' splits sequences: ring attention); auto: meshtorch train's planner search "
             "picks them for --mesh on this hardware and prints why",
    "attention": "causal self-attention: auto = ring attention when --rules split length, "
                 "ring = always, gather = never (all-gather keys and values)",
    "backend": "threads: one thread per processor; torch: one process per processor (torch.distributed)",
    "device": "cuda: one GPU per processor (NCCL with --backend torch); auto: cuda when this machine "
              "has a GPU for every processor, else cpu",
    "precision": "bf16: autocast with fp32 master weights",
    "compile": "torch.compile each step's forward and backward (inductor; the first step compiles, "
               "tens of seconds); collectives are ops of the graph (functional collectives with --backend "
               "torch)",
    "out": "output directory (default: runs/<date-time>/)",
    "resume": "continue the run in this --out directory from its checkpoint, up to --steps in all",
    "keep": "checkpoints kept in --out/checkpoint/, the newest first",
    "async_checkpoint": "--checkpoint-every's saves copy the state to host memory at the step, then write "
                        "the files on a background thread while training goes on (the same files; the "
                        "final save is synchronous)",
    "data": "a text file or a directory of text files (default: the Python stdlib .py files)",
    "config": "a TOML file of these options (flags override it)",
    "tensorboard": "also write the metrics as TensorBoard event files in --out/tensorboard/ "
                   "(pip install 'meshtorch[tensorboard]')",
    "encoder_layers": "encoder blocks (--model seq2seq)",
    "experts": "experts per MoE layer (--model moe)",
    "moe_every": "every n-th block is an MoE layer (--model moe)",
    "pipeline_stages": "pipeline stages along a 'stage' mesh axis (added in front of --mesh if absent)",
    "microbatches": "micro-batches per batch with --pipeline-stages > 1",
    "lr_schedule": "learning rate after the warm-up",
    "schedule": "pipeline schedule with --pipeline-stages > 1 (2bw: PipeDream-2BW, no flush between batches)",
    "clip": "bound on the global gradient norm; 0: no clipping",
    "timeout": "seconds a collective waits for the other processors before the run fails",
    "allow_change": "with --resume: model options (comma-separated, e.g. 'activation,eps') that may differ "
                    "from the run's record; without it a changed model option is an error",
    "overwrite": "replace an earlier run in --out (without it, --out onto an earlier run is an error)",
    "recompute": "recompute each block's activations in backward instead of keeping them (less memory, "
                 "one more forward of FLOPs; meshtorch plan prices it)",
    "memory_check": "before training, compare the planner's peak-memory prediction with the memory available",
    "init_from": "fine-tune a Hugging Face model directory (config.json + safetensors; Llama family or "
                 "GPT-2): its config sets the model, each processor reads its slices of the weights",
    "tokenizer": "bytes; bpe:N: a byte-level BPE of N ids fitted to the training data (saved in "
                 "--out/tokenizer/); a Hugging Face tokenizer directory (tokenizer.json); auto: "
                 "--init-from's tokenizer if it has one, else bpe:2048 when the tokenizers library is "
                 "installed (pip install 'meshtorch[hf]'), else bytes",
}
GROUPS = {"model": "model (the fields of meshtorch.models.TransformerConfig)",
          "parallelism": "parallelism", "optimizer": "optimizer", "run": "run"}


def add_train_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Every option of :class:`TrainConfig` as a flag of ``p`` (default ``None``: not given), and
    ``--config``; ``meshtorch train`` and ``meshtorch plan`` both take them from here, so that the same
    flags make the same config (:func:`config_from_args`). ``skip``: option names ``p`` defines itself."""
    groups = {s: p.add_argument_group(title) for s, title in GROUPS.items()}
    for name, (section, attr) in OPTIONS.items():
        if name in skip:
            continue
        f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == attr)
        flag = "--" + name.replace("_", "-")
        h = HELP.get(name, "")
        if f.default is not None and "(default" not in h:
            h = f"{h} (default: {f.default})".lstrip()
        group = groups[section]
        if f.type == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=h)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            group.add_argument(flag, type=kind, default=None, help=h, dest=name, choices=CHOICES.get(name))
    p.add_argument("--config", default=None, help=HELP["config"])


def _toml_options(path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise MeshTorchError("--config needs Python >= 3.11 (tomllib); pass options as flags") from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise MeshTorchError(f"--config {path!r}: {e}") from None
    values: dict[str, Any] = {}
    where: dict[str, str] = {}  # option -> the table it was set in, for the error of one set twice

    def take(table: dict[str, Any], place: str, section: str | None = None) -> None:
        for name, value in table.items():
            if section is None and place == "the top level" and name == "train" and isinstance(value, dict):
                take(value, "[train]")  # [train] and the top level merge: one set of options
                continue
            if section is None and name in SECTIONS and isinstance(value, dict):
                # a [model] / [parallelism] / [optimizer] / [run] table holds that section's options
                take(value, f"[{name}]" if place == "the top level" else f"[train.{name}]", name)
                continue
            key = name.replace("-", "_")
            if section is not None and key == "name":
                key = section
            if key not in OPTIONS:
                raise MeshTorchError(f"--config {path!r}: unknown option {name!r} in {place}; known: "
                                     f"{sorted(OPTIONS)}")
            if key in values:
                raise MeshTorchError(f"--config {path!r}: {key!r} is set twice, in {where[key]} "
                                     f"({values[key]!r}) and in {place} ({value!r}); keep one")
            values[key], where[key] = value, place

    take(data, "the top level")
    return values


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then ``--config`` TOML, then the flags given."""
    values = _toml_options(args.config) if getattr(args, "config", None) else {}
    for k in OPTIONS:
        v = getattr(args, k, None)
        if v is not None:
            values[k] = v
    return TrainConfig.of(**values)


def run_train(args: argparse.Namespace) -> int:
    """``meshtorch train``: train, then name the files written; the exit status."""
    from meshtorch.recipes.lm.trainer import train

    result = train(config_from_args(args))
    png = "loss.png" if result.get("loss_png") else "loss.png skipped: matplotlib is not installed " \
        "(pip install 'meshtorch[plot]')"
    wrote = [f for f in ("checkpoint/", "tokenizer/", "metrics.jsonl", "summary.json", "tensorboard/")
             if os.path.exists(os.path.join(result["out"], f.rstrip("/")))]
    if "tokens_per_s" in result:
        print(f"training: {result['tokens_per_s']:.0f} tokens/s, model-FLOP utilisation "
              f"{100 * result['model_flop_utilisation']:.1f}% of the measured "
              f"{result['peak_flops_per_s'] / 1e9:.1f} GFLOP/s matmul peak")
    print(f"done in {result['wall_s']}s; wrote {', '.join(wrote)}, {png}")
    print(f"run directory: {os.path.abspath(result['out'])}")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """``meshtorch generate``: print the prompt and its continuation; the exit status."""
    from meshtorch.recipes.lm.generate import generate_from_checkpoint

    text = generate_from_checkpoint(args.checkpoint, args.prompt, max_new_tokens=args.tokens,
                                    temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                                    mesh=args.mesh, rules=args.rules, beams=args.beams)
    print(text)
    return 0


def run_export(args: argparse.Namespace) -> int:
    """``meshtorch export``: write the Hugging Face directory and name its files; the exit status."""
    import torch

    from meshtorch.recipes.lm.export import export_checkpoint

    files = export_checkpoint(args.checkpoint, args.out, torch.bfloat16 if args.dtype == "bf16" else None)
    print(f"wrote {', '.join(files)} to {os.path.abspath(args.out)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``train``, ``generate``, ``export`` and ``plan`` parsers to ``sub``."""
    p = sub.add_parser("train", help="train a Transformer on text (defaults: the Python stdlib, ~1 min)",
                       description="Train a Transformer on text, data-, model- or pipeline-parallel on a "
                       "processor mesh. Every option is also a key of the --config TOML file.")
    add_train_flags(p)
    p.set_defaults(func=run_train)
    g = sub.add_parser("generate", help="continue a prompt with a trained checkpoint",
                       description="Continue a prompt with the LM of a meshtorch train checkpoint, "
                       "on any mesh.")
    g.add_argument("--checkpoint", required=True, help="a run directory (or its checkpoint/)")
    g.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    g.add_argument("--tokens", type=int, default=200, help="tokens to generate (default: 200)")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest, 0 = all "
                   "(default: 40)")
    g.add_argument("--seed", type=int, default=0, help="(default: 0)")
    g.add_argument("--beams", type=int, default=0, help="beam search of this width instead of "
                   "sampling (--temperature and --top-k are then unused; default: 0, sample)")
    g.add_argument("--mesh", default="", help="mesh to load onto (default: one processor)")
    g.add_argument("--rules", default="", help="layout rules for --mesh")
    g.set_defaults(func=run_generate)
    e = sub.add_parser("export", help="write a trained checkpoint as a Hugging Face model directory",
                       description="Write the LM of a meshtorch train checkpoint as config.json + "
                       "safetensors in transformers' names (Llama or GPT-2), with the run's tokenizer.")
    e.add_argument("--checkpoint", required=True, help="a run directory (or its checkpoint/)")
    e.add_argument("--out", required=True, help="the directory to write")
    e.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="(default: fp32)")
    e.set_defaults(func=run_export)
    plan_cli.register(sub)
