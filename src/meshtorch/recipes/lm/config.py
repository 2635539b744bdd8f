"""The options of ``meshtorch train``: one config in four sections (model, parallelism, optimizer, run).

Every option is a typed dataclass field of its section. Flags and ``--config``
TOML keys are the field names (``--d-model``, ``d_model = 256``); a section's
``name`` is its own name (``--model moe``, ``--optimizer adafactor``).
:meth:`TrainConfig.of` builds a config from those flat names.

Example:
    >>> from meshtorch.recipes.lm.config import TrainConfig, check_config
    >>> check_config(TrainConfig.of(mesh="b:2,m:2", rules="batch:b; heads:m; vocab:m"))
    >>> try:
    ...     check_config(TrainConfig.of(mesh="b:2,m:2", rules="heads:m", heads=3))
    ... except Exception as e:
    ...     print(type(e).__name__)
    LayoutError
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from meshtorch.data import ByteTokenizer
from meshtorch.errors import ArgumentError, LayoutError, MeshError, MeshTorchError, PipelineError
from meshtorch.layout import LayoutRules, format_axes
from meshtorch.mesh import Mesh
from meshtorch.models.config import ACTIVATIONS, ATTENTIONS, NORMS, POSITIONS, TransformerConfig
from meshtorch.models.rope import check_rope_scaling

MODELS = ("lm", "seq2seq", "moe")
OPTIMIZERS = ("adamw", "adafactor")
PRECISIONS = ("fp32", "bf16")
LR_SCHEDULES = ("cosine", "constant")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "2bw", "zb", "interleaved", "zbv")
BACKENDS = ("threads", "torch")
TRAIN_DEVICES = ("auto", "cpu", "cuda")
# the flags whose values are one of a few words (argparse's choices=)
CHOICES: dict[str, tuple[str, ...]] = {
    "model": MODELS, "optimizer": OPTIMIZERS, "precision": PRECISIONS, "lr_schedule": LR_SCHEDULES,
    "schedule": PIPELINE_SCHEDULES, "backend": BACKENDS, "device": TRAIN_DEVICES, "positions": POSITIONS,
    "norm": NORMS, "activation": ACTIVATIONS, "attention": ATTENTIONS}
# the range of each numeric option: (lowest, whether the lowest itself is excluded, what a value at
# the bound means where that needs saying); a section's fields are checked when it is built, so the
# command line, --config and TrainConfig.of(...) all get these errors before anything runs
RANGES: dict[str, tuple[float, bool, str]] = {
    "layers": (1, False, ""), "encoder_layers": (1, False, ""), "experts": (1, False, ""),
    "moe_every": (1, False, ""), "top_k": (1, False, ""), "dropout": (0, False, ""), "eps": (0, True, ""),
    "capacity_factor": (0, True, ""), "aux_loss": (0, False, ""),
    "kv_heads": (0, False, " (0: one key/value head per query head)"), "rotary_base": (0, True, ""),
    "padding_id": (-1, False, " (-1: none)"),
    "pipeline_stages": (1, False, " (1: no pipeline)"), "microbatches": (1, False, ""),
    "virtual_stages": (1, False, " (1: one model chunk per stage)"),
    "timeout": (0, True, " seconds"), "max_restarts": (0, False, " (0: a failed worker ends the run)"),
    "nnodes": (1, False, " (1: this node alone)"), "node_rank": (0, False, " (node 0 hosts the rendezvous)"),
    "master_port": (1, False, ""),
    "lr": (0, True, ""), "warmup": (0, False, " steps (0: no warm-up)"), "weight_decay": (0, False, ""),
    "clip": (0, False, " (0 turns clipping off; a negative norm would ascend the gradient)"),
    "steps": (1, False, ""), "batch": (1, False, ""), "length": (1, False, ""), "log_every": (1, False, ""),
    "eval_batches": (1, False, " (the held-out loss is the mean over these batches)"),
    "checkpoint_every": (0, False, " (0: a checkpoint only at the end)"), "sample_tokens": (0, False, ""),
    "temperature": (0, False, " (0: greedy)"), "keep": (1, False, " (checkpoints kept, the newest first)"),
}
BELOW = {"dropout": 1.0, "master_port": 65536}  # options with an upper bound too, which they may not reach


def check_fields(section: Any) -> None:
    """Raise :class:`ArgumentError` naming the flag if a field of ``section`` has the wrong type or
    is out of its range (:data:`RANGES`); every section runs it when built."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        name = _FLAGS.get((type(section), f.name), f.name)
        flag = "--" + name.replace("_", "-")
        kind = str(f.type)
        if kind == "bool" and not isinstance(value, bool):
            raise ArgumentError(f"{flag} must be true or false, got {value!r}")
        if kind in ("int", "float") and (isinstance(value, bool) or not isinstance(
                value, int if kind == "int" else numbers.Real) or not math.isfinite(value)):
            what = "a whole number" if kind == "int" else "a finite number"
            raise ArgumentError(f"{flag} must be {what}, got {value!r}")
        if kind in ("str", "str | None") and not isinstance(value, str) and value is not None:
            raise ArgumentError(f"{flag} must be text, got {value!r}")
        if kind.startswith("dict") and not isinstance(value, dict) and value is not None:
            raise ArgumentError(f"{flag} must be a JSON object (a TOML table in --config), got {value!r}")
        if name not in RANGES:
            continue
        low, strict, note = RANGES[name]
        if value < low or (strict and value == low) or (name in BELOW and value >= BELOW[name]):
            bound = f"{'>' if strict else '>='} {low}" + (f" and < {BELOW[name]}" if name in BELOW else "")
            raise ArgumentError(f"{flag} {value!r} is out of range: it must be {bound}{note}")


