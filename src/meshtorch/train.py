"""``meshtorch train``: a Transformer trained data- and model-parallel on text.

:func:`train` runs one SPMD program per processor (``mt.launch``): build the
model from the seed, read this processor's part of each batch, step the
optimizer, log, evaluate held-out loss against the byte-unigram entropy,
checkpoint, and print a generated sample. Processor 0 writes ``--out``:
``checkpoint/``, ``metrics.jsonl``, ``summary.json`` and ``loss.png`` (when
matplotlib is installed).

Example:
    >>> from meshtorch.train import TrainConfig, check_config
    >>> check_config(TrainConfig(mesh="b:2,m:2", rules="batch:b; heads:m; vocab:m"))
    >>> try:
    ...     check_config(TrainConfig(mesh="b:2,m:2", rules="heads:m", heads=3))
    ... except Exception as e:
    ...     print(type(e).__name__)
    LayoutError
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from meshtorch.context import current
from meshtorch.data import ByteTokenizer, Corpus, LMBatches
from meshtorch.errors import LayoutError, MeshError, MeshTorchError
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh
from meshtorch.models import DecoderLM, TransformerConfig, generate

MODELS = ("lm", "seq2seq", "moe")
OPTIMIZERS = ("adamw", "adafactor")
PRECISIONS = ("fp32", "bf16")
# dims the models use besides the TransformerConfig ones: layout rules may name these too
DATA_DIMS = ("batch", "length", "memory_length", "positions")


# The model's options are TransformerConfig's own fields (name, type, default), so that a field
# added to the model config becomes a flag and a TOML key without being listed twice. Left out:
# what the run decides (vocab: the tokenizer's; max_length: from --length) and the free-form extra.
RUN_DECIDES = ("vocab", "max_length", "extra")
# Defaults that differ for training: encoder and expert counts only apply to --model seq2seq / moe,
# so they default to something that makes those models real rather than TransformerConfig's 0.
TRAIN_DEFAULTS = {"encoder_layers": 2, "experts": 4}
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(TransformerConfig) if f.name not in RUN_DECIDES)

ModelOptions = dataclasses.make_dataclass(
    "ModelOptions",
    [(f.name, f.type, dataclasses.field(default=TRAIN_DEFAULTS.get(f.name, f.default)))
     for f in dataclasses.fields(TransformerConfig) if f.name in MODEL_FIELDS],
    namespace={"__doc__": "The model options of ``meshtorch train``: :class:`TransformerConfig`'s fields."},
)
ModelOptions.__module__ = __name__


@dataclass
class TrainConfig(ModelOptions):
    """Every option of ``meshtorch train`` (flags and ``--config`` TOML keys use these names).

    The model options (``d_model``, ``heads``, ``d_kv``, ``d_ff``, ``layers``, ``encoder_layers``,
    ``positions``, ``norm``, ``activation``, ``experts``, ``top_k``, ...) are the fields of
    :class:`~meshtorch.models.TransformerConfig` with its defaults, except ``encoder_layers=2``
    and ``experts=4`` (used only by ``--model seq2seq`` / ``moe``).

    Example:
        >>> from meshtorch.train import TrainConfig
        >>> cfg = TrainConfig(model="moe", d_model=64, activation="relu")
        >>> m = cfg.model_config(vocab=264)
        >>> m.d_model, m.activation, m.experts, m.encoder_layers, m.max_length
        (64, 'relu', 4, 0, 64)
    """

    model: str = "lm"
    mesh: str = "b:2"
    rules: str = "batch:b"
    backend: str = "threads"
    steps: int = 600
    batch: int = 16
    length: int = 64
    precision: str = "fp32"
    lr: float = 3e-3
    warmup: int = 50
    lr_schedule: str = "cosine"
    weight_decay: float = 0.01
    optimizer: str = "adamw"
    clip: float = 1.0
    out: str | None = None
    resume: str | None = None
    data: str | None = None
    seed: int = 0
    log_every: int = 10
    eval_batches: int = 8
    checkpoint_every: int = 0
    sample_tokens: int = 160
    prompt: str = "def "
    temperature: float = 0.8
    progress: bool = True
    # pipeline parallelism (meshtorch.pipeline): stages along a 'stage' mesh axis
    pipeline_stages: int = 1
    microbatches: int = 4
    schedule: str = "1f1b"

    def model_config(self, vocab: int) -> TransformerConfig:
        """The :class:`TransformerConfig` of this run's model over ``vocab`` token ids."""
        opts = {name: getattr(self, name) for name in MODEL_FIELDS}
        opts["encoder_layers"] = self.encoder_layers if self.model == "seq2seq" else 0
        opts["experts"] = self.experts if self.model == "moe" else 0
        return TransformerConfig(vocab=vocab, max_length=max(self.length, 8), **opts)


