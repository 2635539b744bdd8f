"""A run directory's checkpoint and metrics: what ``--resume`` continues from.

Example:
    >>> import tempfile
    >>> from meshtorch.recipes.lm.config import TrainConfig
    >>> from meshtorch.recipes.lm.run_files import earlier_metrics
    >>> earlier_metrics(TrainConfig(), tempfile.mkdtemp(), start=0)
    []
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shlex
from typing import Any

import torch

from meshtorch.errors import ArgumentError, CheckpointError, MeshTorchError, ShapeError, TrainingError
from meshtorch.models.config import TransformerConfig
from meshtorch.models.hf import RUN_OPTIONS
from meshtorch.recipes.lm.config import RUN_DECIDES, ModelSection, TrainConfig
from meshtorch.recipes.lm.guards import LOCK, check_weights, lock_holder, recorded

# TransformerConfig's fields that choose how the same function is computed, not which: free on resume
# (the attention kernel, recomputing activations, and dropout, which the weights never compute with)
SAME_FUNCTION = (*RUN_OPTIONS, "recompute")
TOKENIZER_DIR = "tokenizer"  # the run's own copy of its tokenizer (a fitted BPE is written there)
# model options a resumed fine-tune keeps as its run trained them where --init-from's config.json now says
# otherwise: a run from before meshtorch had padding_id trained the pad row (-1), and the pad row is all it
# changes (the model computes the same function). The run goes on as it trained, --allow-change takes the
# config's value; the other options must agree with config.json (check_resumed_model)
KEPT_ON_RESUME = ("padding_id",)
# options that may differ from the resumed run's and change what its next steps compute (the model's
# are compared by check_resumed_model, the weight decay is told from the optimizer's groups): the line
# that says the run resumed names those that differ, as a flag left out takes its default, not the run's
TOLD_ON_RESUME = ("lr", "warmup", "lr_schedule", "clip", "batch", "length", "data", "precision")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def kept_on_resume(cfg: TrainConfig, hf: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """``{option: (the run's value, hf's)}`` for each of :data:`KEPT_ON_RESUME` in which ``--resume``'s
    run (its recorded value, else the option's default: a run older than the option trained with that)
    differs from ``hf``, ``--init-from``'s config, unless ``--allow-change`` names it; empty without
    ``--resume``. The resumed run keeps the run's values (:func:`resume_note` says so)."""
    resume = cfg.run.resume
    if not resume or not os.path.isdir(os.path.join(resume, "checkpoint")):
        return {}  # (check_resume names what is wrong with it)
    saved = recorded(resume).get("model_config")
    if saved is None:
        return {}
    theirs, allowed = TransformerConfig.from_dict(saved), allowed_changes(cfg)
    return {n: (getattr(theirs, n), getattr(hf, n)) for n in KEPT_ON_RESUME
            if n not in allowed and getattr(theirs, n) != getattr(hf, n)}


def resume_note(cfg: TrainConfig) -> str | None:
    """The note that ``--resume``'s fine-tune keeps options as it trained them, not as ``--init-from``'s
    config.json now has them (:func:`kept_on_resume`), and how to take the config's; ``None`` if none."""
    if not cfg.run.init_from:
        return None
    from meshtorch.models import hf_config

    _, hf, fields = hf_config(cfg.run.init_from)
    kept = kept_on_resume(cfg, hf)
    if not kept:
        return None
    defaults = TransformerConfig()
    run = ", ".join(f"{_flag(n)} {a}" + (" (the default; a run older than the option trained so)"
                                          if a == getattr(defaults, n) else "") for n, (a, _) in kept.items())
    theirs = ", ".join(f"{fields.get(n, n)}={b!r}" for n, (_, b) in kept.items())
    return (f"note: --resume {cfg.run.resume!r} trained with {run} and goes on so, though --init-from "
            f"{cfg.run.init_from!r} has {theirs}; add --allow-change {','.join(kept)} to train with the "
            "config's from here on")


def allowed_changes(cfg: TrainConfig) -> set[str]:
    """The model options ``--allow-change`` names (``"activation,eps"`` -> ``{"activation", "eps"}``);
    a name that is not a model option is an :class:`ArgumentError`.

    Example:
        >>> sorted(allowed_changes(TrainConfig.of(allow_change="activation, rotary-base")))
        ['activation', 'rotary_base']
    """
    names = {n.strip().replace("-", "_") for n in cfg.run.allow_change.split(",") if n.strip()}
    known = {"model"} | {f.name for f in dataclasses.fields(ModelSection) if f.name != "name"}
    unknown = sorted(names - known)
    if unknown:
        raise ArgumentError(f"--allow-change {cfg.run.allow_change!r} names {unknown}, which are not model "
                            f"options; it takes model options such as 'activation,eps': {sorted(known)}")
    return names


def model_changes(cfg: TrainConfig, record: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(option, recorded value, value of cfg)`` for every model option in which ``cfg`` differs from the
    run ``record`` (:func:`recorded`) describes: ``--model`` and every field of
    :class:`~meshtorch.models.TransformerConfig` (found by ``dataclasses.fields``, so a field added
    later is compared too), except those the run decides (:data:`RUN_DECIDES`) and those that compute
    the same function (:data:`SAME_FUNCTION`)."""
    changes = []
    kind = record.get("model", "lm")
    if kind != cfg.model.name:
        changes.append(("model", kind, cfg.model.name))
    if "model_config" not in record:
        return changes
    theirs = TransformerConfig.from_dict(record["model_config"])
    # the fields under the run's kind: --model moe's experts are the consequence of --model, not a change
    mine = dataclasses.replace(cfg.model, name=kind).config(vocab=theirs.vocab, length=cfg.run.length)
    for f in dataclasses.fields(TransformerConfig):
        if f.name in RUN_DECIDES or f.name in SAME_FUNCTION:
            continue
        a, b = getattr(theirs, f.name), getattr(mine, f.name)
        if a != b:
            changes.append((f.name, a, b))
    # max_length comes from --length: it sizes a learned position table (a parameter), which --length
    # must then keep; rotary positions have no table, so their runs may resume with another --length.
    # A fine-tune's table is config.json's (--init-from) and a seq2seq model's the spelling task's, not
    # --length's: their runs resume with their own flags whatever max_length they record
    run_init_from = (record.get("train_config") or {}).get("init_from")
    sized = not cfg.run.init_from and not run_init_from and kind != "seq2seq"
    if sized and theirs.positions == mine.positions == "learned" and theirs.max_length != mine.max_length:
        length = (record.get("train_config") or {}).get("length", theirs.max_length)
        changes.append(("length", length, cfg.run.length))
    return changes


def _parameter_dims(models: list[tuple[str, TransformerConfig]]) -> list[dict[str, tuple]]:
    """The named global shape of every parameter of each ``(kind, config)`` model, all built in one
    launch on the ``meta`` backend (no storage, no values): a launch, not a model, is what costs."""
    from meshtorch.launcher import launch

    def build() -> list[dict[str, tuple]]:
        from meshtorch.models import DecoderLM
        from meshtorch.models.seq2seq import EncoderDecoder

        dims = []
        for kind, config in models:
            model = (EncoderDecoder if kind == "seq2seq" else DecoderLM)(config, seed=0)
            dims.append({n: tuple((d.name, d.size) for d in p.shape.dims)
                         for n, p in model.named_mesh_parameters()})
        return dims

    return launch(build, mesh="one:1", backend="meta")[0]


def _reshaping(cfg: TrainConfig, record: dict[str, Any], changes: list[tuple[str, Any, Any]]) -> set[str]:
    """The options among ``changes`` that, each alone, give the model other parameters (names or
    shapes) than the run's: no checkpoint of the run loads into it, so no ``--allow-change`` can
    resume it."""
    if not changes or "model_config" not in record:
        return set()
    theirs = TransformerConfig.from_dict(record["model_config"])
    kind = record.get("model", "lm")
    mine = dataclasses.replace(cfg.model, name=kind).config(vocab=theirs.vocab, length=cfg.run.length)

    def variant(name: str, value: Any) -> tuple[str, TransformerConfig]:
        if name == "model":
            return value, cfg.model.config(vocab=theirs.vocab, length=cfg.run.length)
        change = {"max_length": max(value, 8)} if name == "length" else {name: value}
        if change.get("positions", theirs.positions) != "rotary":
            change["rope_scaling"] = None  # (it rescales rotary positions only, and holds no parameter)
        try:
            return kind, dataclasses.replace(theirs, **change)
        except ShapeError:
            # the option alone makes no model with the run's others (--heads 2 under the run's --kv-heads
            # 4): it changes with those cfg changes too, so it is told by the model cfg asks for
            return kind, mine

    variants = [variant(name, value) for name, _, value in changes]
    saved, *others = _parameter_dims([(kind, theirs), *variants])
    return {name for (name, _, _), other in zip(changes, others) if other != saved}


def _as_flags(changes: list[tuple[str, Any, Any]]) -> str:
    """What sets the run's values of ``changes`` again, as a shell takes it: ``Pass`` the flags (a JSON
    object quoted, ``--rope-scaling '{"rope_type": "linear", "factor": 2.0}'``) and ``drop`` those whose
    value is none (no flag sets ``None``).

    Example:
        >>> print(_as_flags([("rope_scaling", {"factor": 2.0}, None), ("gated", False, True)]))
        Pass --rope-scaling '{"factor": 2.0}' --no-gated
        >>> print(_as_flags([("activation", "relu", "gelu"), ("rope_scaling", None, {"factor": 2.0})]))
        Pass --activation relu and drop --rope-scaling
    """
    def spelled(n: str, a: Any) -> str:
        if isinstance(a, bool):
            return _flag(n) if a else _flag("no_" + n)
        return f"{_flag(n)} {shlex.quote(json.dumps(a) if isinstance(a, dict) else str(a))}"

    given = " ".join(spelled(n, a) for n, a, _ in changes if a is not None)
    dropped = ", ".join(_flag(n) for n, a, _ in changes if a is None)
    if not dropped:
        return f"Pass {given}"
    return f"Pass {given} and drop {dropped}" if given else f"Drop {dropped}"


def _init_from_fields(cfg: TrainConfig) -> dict[str, str]:
    """The model options ``--init-from``'s config.json sets, each to the config field that sets it
    (none without ``--init-from``)."""
    if not cfg.run.init_from:
        return {}
    from meshtorch.models import hf_config

    return hf_config(cfg.run.init_from)[2]


def check_resumed_model(cfg: TrainConfig, record: dict[str, Any]) -> None:
    """Raise :class:`ArgumentError` if ``cfg``'s model differs from the one the resumed run trained
    (:func:`model_changes`) in an option that ``--allow-change`` does not name: a change that keeps the
    shapes (``--activation``, ``--eps``, ``--rotary-base``) would load the weights into another function.
    A change that gives the model other parameters (``--d-model``, ``--layers``, ``--model``) cannot
    resume at all, named or not: the error says so rather than suggest ``--allow-change``."""
    allowed = allowed_changes(cfg)
    changes = model_changes(cfg, record)
    reshaping = _reshaping(cfg, record, changes)
    refused = [c for c in changes if c[0] not in allowed or c[0] in reshaping]
    if not refused:
        return
    what = "; ".join(f"{_flag(n)} {b!r} (the run has {a!r})" for n, a, b in refused)
    same_shapes = [c for c in refused if c[0] not in reshaping]
    # --init-from's config.json sets the options it has a field for, and no flag may contradict it
    configured = _init_from_fields(cfg)
    flags = [c for c in refused if c[0] not in configured]
    if (any(n == "positions" and a != "rotary" for n, a, _ in flags) and cfg.model.rope_scaling is not None
            and "rope_scaling" not in {n for n, _, _ in flags}):
        flags.append(("rope_scaling", None, cfg.model.rope_scaling))  # (allowed, but it needs rotary ones)
    fix = _as_flags(flags) if flags else ""
    if len(flags) < len(refused):
        names = ", ".join(_flag(n) for n, _, _ in refused if n in configured)
        fix += (" and put back" if fix else "Put back") + (
            f" the config.json the run started from (--init-from {cfg.run.init_from!r}'s sets {names} now)")
    fix += " to continue the run as it was"
    if same_shapes:
        fix += f", or --allow-change {','.join(n for n, _, _ in same_shapes)} to change it on purpose"
    reshaped = [c for c in refused if c[0] in reshaping]
    if reshaped:
        fix += (f"; {', '.join(_flag(n) for n, _, _ in reshaped)} would give the model other parameters "
                "than the run's checkpoint holds, which no --allow-change can resume: train that model "
                "as a new run (another --out)")
    raise ArgumentError(f"--resume {cfg.run.resume!r} trained another model than these options ask for: "
                        f"{what}. {fix}")


def other_than_the_run(cfg: TrainConfig, record: dict[str, Any]) -> list[str]:
    """The options of :data:`TOLD_ON_RESUME` in which ``cfg`` differs from the run ``record``
    (:func:`recorded`) describes, each as ``--flag now (the run had before)``.

    Example:
        >>> record = {"train_config": TrainConfig.of(lr=0.01, batch=8).options()}
        >>> other_than_the_run(TrainConfig.of(batch=8), record)
        ['--lr 0.003 (the run had 0.01)']
    """
    theirs, mine = record.get("train_config") or {}, cfg.options()
    told = []
    for name in TOLD_ON_RESUME:
        if name not in theirs:
            continue
        a, b = theirs[name], mine[name]
        if name == "data":  # one directory by two spellings is the same data; "" is the stdlib
            if os.path.realpath(a or "") == os.path.realpath(b or "") and bool(a) == bool(b):
                continue
            a, b = (repr(v) if v else "the Python stdlib (no --data)" for v in (a, b))
        elif a == b:
            continue
        told.append(f"{_flag(name)} {b} (the run had {a})")
    return told


def check_resumed_optimizer(cfg: TrainConfig, record: dict[str, Any]) -> None:
    """Raise :class:`ArgumentError` if ``--optimizer`` is not the resumed run's: its state cannot carry
    over. (Its hyperparameters may change: :func:`resume_run` applies the ones given.)"""
    theirs = (record.get("train_config") or {}).get("optimizer")
    if theirs is not None and theirs != cfg.optimizer.name:
        raise ArgumentError(f"--optimizer {cfg.optimizer.name!r}: --resume {cfg.run.resume!r} trained with "
                            f"--optimizer {theirs!r}, whose state cannot load into another optimizer; pass "
                            f"--optimizer {theirs}, or start a new run with --init-from")


def check_resume(cfg: TrainConfig, error: type[MeshTorchError] = MeshTorchError) -> int:
    """The step of ``--resume``'s checkpoint, checked against ``--steps`` before anything runs.

    ``--steps`` is the total the run trains to, so resuming continues from the checkpoint's
    step to ``--steps``; fewer steps than the checkpoint holds is an error.
    """
    from meshtorch.checkpoint.index import read_index

    run = cfg.run
    out = run.out or run.resume
    if run.overwrite and os.path.realpath(run.resume) == os.path.realpath(out):
        raise ArgumentError(f"--overwrite would delete the checkpoint that --resume {run.resume!r} "
                            "continues from; drop --overwrite to continue the run, or pass another --out")
    if not os.path.isdir(os.path.join(run.resume, "checkpoint")):
        holder = lock_holder(run.resume)
        if holder is not None:  # not stopped: running, and not checkpointed yet
            raise error(f"--resume {run.resume!r} is a run still in progress (pid {holder} holds "
                        f"{os.path.join(run.resume, LOCK)}) that has written no checkpoint yet; wait for it "
                        "to finish or stop it, then resume")
        stopped = os.path.exists(os.path.join(run.resume, "metrics.jsonl"))
        raise error(f"--resume {run.resume!r} has no checkpoint/ directory; " + (
            f"its run stopped before its first checkpoint: rerun it in place with --out {run.resume} "
            "--overwrite" if stopped else "pass the --out directory of an earlier run"))
    saved = read_index(os.path.join(run.resume, "checkpoint"))["step"]
    if saved is None:
        raise error(f"the checkpoint in --resume {run.resume!r} records no step; it was not written by "
                    "meshtorch train")
    if run.steps < saved:
        raise ArgumentError(f"--steps {run.steps} is less than step {saved} of the checkpoint in --resume "
                            f"{run.resume!r}: --steps is the total number of steps the run trains to, and "
                            f"a resumed run continues from step {saved}; pass --steps {saved} or more "
                            f"(e.g. --steps {saved + run.steps} to train {run.steps} more)")
    record = recorded(run.resume)
    check_resumed_model(cfg, record)
    check_resumed_optimizer(cfg, record)
    if cfg.model.name != "seq2seq":
        resumed_tokenizer(cfg)
    return saved


@functools.lru_cache(maxsize=8)
def _digest(path: str, stamp: tuple[int, int]) -> str:
    from meshtorch.data.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(path)
    return hashlib.sha256(f"{tok.tok.to_str()}\0{tok.tok.id_to_token(tok.eos)}".encode()).hexdigest()


def tokenizer_digest(path: str) -> str:
    """The sha256 of the tokenizer in ``path`` (``"bytes"``: ``"bytes"``): of what it computes (its
    ``tokenizer.json`` as the ``tokenizers`` library writes it, and its end-of-text token), so a copy
    and its original have the same digest."""
    if path == "bytes":
        return "bytes"
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    st = os.stat(file) if os.path.exists(file) else None  # none: the tokenizer's own error names it
    return _digest(os.path.realpath(path), (st.st_mtime_ns, st.st_size) if st else (0, 0))


def keep_tokenizer(path: str, out: str, write: bool = True) -> str:
    """The run's own copy of tokenizer ``path`` (``out/tokenizer/``; ``"bytes"`` stays ``"bytes"``),
    written there unless it is there already (or ``write`` is false: another process writes it)."""
    if path == "bytes":
        return path
    own = os.path.abspath(os.path.join(out, TOKENIZER_DIR))
    if os.path.realpath(path) == os.path.realpath(own) or not write:
        return own
    from meshtorch.data.hf_tokenizer import FILE, HFTokenizer
    from meshtorch.files import write_atomic

    tok = HFTokenizer(path)
    os.makedirs(own, exist_ok=True)
    write_atomic(os.path.join(own, FILE), tok.tok.to_str(pretty=True).encode())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.tok.id_to_token(tok.eos)}
    write_atomic(os.path.join(own, "tokenizer_config.json"), json.dumps(config, indent=1).encode())
    return own


def is_init_froms_tokenizer(init_from: str, tokenizer: str) -> bool:
    """Whether ``tokenizer`` (a directory, or ``"bytes"``) computes what ``--init-from``'s own
    ``tokenizer.json`` does: only then are the token ids its ``config.json`` names (``eos_token_id``)
    the run's."""
    if not init_from or tokenizer == "bytes" or not os.path.isfile(os.path.join(init_from, "tokenizer.json")):
        return False
    return tokenizer_digest(tokenizer) == tokenizer_digest(init_from)


def tokenizer_record(cfg: TrainConfig) -> dict[str, Any]:
    """What a checkpoint records of the run's tokenizer (``cfg``'s, the run's own copy after
    :func:`keep_tokenizer`): where it is, relative to the run directory, and its digest; for a
    fine-tune, also whether it is ``--init-from``'s own (:func:`is_init_froms_tokenizer`, as
    ``"init_from"``), which says whose end-of-text id a sample stops at."""
    spec, init_from = cfg.run.tokenizer, cfg.run.init_from
    own = {"init_from": is_init_froms_tokenizer(init_from, spec)} if init_from else {}
    if spec == "bytes":
        return {"path": "bytes", **own}
    return {"path": TOKENIZER_DIR, "sha256": tokenizer_digest(spec), **own}


def sample_eos(model: torch.nn.Module, tok: Any, init_from: str, own_tokenizer: bool) -> list[int] | None:
    """The ``eos=`` a sample of the run's ``model`` stops at (``None``: the model config's,
    :func:`~meshtorch.models.decode.stop_ids`): a fine-tune (``init_from``) whose tokenizer is not
    ``--init-from``'s own (``own_tokenizer`` false: ``--tokenizer bytes`` or ``bpe:N``) stops at its
    tokenizer's end-of-text id ``tok.eos``, not at the ids its HF config names, which are
    another vocabulary's; a fine-tune with its own tokenizer, and a run from scratch (whose config
    knows no eos), at the config's."""
    return [tok.eos] if init_from and not own_tokenizer else None


def resumed_tokenizer(cfg: TrainConfig) -> str:
    """The tokenizer ``--resume``'s run trained with: its own copy, found in the run directory (so a
    moved run resumes) and checked against the digest its checkpoint records. An explicit
    ``--tokenizer`` (a directory or ``bytes``) must be that tokenizer (``auto`` is); a ``bpe:N`` to
    fit is refused on a run that trained on bytes (a resumed run fits nothing)."""
    run, spec = cfg.run, cfg.run.tokenizer
    rec = recorded(run.resume).get("tokenizer")
    if rec is None:  # a checkpoint from before the run kept its tokenizer: the path it recorded
        where = (recorded(run.resume).get("train_config") or {}).get("tokenizer") or "bytes"
        beside = os.path.join(run.resume, TOKENIZER_DIR)
        if where != "bytes" and not os.path.exists(where) and os.path.isdir(beside):
            where = beside  # a BPE fitted by the run, in a run directory that was moved
        if where != "bytes" and not os.path.exists(where):
            raise CheckpointError(f"--resume {run.resume!r} trained with --tokenizer {where!r}, which is "
                                  "gone; put it back there")
    else:
        if rec.get("path") not in ("bytes", TOKENIZER_DIR):  # never a path out of the run directory
            raise CheckpointError(f"--resume {run.resume!r} records its tokenizer at {rec.get('path')!r}, "
                                  f"not in its {TOKENIZER_DIR}/; it was not written by meshtorch train")
        where = "bytes" if rec["path"] == "bytes" else os.path.join(run.resume, rec["path"])
        if where != "bytes" and not os.path.exists(where):
            raise CheckpointError(f"--resume {run.resume!r} has lost its tokenizer: {where} is gone; put the "
                                  "run's tokenizer/ back")
        if where != "bytes" and tokenizer_digest(where) != rec["sha256"]:
            raise CheckpointError(f"the tokenizer in {where} is not the one --resume {run.resume!r} trained "
                                  f"with (its sha256 differs from the checkpoint's {rec['sha256'][:12]}...); "
                                  "put the run's tokenizer back")
    what = "bytes" if where == "bytes" else f"its own copy in {where}"
    if spec == "auto" or (spec.startswith("bpe:") and where != "bytes"):
        return where
    if spec.startswith("bpe:") or tokenizer_digest(spec) != tokenizer_digest(where):
        raise ArgumentError(f"--tokenizer {spec!r} is not the tokenizer --resume {run.resume!r} trained with "
                            f"({what}); drop --tokenizer: a resumed run uses the run's tokenizer")
    return where


def resume_run(cfg: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, batches: Any, lead: bool,
               saved: torch.nn.Module | None = None) -> int:
    """Load ``--resume``'s checkpoint into ``model`` (or ``saved``, see :func:`save_run`),
    ``opt`` and ``batches``; return the step to continue from (0 without ``--resume``)."""
    from meshtorch import checkpoint

    if not cfg.run.resume:
        return 0
    # loading restores the saved param groups: put back the ones cfg built (--weight-decay etc. given
    # now), so the options the checkpoint will record are the ones in effect
    given = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    # strict=False: a 2BW run's checkpoint holds W(t-1) (model/previous.*) too, which a run of another
    # schedule ignores; the model itself is the run's (the resume guards compare every config field)
    state = checkpoint.load(os.path.join(cfg.run.resume, "checkpoint"),
                            model=model if saved is None else saved, optimizer=opt, data=batches,
                            strict=False)
    # the hyperparameters that differ (numbers: not fused= and the like, which follow the device)
    changed = sorted({k for g, mine in zip(opt.param_groups, given) for k, v in mine.items()
                      if k != "lr" and isinstance(v, (int, float, tuple)) and not isinstance(v, bool)
                      and g.get(k) != v})
    for g, mine in zip(opt.param_groups, given):
        g.update(mine)
    start = int(state["step"])
    if lead:
        other = other_than_the_run(cfg, recorded(cfg.run.resume))
        print(f"resumed from {cfg.run.resume} at step {start}"
              + (f"; optimizer options now as given: {', '.join(changed)}" if changed else "")
              + (f"; options other than the run's, in effect from here: {', '.join(other)}" if other else ""))
        note = resume_note(cfg)
        if note:
            print(note)
    return start


def save_run(cfg: TrainConfig, out: str, model: torch.nn.Module, opt: torch.optim.Optimizer, batches: Any,
             step: int, saved: torch.nn.Module | None = None, background: bool = False) -> None:
    """Write a new version of ``out/checkpoint`` at ``step`` (the step the run is at; ``--keep``
    versions are kept); ``saved`` (default ``model``) is the module whose parameters
    are written, e.g. one that holds ``model``'s under the same names and more besides.
    ``background``: write the files on a thread (``mt.save(..., background=True)``)."""
    from meshtorch import checkpoint

    check_weights(model if saved is None else saved, step)  # never a checkpoint of NaN weights
    extra = {"model_config": model.cfg.to_dict(), "train_config": cfg.options(), "model": cfg.model.name,
             "tokenizer": tokenizer_record(cfg)}
    checkpoint.save(os.path.join(out, "checkpoint"), model=model if saved is None else saved, optimizer=opt,
                    step=step, data=batches, extra=extra, keep=cfg.run.keep, background=background)


def earlier_metrics(cfg: TrainConfig, out: str, start: int) -> list[dict]:
    """Create ``out``; return the ``--resume`` run's metrics records up to step ``start``."""
    os.makedirs(out, exist_ok=True)
    resume = cfg.run.resume
    path = os.path.join(resume or "", "metrics.jsonl")
    if not resume or not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    records = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line) if line.strip() else None
        except ValueError as e:
            if i == len(lines) - 1:  # no newline after it: cut short by a crash while it was written
                break
            raise MeshTorchError(f"{path} line {i + 1} is not a JSON record ({e}); fix or delete that "
                                 "line to resume") from e
        if rec is None:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise MeshTorchError(f"{path} line {i + 1} is not a metrics record with an integer 'step': "
                                 f"{line[:80]!r}; fix or delete that line to resume")
        if rec["step"] <= start:
            records.append(rec)
    return records


def json_text(record: dict[str, Any], path: str, indent: int | None = None) -> str:
    """``record`` as strict JSON for ``path`` (``metrics.jsonl``, ``summary.json``): a NaN or an
    infinity, which ``json.dumps`` would write as the non-JSON ``NaN``, is an error naming the field.

    Example:
        >>> json_text({"step": 2, "loss": 1.5}, "metrics.jsonl")
        '{"step": 2, "loss": 1.5}'
    """
    try:
        return json.dumps(record, indent=indent, allow_nan=False)
    except ValueError:
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        raise TrainingError(f"{path}: the record {record!r} has fields {bad} that are not finite numbers, "
                            "which JSON cannot hold; not writing it") from None


def start_metrics(cfg: TrainConfig, out: str, start: int) -> list[dict]:
    """:func:`earlier_metrics`, also written as ``out/metrics.jsonl`` (the records after ``start``, which
    the resumed run logs again, dropped) through a temporary file: a run that fails or is killed
    meanwhile leaves the old file or the new one, never an empty one."""
    from meshtorch.files import write_atomic

    path = os.path.join(out, "metrics.jsonl")
    records = earlier_metrics(cfg, out, start)
    write_atomic(path, "".join(json_text(m, path) + "\n" for m in records).encode())
    return records