# TransformerConfig's fields that the run decides, not a flag: ``vocab`` (the tokenizer's), ``max_length``
# (from --length), ``extra`` (what an imported model carries)
RUN_DECIDES = ("vocab", "max_length", "extra")
# the recipe's defaults where they differ from TransformerConfig's: a --model seq2seq or moe run gets
# encoder blocks and experts without more flags (--model lm uses neither)
MODEL_DEFAULTS: dict[str, Any] = {"encoder_layers": 2, "experts": 4}


def _model_post_init(self: Any) -> None:
    check_fields(self)
    check_rope_scaling(self.rope_scaling, "--rope-scaling")  # with --positions: check_config (--init-from)


def _model_config(self: Any, vocab: int, length: int) -> TransformerConfig:
    """The :class:`TransformerConfig` of this model over ``vocab`` ids and sequences of ``length``."""
    opts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}
    opts["encoder_layers"] = self.encoder_layers if self.name == "seq2seq" else 0
    opts["experts"] = self.experts if self.name == "moe" else 0
    return TransformerConfig(vocab=vocab, max_length=max(length, 8), **opts)


_MODEL_DOC = """The model: ``name`` (``--model``) and :class:`~meshtorch.models.TransformerConfig`'s fields.

    The fields are derived from ``TransformerConfig``'s (same names, types and defaults, in its
    order), except the defaults of :data:`MODEL_DEFAULTS` (``encoder_layers=2`` and ``experts=4``,
    which only ``--model seq2seq`` / ``moe`` use) and the fields the run decides
    (:data:`RUN_DECIDES`: ``vocab`` is the tokenizer's, ``max_length`` comes from ``--length``).

    Example:
        >>> ModelSection(name="moe", d_model=64).config(vocab=264, length=32).experts
        4
        >>> [f.name for f in dataclasses.fields(ModelSection)][:5]
        ['name', 'd_model', 'heads', 'd_kv', 'd_ff']
    """
# derived, not repeated: a field TransformerConfig gains is a flag of meshtorch train at once
ModelSection = dataclasses.make_dataclass(
    "ModelSection",
    [("name", "str", field(default="lm"))] + [
        (f.name, f.type, field(default=MODEL_DEFAULTS.get(f.name, f.default)))
        for f in dataclasses.fields(TransformerConfig) if f.name not in RUN_DECIDES],
    namespace={"__module__": __name__, "__post_init__": _model_post_init, "config": _model_config,
               "__doc__": _MODEL_DOC})


AXIS = "stage"  # the mesh axis a pipelined run's stages lie along
# --rules auto (and --mesh auto[:N]): meshtorch train's planner search picks them when the run starts
AUTO = "auto"