def check_config(cfg: TrainConfig, vocab: int = ByteTokenizer().vocab_size, world: int | None = None) -> None:
    """Raise before training if the flags cannot work together, naming the fix."""
    if cfg.model not in MODELS:
        raise MeshTorchError(f"--model {cfg.model!r} is not one of {MODELS}")
    if cfg.optimizer not in OPTIMIZERS:
        raise MeshTorchError(f"--optimizer {cfg.optimizer!r} is not one of {OPTIMIZERS}")
    if cfg.lr_schedule not in ("cosine", "constant"):
        raise MeshTorchError(f"--lr-schedule {cfg.lr_schedule!r} is not 'cosine' or 'constant'")
    if cfg.schedule not in ("gpipe", "1f1b", "2bw"):
        hint = (f"; the learning-rate schedule is --lr-schedule {cfg.schedule}"
                if cfg.schedule in ("cosine", "constant") else "")
        raise MeshTorchError(f"--schedule {cfg.schedule!r} is not a pipeline schedule ('gpipe', '1f1b', "
                             f"'2bw'; used with --pipeline-stages > 1){hint}")
    if cfg.precision not in PRECISIONS:
        raise MeshTorchError(f"--precision {cfg.precision!r} is not one of {PRECISIONS}")
    for name in ("steps", "batch", "length", "log_every"):
        if getattr(cfg, name) < 1:
            raise MeshTorchError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    mesh, rules = Mesh(cfg.mesh), LayoutRules(cfg.rules)
    rules.check(mesh)
    if world is not None and world != mesh.size:
        raise MeshError(f"--mesh {cfg.mesh!r} has {mesh.size} processors but {world} processes are "
                        f"running; start {mesh.size} processes or pass a mesh of {world} processors")
    mcfg = cfg.model_config(vocab)
    sizes = {"batch": cfg.batch, "length": cfg.length, "memory_length": cfg.length,
             "positions": mcfg.max_length, "vocab": vocab, "d_model": cfg.d_model, "heads": cfg.heads,
             "d_kv": cfg.d_kv, "d_ff": cfg.d_ff, "experts": mcfg.experts or 1}
    for dim, axis in rules.rules.items():
        if dim not in sizes:
            raise LayoutError(f"rule '{dim}:{axis}' names dim {dim!r}, which the {cfg.model} model does not "
                              f"have; its dims are {sorted(sizes)}")
        size, n = sizes[dim], mesh.axis_size(axis)
        if size % n:
            flag = {"vocab": "the vocabulary (264 byte ids)"}.get(dim, f"--{dim.replace('_', '-')}")
            raise LayoutError(f"rule '{dim}:{axis}' splits dim {dim!r} of size {size} over axis {axis!r} of "
                              f"size {n}, which does not divide it; change {flag} to a multiple of {n}, "
                              f"or drop the rule")
    if cfg.model == "moe" and cfg.experts < cfg.top_k:
        raise MeshTorchError(f"--experts {cfg.experts} must be >= --top-k {cfg.top_k}")


