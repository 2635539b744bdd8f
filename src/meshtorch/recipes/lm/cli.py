"""``meshtorch train``, ``meshtorch generate`` and ``meshtorch plan``: the LM recipe's command line.

Every option of :class:`~meshtorch.recipes.lm.config.TrainConfig` is a flag and a key of the
``--config`` TOML file, defined once in :mod:`meshtorch.recipes.lm.flags` for ``train`` and ``plan``.

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
import os
import sys

from meshtorch.recipes.lm import plan_cli
from meshtorch.recipes.lm.flags import add_train_flags, config_from_args


def run_train(args: argparse.Namespace) -> int:
    """``meshtorch train``: train, then name the files written; the exit status."""
    from meshtorch.recipes.lm.trainer import train

    result = train(config_from_args(args))
    if result.get("node_rank"):  # a node other than node 0: node 0 writes the run's files
        print(f"node {result['node_rank']}: its processors are done in {result['wall_s']}s; node 0 wrote "
              f"the run's files in {os.path.abspath(result['out'])}")
        return 0
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
    from meshtorch.recipes.lm.generate import check_request, generate_from_checkpoint

    made = check_request(args.checkpoint, args.prompt, args.tokens, args.temperature, args.top_k, args.beams)
    text = generate_from_checkpoint(args.checkpoint, args.prompt, max_new_tokens=args.tokens,
                                    temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                                    mesh=args.mesh, rules=args.rules, beams=args.beams,
                                    ignore_eos=args.ignore_eos, checked=True)
    print(text)
    if made < args.tokens:  # said after the text, on stderr: `> file` keeps the text alone
        print(f"meshtorch generate: {made} of --tokens {args.tokens} generated: the model's context ends "
              "there (max_length: the run's --length, or config.json's for --init-from; prompt included)",
              file=sys.stderr)
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
    g.add_argument("--checkpoint", required=True, help="a run directory (or its checkpoint/, or one "
                   "version in it: checkpoint/step-000200)")
    g.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    g.add_argument("--tokens", type=int, default=200, help="tokens to generate, at most what the model's "
                   "context (max_length: the run's --length, or config.json's for --init-from) holds after "
                   "the prompt (default: 200)")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest, 0 = all "
                   "(default: 40)")
    g.add_argument("--seed", type=int, default=0, help="(default: 0)")
    g.add_argument("--beams", type=int, default=0, help="beam search of this width instead of "
                   "sampling (--temperature and --top-k are then unused; default: 0, sample)")
    g.add_argument("--ignore-eos", action="store_true", help="go on past the model's end-of-sequence id "
                   "(by default sampling and --beams stop there when the model's config names one: a "
                   "fine-tune of a Hugging Face model, its eos_token_id)")
    g.add_argument("--mesh", default="", help="mesh to load onto (default: one processor)")
    g.add_argument("--rules", default="", help="layout rules for --mesh")
    g.set_defaults(func=run_generate)
    e = sub.add_parser("export", help="write a trained checkpoint as a Hugging Face model directory",
                       description="Write the LM of a meshtorch train checkpoint as config.json + "
                       "safetensors in transformers' names (Llama or GPT-2), with the run's tokenizer.")
    e.add_argument("--checkpoint", required=True, help="a run directory (or its checkpoint/, or one "
                   "version in it: checkpoint/step-000200)")
    e.add_argument("--out", required=True, help="the directory to write")
    e.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="(default: fp32)")
    e.set_defaults(func=run_export)
    plan_cli.register(sub)
