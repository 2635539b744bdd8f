"""The LM recipe's flags, defined once: ``meshtorch train`` and ``meshtorch plan`` both take every
option of :class:`~meshtorch.recipes.lm.config.TrainConfig` from here, so the same flags make the
same config.

Every option is a flag (``--d-model 256``) and a key of the ``--config`` TOML file (at the top level,
under ``[train]``, or under its section: ``[model]``, ``[parallelism]``, ``[optimizer]``, ``[run]``;
all of them merge, and an option set in two places is an error); flags override the file, the file
overrides the defaults.

Example:
    >>> import argparse
    >>> from meshtorch.recipes.lm.flags import add_train_flags, config_from_args
    >>> p = argparse.ArgumentParser(); add_train_flags(p)
    >>> cfg = config_from_args(p.parse_args(["--steps", "5", "--no-tie-embeddings"]))
    >>> cfg.run.steps, cfg.model.tie_embeddings
    (5, False)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from meshtorch.errors import ArgumentError, MeshTorchError
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
    "rope_scaling": "the rotary frequencies rescaled, as JSON in transformers' names: "
                    "'{\"rope_type\": \"linear\", \"factor\": 2.0}' or rope_type llama3 with factor, "
                    "low_freq_factor, high_freq_factor, original_max_position_embeddings (with --init-from: "
                    "a Llama 3.1+ config's rope_parameters); needs --positions rotary",
    "padding_id": "a token id whose embedding lookups train nothing, as transformers' padding_idx (with "
                  "--init-from: a Llama's pad_token_id); -1: none",
    "experts": "experts per MoE layer (--model moe)",
    "moe_every": "every n-th block is an MoE layer (--model moe)",
    "pipeline_stages": "pipeline stages along a 'stage' mesh axis (added in front of --mesh if absent)",
    "microbatches": "micro-batches per batch with --pipeline-stages > 1",
    "lr_schedule": "learning rate after the warm-up",
    "schedule": "pipeline schedule with --pipeline-stages > 1 (2bw: PipeDream-2BW, no flush between batches; "
                "zb: ZB-H1, the backward split into input and weight gradients; interleaved: interleaved "
                "1F1B over --virtual-stages chunks per stage; zbv: ZB-V, the split backward over "
                "--virtual-stages 2 chunks per stage in a V, chunks s and 2 x pipeline-stages - 1 - s on "
                "stage s)",
    "virtual_stages": "model chunks per pipeline stage with --schedule interleaved (chunk c of "
                      "pipeline-stages x virtual-stages on stage c mod pipeline-stages; --layers must divide "
                      "into them) or 2 with --schedule zbv",
    "clip": "bound on the global gradient norm; 0: no clipping",
    "overlap": "run parameters' collectives grouped (a flat all_gather / reduce_scatter / all_reduce per "
               "bucket) and asynchronously, overlapped with compute (mt.overlap; off under --compile, "
               "which schedules its collectives itself); --no-overlap: one blocking collective per use",
    "reshard_after_forward": "with --overlap: free each gathered parameter (FSDP-style rules) after its "
                             "forward use and gather it again in backward, as FSDP2 does (at most the "
                             "memory of --no-overlap); --no-reshard-after-forward keeps them (fewer bytes, "
                             "more memory)",
    "timeout": "seconds a collective waits for the other processors before the run fails",
    "max_restarts": "--backend torch: when a worker fails (an exception, an exit, kill -9), stop the others "
                    "and start them all again from the last checkpoint in --out, up to this many times "
                    "(torchrun's elastic agent; metrics.jsonl and summary.json record each restart)",
    "nnodes": "--backend torch across nodes (as meshtorch launch): the number of nodes; start meshtorch "
              "train on each with the same options and its --node-rank; each runs mesh size / nnodes "
              "processors, and --out must be one directory every node mounts (see docs/distributed.md)",
    "node_rank": "this node's number among --nnodes, 0 to nnodes-1 (node 0 hosts the rendezvous, holds --out "
                 "and writes the run's files)",
    "master_addr": "with --nnodes > 1: node 0's address, reachable from every node (as torchrun)",
    "master_port": "with --nnodes > 1: the port of the rendezvous on node 0 (as torchrun)",
    "allow_change": "with --resume: model options (comma-separated, e.g. 'activation,eps') that may differ "
                    "from the run's record; without it a changed model option is an error",
    "overwrite": "replace an earlier run in --out (without it, --out onto an earlier run is an error)",
    "recompute": "recompute each block's activations in backward instead of keeping them (less memory, "
                 "one more forward of FLOPs; meshtorch plan prices it)",
    "memory_check": "before training, compare the planner's peak-memory prediction with the memory available "
                    "(on GPUs: the caching allocator's peak, its fragmentation margin and the CUDA context, "
                    "against each GPU's free memory) and refuse a run that does not fit",
    "memory_budget": "GiB one processor may use, for the memory check (0: what its GPU has free, or the "
                     "host's available memory shared by its processors)",
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
            text = _json_object if str(f.type).startswith("dict") else str
            kind = {"int": int, "float": float}.get(str(f.type), text)
            group.add_argument(flag, type=kind, default=None, help=h, dest=name, choices=CHOICES.get(name))
    p.add_argument("--config", default=None, help=HELP["config"])


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (``--rope-scaling '{"rope_type": "linear", "factor": 2.0}'``)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, got {text!r}")
    return value


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
    if values.get("overlap") is False and values.get("reshard_after_forward") is True:
        raise ArgumentError("--reshard-after-forward frees the gathered parameters of --overlap's grouped "
                            "collectives; with --no-overlap each use gathers its own, kept until backward "
                            "(nothing to reshard): drop one of them")
    return TrainConfig.of(**values)