def pipeline_mesh(mesh: Mesh | str, stages: int) -> Mesh:
    """``mesh`` with a ``stage:<stages>`` axis in front, unless it has a ``stage`` axis of that size.

    Example:
        >>> str(pipeline_mesh("b:2", 2)), str(pipeline_mesh("b:2,stage:2", 2))
        ('stage:2,b:2', 'b:2,stage:2')
    """
    m = Mesh(mesh)
    if AXIS in m.axis_names:
        if m.axis_size(AXIS) != stages:
            raise PipelineError(f"--mesh '{m}' has a {AXIS!r} axis of size {m.axis_size(AXIS)} but "
                                f"--pipeline-stages is {stages}; make them equal or drop the axis")
        return m
    return Mesh(((AXIS, stages), *m.axes))


@dataclass(frozen=True)
class Parallelism:
    """``--mesh``, ``--rules`` and ``--pipeline-stages`` parsed: the run's whole mesh (a pipelined
    run's with its ``stage`` axis) and its layout rules.

    :class:`ParallelismSection` builds it once, when the config is built, and every later step of
    ``meshtorch train`` (the checks, the memory check's trace, joining the torch world, the launch)
    takes these objects: no one parses the strings again, and no one can use the mesh without its
    stage axis by mistake.

    Example:
        >>> p = TrainConfig.of(mesh="b:2", rules="batch:b", pipeline_stages=2).parallelism.parsed
        >>> p.mesh, p.mesh.size, p.rules, p.stage_mesh
        (Mesh('stage:2,b:2'), 4, LayoutRules('batch:b'), Mesh('b:2'))
    """

    mesh: Mesh
    rules: LayoutRules

    @property
    def stage_mesh(self) -> Mesh:
        """The mesh one pipeline stage's layers are split over: :attr:`mesh` without the stage axis."""
        return Mesh([(a, n) for a, n in self.mesh.axes if a != AXIS])