# ---------------------------------------------------------------- progress and outputs
class Progress:
    """tqdm when installed, else one line rewritten in place (or plain lines when not a tty)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.total, self.n, self.enabled = total, initial, enabled
        self.bar = None
        self.last = 0.0
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stdout)
        except ImportError:
            self.tty = sys.stdout.isatty()

    def update(self, n: int, info: dict[str, str]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
            self.bar.set_postfix(info, refresh=False)
            return
        now = time.time()
        if n < self.total and now - self.last < (0.5 if self.tty else 10.0):
            return
        self.last = now
        width = 24
        done = int(width * n / self.total)
        text = f"[{'#' * done}{'.' * (width - done)}] {n}/{self.total} " + " ".join(
            f"{k}={v}" for k, v in info.items())
        print(("\r" + text) if self.tty else text, end="" if self.tty else "\n", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and getattr(self, "tty", False):
            print()


def plot_losses(path: str, metrics: list[dict], heldout: list[tuple[int, float]], entropy: float) -> bool:
    """Write ``loss.png`` if matplotlib is importable; return whether it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="train loss")
    if heldout:
        ax.plot(*zip(*heldout), "o-", label="held-out loss")
    ax.axhline(entropy, color="gray", ls="--", label="byte-unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / byte")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def matmul_peak_flops() -> float:
    """FLOP/s of a 512×512 fp32 matmul with torch's current threads: the utilisation yardstick."""
    a = torch.randn(512, 512)
    best = 0.0
    for _ in range(3):  # best of three: other work on the machine only slows it down
        t, reps = time.perf_counter(), 0
        while time.perf_counter() - t < 0.1:
            a @ a
            reps += 1
        best = max(best, 2 * 512 ** 3 * reps / (time.perf_counter() - t))
    return best


def step_flops(mcfg: TransformerConfig, tokens: int, length: int, params: int) -> float:
    """Training FLOPs of one step: 6·(matmul params)·tokens plus the attention score products."""
    if mcfg.positions == "learned":
        params -= mcfg.max_length * mcfg.d_model  # a lookup, not a matmul
    if not mcfg.tie_embeddings:
        params -= mcfg.vocab * mcfg.d_model
    attn = 12 * mcfg.layers * mcfg.heads * mcfg.d_kv * length * tokens
    return 6.0 * params * tokens + attn


def default_out() -> str:
    return os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


# ---------------------------------------------------------------- the SPMD program
def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    from meshtorch import optim

    if cfg.optimizer == "adafactor":
        return optim.Adafactor(model, lr=cfg.lr)
    groups = optim.weight_decay_groups(model, cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.99))


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth (or constant with ``lr_schedule="constant"``)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def build_task(cfg: TrainConfig, corpus: Corpus | None, tok: ByteTokenizer):
    """Model, train batches and held-out batches for ``cfg.model`` (on this processor)."""
    mcfg = cfg.model_config(tok.vocab_size)
    if cfg.model == "seq2seq":
        from meshtorch.data.seq2seq import SpellingTask
        from meshtorch.models.seq2seq import EncoderDecoder

        task = SpellingTask(batch=cfg.batch, seed=cfg.seed)
        mcfg = dataclasses.replace(mcfg, max_length=max(task.max_target, task.max_source))
        return EncoderDecoder(mcfg, seed=cfg.seed), task, task.heldout(cfg.eval_batches)
    model = DecoderLM(mcfg, seed=cfg.seed)
    train = LMBatches(corpus.train, cfg.batch, cfg.length, seed=cfg.seed)
    heldout = LMBatches(corpus.heldout, cfg.batch, cfg.length, seed=12345)
    return model, train, heldout