@dataclass
class ParallelismSection:
    """Where the run's processors are and how tensors and layers are split over them;
    :attr:`parsed` holds the mesh and the rules parsed (:class:`Parallelism`)."""

    mesh: str = "b:2"
    rules: str = "batch:b"
    backend: str = "threads"
    # auto: a GPU per processor when this machine has enough, else the CPU
    device: str = "auto"
    # pipeline parallelism: stages along a 'stage' mesh axis
    pipeline_stages: int = 1
    microbatches: int = 4
    schedule: str = "1f1b"
    # model chunks per stage (--schedule interleaved): chunk c of p·v on stage c mod p
    virtual_stages: int = 1
    # seconds a collective waits for the other processors before the run fails
    timeout: float = 300.0
    # --backend torch: when a worker fails, every worker starts again from the last checkpoint, this often
    max_restarts: int = 0
    # --backend torch across nodes (as meshtorch launch's flags): each node runs mesh size / nnodes of the
    # processors, node 0 at --master-addr:--master-port hosts torchrun's static rendezvous
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500
    # parameters' collectives grouped in buckets and overlapped with compute (mt.overlap), as the planner
    # traces and prices it (plan/timeline.py); --no-overlap: one blocking collective per use
    overlap: bool = True
    # with overlap: free gathered parameters (FSDP-style rules) after their forward use and gather them
    # again in backward, FSDP2's default: the step's peak stays at or below the per-use path's, which
    # keeps every gathered value a matmul saves until backward; --no-reshard-after-forward keeps them
    # (fewer bytes, more memory)
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        check_fields(self)
        self._parsed = self._parse()  # their own syntax errors now, naming the axis or rule

    def _parse(self) -> tuple[tuple[str, str, int], Parallelism]:
        if self.auto_mesh:
            if not self.auto_rules:
                raise ArgumentError(f"--mesh {self.mesh} is picked with its rules: pass --rules auto too, or "
                                    "an explicit --mesh for these --rules")
            count = self.mesh.strip().removeprefix(AUTO).removeprefix(":")
            if count and not (count.isdigit() and int(count) > 0):
                raise ArgumentError(f"--mesh {self.mesh!r}: auto:N takes a processor count N >= 1, "
                                    "e.g. auto:4")
        mesh = Mesh("" if self.auto_mesh else self.mesh)
        if self.pipeline_stages > 1:
            mesh = pipeline_mesh(mesh, self.pipeline_stages)
        # --rules auto has no rules yet (meshtorch train's search picks them): the mesh alone is checked
        rules = LayoutRules("" if self.auto_rules else self.rules)
        return (self.mesh, self.rules, self.pipeline_stages), Parallelism(mesh, rules)

    @property
    def auto_mesh(self) -> bool:
        """Whether ``--mesh auto`` (torchrun's processors) or ``--mesh auto:N`` (``N`` processors)
        leaves the mesh to the planner's search, with ``--rules auto``."""
        text = self.mesh.strip()
        return text == AUTO or text.startswith(AUTO + ":")

    @property
    def processors(self) -> int | None:
        """The processors of the run: the mesh's (with its stage axis), ``N`` of ``--mesh auto:N``, or
        None for ``--mesh auto`` (the processes torchrun starts)."""
        if self.auto_mesh:
            count = self.mesh.strip().removeprefix(AUTO).removeprefix(":")
            return int(count) if count else None
        return self._current().mesh.size

    @property
    def auto_rules(self) -> bool:
        """Whether ``--rules auto`` leaves the rules to the planner's search when the run starts
        (:func:`meshtorch.recipes.lm.plan_cli.choose_rules`)."""
        return self.rules.strip() == AUTO

    @property
    def parsed(self) -> Parallelism:
        """The mesh (with the stage axis when pipelined) and the rules, parsed when the section was built.

        ``--rules auto`` has none until :func:`~meshtorch.recipes.lm.plan_cli.choose_rules` replaces it
        by the rules it picks; reading them before is an error, so nothing runs on rules no one chose.
        """
        if self.auto_rules or self.auto_mesh:
            raise ArgumentError("--rules auto is resolved by meshtorch train when it starts (the planner's "
                                "search picks the rules for --mesh); here pass explicit rules (meshtorch "
                                "plan with the same flags runs that search and prints what it would pick)")
        return self._current()

    def _current(self) -> Parallelism:
        if self._parsed[0] != (self.mesh, self.rules, self.pipeline_stages):  # a field set since
            self._parsed = self._parse()
        return self._parsed[1]


@dataclass
class OptimizerSection:
    """The optimizer (``name``: ``--optimizer``), its learning-rate schedule and gradient clipping."""

    name: str = "adamw"
    lr: float = 3e-3
    warmup: int = 50
    lr_schedule: str = "cosine"
    weight_decay: float = 0.01
    clip: float = 1.0  # the global gradient norm's bound; 0: no clipping

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class RunSection:
    """Steps, batches, data, outputs, evaluation and the sample."""

    steps: int = 400
    batch: int = 16
    length: int = 64
    precision: str = "fp32"
    # torch.compile each step's forward (and so its backward); the optimizer step stays eager
    compile: bool = False
    seed: int = 0
    data: str | None = None
    out: str | None = None
    resume: str | None = None
    log_every: int = 10
    tensorboard: bool = False
    eval_batches: int = 8
    checkpoint_every: int = 0
    keep: int = 2
    # --checkpoint-every's saves write their files on a thread while the steps go on
    async_checkpoint: bool = False
    sample_tokens: int = 160
    prompt: str = "def "
    temperature: float = 0.8
    progress: bool = True
    overwrite: bool = False
    memory_check: bool = True
    # GiB one processor may use (0: what its device has free); what the memory check compares with
    memory_budget: float = 0.0
    # from Hugging Face: a model directory to fine-tune (its config.json sets the model), a tokenizer
    init_from: str | None = None
    tokenizer: str = "auto"
    # --resume: model fields (flag names, comma-separated) that may differ from the run's record
    allow_change: str = ""

    def __post_init__(self) -> None:
        check_fields(self)


SECTIONS = {"model": ModelSection, "parallelism": ParallelismSection, "optimizer": OptimizerSection,
            "run": RunSection}


def _flat_names() -> dict[str, tuple[str, str]]:
    """Flag / TOML name -> (section, field); a section's ``name`` is called by the section."""
    names: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            names[section if f.name == "name" else f.name] = (section, f.name)
    return names


OPTIONS = _flat_names()
_FLAGS = {(SECTIONS[section], attr): name for name, (section, attr) in OPTIONS.items()}


def _per_section(options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Options by flag name -> each section's field values."""
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, value in options.items():
        if name not in OPTIONS:
            raise MeshTorchError(f"unknown option {name!r} of meshtorch train; known: {sorted(OPTIONS)}")
        section, attr = OPTIONS[name]
        per_section[section][attr] = value
    return per_section


def _changes(section: Any, values: dict[str, Any]) -> bool:
    """Whether setting ``values`` changes ``section`` (a value of another type is a change: its
    section's checks see it)."""
    return any(type(v) is not type(old := getattr(section, k)) or v != old for k, v in values.items())


@dataclass
class TrainConfig:
    """Every option of ``meshtorch train``, in sections as torchtitan's JobConfig.

    Example:
        >>> cfg = TrainConfig.of(model="moe", d_model=64, activation="relu")
        >>> m = cfg.model_config(vocab=264)
        >>> m.d_model, m.activation, m.experts, m.encoder_layers, m.max_length
        (64, 'relu', 4, 0, 64)
        >>> cfg.replace(steps=3).run.steps, cfg.optimizer.name
        (3, 'adamw')
    """

    model: ModelSection = field(default_factory=ModelSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    run: RunSection = field(default_factory=RunSection)

    @classmethod
    def of(cls, **options: Any) -> TrainConfig:
        """The defaults with ``options`` (flag names: ``d_model``, ``model``, ``steps``, ...) set."""
        # each section built once, from its options: its mesh and rules parsed once
        return cls(**{s: SECTIONS[s](**kw) for s, kw in _per_section(options).items()})

    def replace(self, **options: Any) -> TrainConfig:
        """A copy with ``options`` (flag names) set."""
        # a section without a change (no option, or each one's value as it is) is kept as it is: its
        # parsed mesh and rules with it
        return TrainConfig(**{s: dataclasses.replace(getattr(self, s), **kw) if _changes(getattr(self, s), kw)
                              else getattr(self, s) for s, kw in _per_section(options).items()})

    def options(self) -> dict[str, Any]:
        """Every option by its flag name (what a checkpoint records and ``--config`` reads)."""
        return {name: getattr(getattr(self, s), attr) for name, (s, attr) in OPTIONS.items()}

    def model_config(self, vocab: int) -> TransformerConfig:
        """The :class:`TransformerConfig` of this run's model over ``vocab`` token ids."""
        return self.model.config(vocab, self.run.length)


def model_dims(cfg: TrainConfig, vocab: int) -> dict[str, int]:
    """Every dim name the model of ``cfg`` uses, with its size: what layout rules may split.

    Example:
        >>> sorted(model_dims(TrainConfig.of(model="moe", positions="rotary"), vocab=264))
        ['batch', 'd_ff', 'd_kv', 'd_model', 'experts', 'heads', 'length', 'memory_length', 'vocab']
    """
    run, model = cfg.run, cfg.model
    dims = {"batch": run.batch, "length": run.length, "memory_length": run.length, "d_model": model.d_model,
            "heads": model.heads, "d_kv": model.d_kv, "d_ff": model.d_ff, "vocab": vocab}
    if model.positions == "learned":
        dims["positions"] = max(run.length, 8)
    if model.name == "moe":
        dims["experts"] = model.experts
    if model.kv_heads:
        dims["kv_heads"] = model.kv_heads
    return dims


def check_layout(cfg: TrainConfig, vocab: int, mesh: Mesh | str | None = None,
                 rules: LayoutRules | str | None = None) -> None:
    """Raise :class:`LayoutError` unless every rule names a dim of the model that its axis divides
    (on ``cfg``'s parsed mesh and rules unless ``mesh`` and ``rules`` are given)."""
    parsed = cfg.parallelism.parsed
    m = parsed.mesh if mesh is None else Mesh(mesh)
    r = parsed.rules if rules is None else LayoutRules(rules)
    r.check(m)
    dims = model_dims(cfg, vocab)
    for dim, axes in r.rules.items():
        axis = format_axes(axes)
        if dim not in dims:
            raise LayoutError(f"rule '{dim}:{axis}' names dim {dim!r}, which the {cfg.model.name} model does "
                              f"not have; its dims are {sorted(dims)}")
        size, n = dims[dim], r.pieces(dim, m)
        if size % n:
            what = f"the vocabulary ({vocab} ids)" if dim == "vocab" else f"--{dim.replace('_', '-')}"
            raise LayoutError(f"rule '{dim}:{axis}' splits dim {dim!r} of size {size} over axis {axis!r} of "
                              f"size {n}, which does not divide it; change {what} to a multiple of {n}, "
                              f"change the mesh, or drop the rule")


def check_stages(cfg: TrainConfig) -> None:
    """Raise :class:`PipelineError` naming the flag unless ``--pipeline-stages``, ``--virtual-stages``,
    ``--schedule``, ``--microbatches`` and ``--layers`` make a pipeline: ``p·v`` model chunks of
    ``--layers / (p·v)`` blocks each, virtual stages only under the interleaved schedule, whose
    micro-batches go through the chunks in rounds of ``p``, and ZB-V's (two per stage).

    Example:
        >>> check_stages(TrainConfig.of(pipeline_stages=2, virtual_stages=2, schedule="interleaved",
        ...                             layers=8))
        >>> try:
        ...     check_stages(TrainConfig.of(pipeline_stages=2, virtual_stages=2, schedule="interleaved",
        ...                                 layers=6))
        ... except PipelineError as e:
        ...     print(str(e)[:80])
        --layers 6 do not divide into --pipeline-stages 2 × --virtual-stages 2 = 4 model
    """
    par, layers = cfg.parallelism, cfg.model.layers
    p, v, m = par.pipeline_stages, par.virtual_stages, par.microbatches
    if p == 1:
        if v > 1:
            raise PipelineError(f"--virtual-stages {v} splits each pipeline stage into chunks: it needs "
                                "--pipeline-stages > 1 (and --schedule interleaved)")
        return
    if par.schedule == "zbv" and v != 2:
        raise PipelineError(f"--schedule zbv places 2 model chunks on each stage (a V): it needs "
                            f"--virtual-stages 2, got {v}")
    if v > 1 and par.schedule not in ("interleaved", "zbv"):
        raise PipelineError(f"--virtual-stages {v} needs --schedule interleaved (or zbv, with 2) (--schedule "
                            f"{par.schedule} runs one model chunk per stage); or drop --virtual-stages")
    if par.schedule == "interleaved" and m % p:
        raise PipelineError(f"--schedule interleaved sends micro-batches through the chunks in rounds of "
                            f"--pipeline-stages {p}: --microbatches {m} must be a multiple of {p}")
    if layers < p * v or (v > 1 and layers % (p * v)):
        want = f"a multiple of {p * v}" if v > 1 else f"at least {p}"
        raise PipelineError(f"--layers {layers} do not divide into --pipeline-stages {p} × --virtual-stages "
                            f"{v} = {p * v} model chunks of equal depth; use --layers {want}, or fewer "
                            "stages or virtual stages")
    # each processor cuts its own rows of the batch into the micro-batches
    parsed, batch = par.parsed, cfg.run.batch
    pieces = parsed.rules.pieces("batch", parsed.mesh)
    rows = batch // pieces
    if rows % m:
        split = f" split over {pieces} processors by --rules" if pieces > 1 else ""
        # a value the checks above accept too: under interleaved, a multiple of the stages
        rounds = p if par.schedule == "interleaved" else 1
        fit = [k for k in range(1, rows + 1) if rows % k == 0 and k % rounds == 0]
        fits = max([k for k in fit if k <= m], default=min(fit, default=0))
        what = f"a divisor of {rows}" + (f" and a multiple of --pipeline-stages {p}" if rounds > 1 else "")
        micro = f"--microbatches {fits} ({what}), or " if fits else ""
        raise PipelineError(f"--batch {batch}{split} gives each processor {rows} sequences, which "
                            f"--microbatches {m} does not divide; pass {micro}--batch a multiple of "
                            f"{m * pieces}")


def check_nodes(cfg: TrainConfig) -> None:
    """Raise :class:`ArgumentError` (:class:`MeshError` for the mesh) naming the flag unless ``--nnodes``,
    ``--node-rank``, ``--master-addr`` and ``--master-port`` describe one node of a multi-node run: the
    torch backend, a node rank below ``--nnodes``, a mesh the nodes share equally, node 0's address, and
    one ``--out`` for all nodes (a shared filesystem: every processor writes its slices of the checkpoint
    there, :mod:`meshtorch.recipes.lm.nodes`).

    Example:
        >>> check_nodes(TrainConfig.of(backend="torch", mesh="b:4", nnodes=2, node_rank=1,
        ...                            master_addr="10.0.0.1", out="/shared/run"))
        >>> try:
        ...     check_nodes(TrainConfig.of(backend="torch", mesh="b:4", nnodes=2, node_rank=2,
        ...                                master_addr="10.0.0.1", out="/shared/run"))
        ... except ArgumentError as e:
        ...     print(e)
        --node-rank 2 is not a node of --nnodes 2: the nodes are numbered 0 to 1
    """
    par = cfg.parallelism
    n, r = par.nnodes, par.node_rank
    if n == 1:
        given = [flag for flag, value in (("--node-rank", par.node_rank), ("--master-addr", par.master_addr))
                 if value]
        if given:
            raise ArgumentError(f"{' and '.join(given)} place this node in a run of several nodes: pass "
                                "--nnodes N (the number of nodes) with --backend torch, or drop "
                                f"{'them' if len(given) > 1 else 'it'}")
        return
    if par.backend != "torch":
        raise ArgumentError(f"--nnodes {n} starts processes on {n} nodes; --backend {par.backend}'s "
                            "processors are threads of this one process: add --backend torch")
    if r >= n:
        raise ArgumentError(f"--node-rank {r} is not a node of --nnodes {n}: the nodes are numbered 0 to "
                            f"{n - 1}")
    size = par.processors
    if size is not None and size % n:
        raise MeshError(f"--mesh {par.mesh!r} has {size} processors, which --nnodes {n} nodes cannot share "
                        "equally (each node runs mesh size / --nnodes of them); pass a mesh of a multiple of "
                        f"{n} processors or another --nnodes")
    if not par.master_addr:
        raise ArgumentError(f"--nnodes {n} needs --master-addr: the address of node 0 (--node-rank 0 hosts "
                            "the rendezvous), the same on every node and reachable from each, e.g. "
                            "--master-addr 10.0.0.1")
    if par.max_restarts:
        raise ArgumentError(f"--max-restarts {par.max_restarts} restarts the workers of one node; across "
                            f"--nnodes {n} the other nodes' workers would not restart with them: drop "
                            "--max-restarts, and continue a stopped run with --resume")
    if not (cfg.run.out or cfg.run.resume):
        raise ArgumentError(f"--nnodes {n} needs --out: the run's directory, the same path on every node, "
                            "on a filesystem every node mounts (processor 0 writes the run's files there "
                            "and every processor writes its slices of the checkpoint)")


def check_model_flags(cfg: TrainConfig) -> None:
    """Refuse model flags that contradict each other, in the flags' words (before anything builds the
    model's config, whose own error would name its fields instead).

    Example:
        >>> from meshtorch.recipes.lm import TrainConfig
        >>> try:
        ...     check_model_flags(TrainConfig.of(model="moe", experts=1, top_k=2))
        ... except Exception as e:
        ...     print(e)
        --experts 1 must be >= --top-k 2
    """
    if cfg.model.name == "moe" and cfg.model.experts < cfg.model.top_k:
        raise MeshTorchError(f"--experts {cfg.model.experts} must be >= --top-k {cfg.model.top_k}")
    heads, kv = cfg.model.heads, cfg.model.kv_heads
    if kv and heads % kv:
        small = [d for d in range(1, math.isqrt(heads) + 1) if heads % d == 0]
        divisors = ", ".join(str(d) for d in sorted({*small, *(heads // d for d in small)}))
        raise ArgumentError(f"--kv-heads {kv} must divide --heads {heads} (each key/value head serves "
                            f"--heads / --kv-heads query heads): pass one of {divisors}, or --kv-heads 0 "
                            "for plain multi-head attention")
    pad = ByteTokenizer.pad
    if cfg.model.name == "seq2seq" and cfg.model.padding_id not in (-1, pad):
        # EncoderDecoder masks out the source padding id, which is its padding_id when set
        raise ArgumentError(f"--padding-id {cfg.model.padding_id}: --model seq2seq's spelling task pads "
                            f"with id {pad} (the bytes tokenizer's pad), which the encoder masks out; its "
                            f"padding id is that one: pass --padding-id {pad} (its lookups then train "
                            "nothing) or drop it")
    if cfg.model.name == "moe" and cfg.model.layers < cfg.model.moe_every:
        layers, every = cfg.model.layers, cfg.model.moe_every
        raise ArgumentError(f"--model moe with --layers {layers} has no MoE layer: under --moe-every {every} "
                            f"the blocks {every}, {2 * every}, ... are; pass --layers {every} or more, or "
                            f"--moe-every {layers}")


def check_config(cfg: TrainConfig, vocab: int = 264, world: int | None = None) -> None:
    """Raise before training if the options cannot work together, naming the fix."""
    for name, allowed in CHOICES.items():
        section, attr = OPTIONS[name]
        value = getattr(getattr(cfg, section), attr)
        if value in allowed:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "schedule":
            hint = f"; the learning-rate schedule is --lr-schedule {value}" if value in LR_SCHEDULES else ""
            raise MeshTorchError(f"--schedule {value!r} is not a pipeline schedule "
                                 f"({', '.join(map(repr, PIPELINE_SCHEDULES))}; used with "
                                 f"--pipeline-stages > 1){hint}")
        if name == "lr_schedule":
            raise MeshTorchError(f"--lr-schedule {value!r} is not 'cosine' or 'constant'")
        if section == "model" and name != "model":
            cfg.model_config(vocab)  # the model config's own error, e.g. activation='tanh'
        raise MeshTorchError(f"{flag} {value!r} is not one of {allowed}")
    if cfg.model.rope_scaling is not None and cfg.model.positions != "rotary":
        raise ArgumentError(f"--rope-scaling rescales rotary positions, but --positions is "
                            f"{cfg.model.positions!r}; add --positions rotary or drop --rope-scaling")
    par, mesh = cfg.parallelism, cfg.parallelism.parsed.mesh
    if world is not None and world != mesh.size:
        staged, want = "", f"a --mesh of {world} processors"
        if par.pipeline_stages > 1:
            stages = par.pipeline_stages
            staged = f" (with the {AXIS!r} axis of --pipeline-stages {stages}: '{mesh}')"
            want = (f"a --mesh of {world // stages} processors besides the {AXIS!r} axis"
                    if world % stages == 0 else f"a --mesh and --pipeline-stages that make {world}")
        raise MeshError(f"--mesh {par.mesh!r}{staged} has {mesh.size} processors but {world} processes "
                        f"are running; start {mesh.size} processes or pass {want}")
    check_layout(cfg, vocab)
    check_nodes(cfg)
    if par.max_restarts and par.backend != "torch":
        raise ArgumentError(f"--max-restarts {par.max_restarts} restarts the worker processes from the last "
                            f"checkpoint when one fails; --backend {par.backend}'s processors are threads of "
                            "this one process, which a crash ends together: add --backend torch (or rerun "
                            "a stopped run with --resume)")
    if cfg.run.async_checkpoint and not cfg.run.checkpoint_every:
        raise ArgumentError("--async-checkpoint makes --checkpoint-every's saves background saves, but "
                            "--checkpoint-every is 0 (only the final save, which is synchronous): pass "
                            "--checkpoint-every N, or drop --async-checkpoint")
    if cfg.run.compile and par.pipeline_stages > 1:
        raise MeshTorchError("--compile compiles the plain step; the pipeline runtime (--pipeline-stages "
                             f"{par.pipeline_stages}) runs eagerly: drop one of them")
    check_stages(cfg)
    check_model_flags(cfg)
    cfg.model_config(vocab)