def evaluate(model, heldout, n: int) -> float:
    """Mean loss over ``n`` fixed held-out batches (nats per token)."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(n):
            total += model.loss(*heldout.at(i)).item()
    model.train()
    return total / n


def program(cfg: TrainConfig, corpus: Corpus | None, out: str) -> dict[str, Any]:
    """One processor's part of a training run; processor 0 reports and writes files."""
    from meshtorch import amp, optim

    lead = current().rank == 0
    tok = ByteTokenizer()
    if corpus is None and cfg.model != "seq2seq":
        corpus = Corpus.from_path(cfg.data)  # each process of the torch backend reads its own copy
    model, batches, heldout = build_task(cfg, corpus, tok)
    opt = make_optimizer(cfg, model)
    start = resume_run(cfg, model, opt, batches, lead)
    mcfg = model.cfg
    params = model.num_parameters()
    # the yardstick: every processor's matmul rate measured at once, under the same contention
    comm = current().comm
    peak = comm.all_reduce(torch.tensor([matmul_peak_flops()], dtype=torch.float64), comm.mesh.axis_names,
                           "sum").item()
    tokens = cfg.batch * cfg.length
    flops = step_flops(mcfg, tokens, cfg.length, params)
    metrics_path = os.path.join(out, "metrics.jsonl")
    metrics: list[dict] = []
    if lead:
        metrics = earlier_metrics(cfg, out, start)
        with open(metrics_path, "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in metrics)
        print(f"model {cfg.model}: {params:,} parameters; mesh '{cfg.mesh}' rules '{cfg.rules}' "
              f"backend {cfg.backend}; {cfg.steps} steps of {cfg.batch}x{cfg.length} tokens")
    bar = Progress(cfg.steps, start, lead and cfg.progress)
    precision = amp.autocast(torch.bfloat16) if cfg.precision == "bf16" else None
    window_t, window_steps = time.perf_counter(), 0
    loss_value = float("nan")
    for step in range(start, cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        batch = batches.next()
        if precision is not None:
            with precision:
                loss = model.loss(*batch)
        else:
            loss = model.loss(*batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.clip:
            optim.clip_grad_norm_(model, cfg.clip)
        opt.step()
        window_steps += 1
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            loss_value = loss.item()
            dt = (time.perf_counter() - window_t) / window_steps
            window_t, window_steps = time.perf_counter(), 0
            rec = {"step": done, "loss": round(loss_value, 5), "tokens_per_s": round(tokens / dt, 1),
                   "step_time_s": round(dt, 4), "lr": lr_at(cfg, step),
                   "flop_utilisation": round(flops / dt / peak, 4) if peak else None}
            if lead:
                metrics.append(rec)
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            bar.update(done, {"loss": f"{loss_value:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}",
                              "step": f"{dt * 1e3:.0f}ms", "util": f"{100 * flops / dt / peak:.1f}%"})
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done != cfg.steps:
            save_run(cfg, out, model, opt, batches, done)
    bar.close()
    save_run(cfg, out, model, opt, batches, cfg.steps)
    result = {"steps": cfg.steps, "final_loss": loss_value, "parameters": params, "out": out}
    result.update(report(cfg, model, heldout, corpus, tok, lead))
    if lead:
        hl = [(cfg.steps, result["heldout_loss"])]
        result["loss_png"] = plot_losses(os.path.join(out, "loss.png"), metrics, hl,
                                         result.get("unigram_entropy", float("nan")))
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


def resume_run(cfg, model, opt, batches, lead: bool, saved: torch.nn.Module | None = None) -> int:
    """Load ``--resume``'s checkpoint into ``model`` (or ``saved``, see :func:`save_run`),
    ``opt`` and ``batches``; return the step to continue from (0 without ``--resume``)."""
    from meshtorch import checkpoint

    if not cfg.resume:
        return 0
    state = checkpoint.load(os.path.join(cfg.resume, "checkpoint"), model=model if saved is None else saved,
                            optimizer=opt, data=batches)
    start = int(state["step"])
    if lead:
        print(f"resumed from {cfg.resume} at step {start}")
    return start


def earlier_metrics(cfg, out: str, start: int) -> list[dict]:
    """Create ``out``; return the ``--resume`` run's metrics records up to step ``start``."""
    os.makedirs(out, exist_ok=True)
    if cfg.resume and os.path.exists(os.path.join(cfg.resume, "metrics.jsonl")):
        with open(os.path.join(cfg.resume, "metrics.jsonl")) as f:
            return [m for m in map(json.loads, f) if m["step"] <= start]
    return []


def check_resume(cfg, error: type[MeshTorchError] = MeshTorchError) -> None:
    """Raise ``error`` unless ``--resume`` (if given) is a run directory with a checkpoint."""
    if cfg.resume and not os.path.isdir(os.path.join(cfg.resume, "checkpoint")):
        raise error(f"--resume {cfg.resume!r} has no checkpoint/ directory; pass the --out "
                    "directory of an earlier run")


def launch_run(program, cfg, corpus, out: str) -> dict[str, Any]:
    """Run ``program(cfg, corpus, out)`` on every processor of ``cfg``'s mesh; return
    processor 0's result with the run's ``wall_s`` (torch's thread count is restored after)."""
    from meshtorch.launch import launch

    kwargs: dict[str, Any] = {"mesh": cfg.mesh, "rules": cfg.rules}
    if cfg.backend != "threads":
        kwargs["backend"] = cfg.backend
    t0 = time.time()
    threads = torch.get_num_threads()
    result = launch(program, cfg, corpus, out, **kwargs)[0]
    torch.set_num_threads(threads)
    result["wall_s"] = round(time.time() - t0, 1)
    return result


def save_run(cfg, out, model, opt, batches, step, saved: torch.nn.Module | None = None) -> None:
    """Write ``out/checkpoint``; ``saved`` (default ``model``) is the module whose parameters
    are written, e.g. one that holds ``model``'s under the same names and more besides."""
    from meshtorch import checkpoint

    extra = {"model_config": model.cfg.to_dict(), "train_config": dataclasses.asdict(cfg),
             "model": cfg.model}
    checkpoint.save(os.path.join(out, "checkpoint"), model=model if saved is None else saved, optimizer=opt,
                    step=step, data=batches, extra=extra)


def report(cfg, model, heldout, corpus, tok, lead) -> dict[str, Any]:
    """Held-out evaluation and a generated sample (printed by processor 0)."""
    if cfg.model == "seq2seq":
        from meshtorch.data.seq2seq import exact_match

        # --eval-batches batches of held-out numbers (default 8 x --batch 16 = 128), greedy-decoded
        acc, examples = exact_match(model, heldout, batches=cfg.eval_batches)
        if lead:
            print(f"held-out exact-match accuracy: {acc:.3f} ({len(examples)} numbers)")
            for src, want, got in examples[:3]:
                print(f"  {src!r} -> {got!r} (want {want!r})")
        return {"heldout_accuracy": acc, "heldout_numbers": len(examples),
                "heldout_loss": evaluate(model, heldout, cfg.eval_batches)}
    loss = evaluate(model, heldout, cfg.eval_batches)
    entropy = corpus.unigram_entropy("heldout")
    prompt = [tok.eos] + tok.encode(cfg.prompt)
    new = generate(model, [prompt], cfg.sample_tokens, temperature=cfg.temperature, top_k=40,
                   seed=cfg.seed, limit=tok.eos + 1)[0]
    sample = tok.decode(prompt + new)
    if lead:
        verdict = "learned" if loss <= entropy - 1.0 else "not yet 1 nat/byte below it"
        print(f"held-out loss {loss:.3f} nats/byte vs byte-unigram entropy {entropy:.3f} "
              f"({entropy - loss:+.3f} below: {verdict})")
        print("sample:\n" + "-" * 40 + "\n" + sample + "\n" + "-" * 40)
    return {"heldout_loss": loss, "unigram_entropy": entropy, "sample": sample}


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Check ``cfg``, load the corpus, run the program on every processor; return processor 0's
    summary (``final_loss``, ``heldout_loss``, ``unigram_entropy``, ``sample``, ``out``, ...)."""
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    if cfg.pipeline_stages > 1:
        from meshtorch.pipeline.train import pipeline_mesh, train_pipeline

        cfg = dataclasses.replace(cfg, mesh=pipeline_mesh(cfg.mesh, cfg.pipeline_stages))
        check_config(cfg, world=world)
        return train_pipeline(cfg)
    check_config(cfg, world=world)
    check_resume(cfg)
    out = cfg.out or cfg.resume or default_out()
    # threads share one corpus in memory; torch-backend processes each read it themselves
    corpus = None if cfg.model == "seq2seq" or cfg.backend != "threads" else Corpus.from_path(cfg.data)
    return launch_run(program, cfg, corpus, out)

