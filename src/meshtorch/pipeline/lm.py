"""The decoder LM (:class:`~meshtorch.models.DecoderLM`) cut by layers into pipeline stages.

Stage 0 embeds the token ids (plus learned positions) and runs its blocks;
middle stages run blocks; the last stage runs its blocks, the final norm and
the output projection, and :func:`lm_loss` is the mean next-token
cross-entropy. Blocks are spread as evenly as possible (earlier stages get
the extra ones). Every processor builds the whole model from the seed and
keeps its stage's parameters, so the stages hold exactly the parameters of
the unsplit model. Activations are MeshTensors ``[batch, length, d_model]``
laid out by the global rules, which need not mention the pipeline axis.

With tied embeddings the table lives on the first and the last stage; after
the backward, :func:`sync_tied` sums its gradient over the pipeline
axis (other stages contribute zeros), so both copies get the unsplit
model's gradient and stay equal.

With ``virtual_stages=v`` the blocks are cut into ``p·v`` model chunks (an
:class:`LMStage` each) and stage ``s`` holds chunks ``s, s+p, ...`` (the
interleaved schedule): stage 0 still embeds (chunk 0) and the last stage
still ends in the output projection (chunk ``p·v - 1``). Under ZB-V
(``schedule="zbv"``, ``virtual_stages=2``) stage ``s`` holds chunks ``s`` and
``2p-1-s``: stage 0 embeds and ends in the output projection, so with tied
embeddings both uses of the table are on stage 0.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.models import TransformerConfig
    >>> from meshtorch.pipeline.lm import lm_pipeline
    >>> cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, max_length=8)
    >>> def f():
    ...     ids = mt.from_global(torch.arange(16).reshape(4, 4) % 16, "batch:4,length:4")
    ...     pipe = lm_pipeline(cfg, microbatches=2, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    ...     return round(pipe.step(ids, ids), 4)
    >>> a, b, c, d = mt.launch(f, mesh="stage:2,b:2", rules="batch:b")
    >>> a == b == c == d
    True
"""

from __future__ import annotations

import json

import torch

from meshtorch.context import current, processor_device
from meshtorch.errors import PipelineError
from meshtorch.models import DecoderLM, TransformerConfig
from meshtorch.models.layers import LENGTH
from meshtorch.models.lm import embed_ids, rotary_of
from meshtorch.ops.nn import cross_entropy, dropout
from meshtorch.ops.reduce import reduce_mean
from meshtorch.pipeline.executor import chunks_of
from meshtorch.pipeline.pipeline import OptimizerFactory, Pipeline
from meshtorch.pipeline.schedule import where
from meshtorch.pipeline.transport import local, recv_value, send_value
from meshtorch.shape import Dim
from meshtorch.tensor import MeshTensor, from_global


def layer_ranges(layers: int, stages: int) -> list[range]:
    """Blocks of each stage: contiguous, sizes differing by at most one.

    Example:
        >>> layer_ranges(5, 2)
        [range(0, 3), range(3, 5)]
    """
    if layers < stages:
        raise PipelineError(f"{layers} layers cannot fill {stages} pipeline stages; use at most {layers} "
                            "stages or more layers")
    q, r = divmod(layers, stages)
    starts = [i * q + min(i, r) for i in range(stages + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(stages)]


class LMStage(torch.nn.Module):
    """Stage ``stage`` of ``stages`` of a :class:`DecoderLM` (shares its parameters)."""

    def __init__(self, model: DecoderLM, stage: int, stages: int):
        super().__init__()
        cfg = self.cfg = model.cfg
        if any(cfg.is_moe_layer(i) for i in range(cfg.layers)):
            raise PipelineError("the LM pipeline runs dense models; MoE layers return a load-balancing "
                                "loss that would have to travel along the pipeline")
        self.first, self.last = stage == 0, stage == stages - 1
        dec = model.decoder
        if self.first:
            self.embed = model.embed
            if cfg.positions == "learned":
                self.pos = dec.pos
        self.layers = layer_ranges(cfg.layers, stages)[stage]
        self.blocks = torch.nn.ModuleList([dec.blocks[i] for i in self.layers])
        if self.last:
            self.ln_f = dec.ln_f
            if cfg.tie_embeddings:
                self.table = model.embed
            else:
                self.head = model.head
        # the tied table's slice shape, for the stages that contribute zeros to its gradient sum
        self._table_slice = next(model.embed.parameters()).shape

    def named_model_parameters(self):
        """``(name in the unsplit DecoderLM, parameter)`` of this stage's parameters."""
        for name, p in self.named_parameters():
            head, _, rest = name.partition(".")
            if head == "blocks":
                k, _, rest = rest.partition(".")
                name = f"decoder.blocks.{self.layers[int(k)]}.{rest}"
            elif head in ("pos", "ln_f"):
                name = f"decoder.{name}"
            elif head == "table":
                name = f"embed.{rest}"
            yield name, p

    def forward(self, x: MeshTensor) -> MeshTensor:
        cfg = self.cfg
        n = x.shape[LENGTH].size
        if self.first:
            ids = x
            x = embed_ids(self.embed, ids, cfg)
            if cfg.positions == "learned":
                x = x + self.pos(from_global(torch.arange(n, device=processor_device()), [Dim(LENGTH, n)]))
            if self.training and cfg.dropout:
                x = dropout(x, cfg.dropout)
        rotary = rotary_of(cfg, n)
        for block in self.blocks:
            x, _ = block(x, rotary=rotary, causal=True)
        if self.last:
            h = self.ln_f(x)
            x = self.table.attend(h) if cfg.tie_embeddings else self.head(h)
        return x

    def tied_table(self) -> torch.nn.Parameter | None:
        """The tied embedding table if this chunk holds it (the first or the last), else None."""
        if not self.cfg.tie_embeddings:
            return None
        return next(self.embed.parameters()) if self.first else \
            next(self.table.parameters()) if self.last else None

    def sync_tied(self, axis: str) -> None:
        """Sum the tied embedding table's gradient over ``axis`` (every stage calls it)."""
        sync_tied(self, axis)


def sync_tied(module: LMStage | torch.nn.ModuleList, axis: str) -> None:
    """Sum the tied embedding table's gradient over ``axis``: every stage calls it with its
    :class:`LMStage` or its chunks (one table on a stage, however many of its chunks hold it)."""
    chunks = chunks_of(module)
    if not chunks[0].cfg.tie_embeddings:
        return
    table = next((t for t in (c.tied_table() for c in chunks) if t is not None), None)
    g = table.grad if table is not None and table.grad is not None else \
        torch.zeros(chunks[0]._table_slice, device=current().device)
    total = current().comm.all_reduce(g, axis)
    if table is not None:
        table.grad = total


def named_model_parameters(module: LMStage | torch.nn.ModuleList):
    """``(name in the unsplit DecoderLM, parameter)`` of a stage's :class:`LMStage` or chunks
    (a parameter two chunks share, the tied table, once)."""
    seen: set[int] = set()
    for chunk in chunks_of(module):
        for name, p in chunk.named_model_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p


def lm_loss(logits: MeshTensor, targets: MeshTensor) -> MeshTensor:
    """Mean next-token cross-entropy over the micro-batch."""
    return reduce_mean(cross_entropy(logits, targets, "vocab"))


def lm_pipeline(cfg: TransformerConfig, *, seed: int = 0, axis: str = "stage", microbatches: int = 4,
                schedule: str = "1f1b", optimizer: OptimizerFactory | None = None,
                recompute: bool = False, model: DecoderLM | None = None, virtual_stages: int = 1) -> Pipeline:
    """A :class:`Pipeline` of the decoder LM of ``cfg`` (parameters from ``seed``, or the
    stage's share of ``model``'s own parameters) with one stage per processor along
    ``axis`` (``virtual_stages`` model chunks each, for ``schedule="interleaved"``);
    ``step(ids, targets)`` trains it."""
    stages = current().mesh.axis_size(axis) if axis in current().mesh.axis_names else 0
    if stages < 1:
        raise PipelineError(f"the pipeline axis {axis!r} is not an axis of the mesh '{current().mesh}'")
    chunks = stages * virtual_stages
    layer_ranges(cfg.layers, chunks)  # too few layers: say so before any chunk is built
    whole = model if model is not None else DecoderLM(cfg, seed=seed)  # one model, shared by the chunks

    def build(c: int) -> LMStage:
        return LMStage(whole, c, chunks)

    pipe = Pipeline(build, axis=axis, microbatches=microbatches, schedule=schedule, loss_fn=lm_loss,
                    optimizer=optimizer, recompute=recompute, virtual_stages=virtual_stages)
    pipe.after_backward = lambda: sync_tied(pipe.module, axis)
    return pipe


def owner_stage(name: str, cfg: TransformerConfig, stages: int, virtual_stages: int = 1,
                placement: str = "loop") -> int:
    """The stage that holds parameter ``name`` of the unsplit :class:`DecoderLM` (the
    first one for the tied table, which the last stage holds too); with ``virtual_stages``
    the stage of the model chunk that holds it (chunk ``c`` on stage ``c mod stages``, or
    where ``placement="v"``, ZB-V's, puts it: :func:`meshtorch.pipeline.schedule.where`).

    Example:
        >>> cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=3)
        >>> [owner_stage(n, cfg, 2) for n in ("embed.table", "decoder.blocks.2.mlp.wi.kernel",
        ...                                   "decoder.ln_f.weight")]
        [0, 1, 1]
        >>> owner_stage("decoder.blocks.2.mlp.wi.kernel", TransformerConfig(layers=4), 2, virtual_stages=2)
        0
        >>> owner_stage("decoder.ln_f.weight", TransformerConfig(layers=4), 2, 2, placement="v")  # chunk 3
        0
    """
    chunks = stages * virtual_stages
    parts = name.split(".")
    if parts[:2] == ["decoder", "blocks"]:
        layer = int(parts[2])
        chunk = next(c for c, r in enumerate(layer_ranges(cfg.layers, chunks)) if layer in r)
    elif parts[0] == "embed" or parts[:2] == ["decoder", "pos"]:
        chunk = 0
    else:  # the final norm and the output layer: the last chunk
        chunk = chunks - 1
    return where(chunk, stages, placement)[0]


def gather_whole(pipe: Pipeline, model: DecoderLM, optimizer: torch.optim.Optimizer | None = None,
                 previous: DecoderLM | None = None) -> None:
    """Give every processor the whole trained model: each stage sends its parameters
    (and, with ``optimizer``, an optimizer over ``model.parameters()``, their state)
    to the other stages along the pipeline axis, which write them into ``model``.
    Every processor calls it; ``pipe`` must be built on ``model`` (``lm_pipeline(...,
    model=model)``), so the stage's parameters are ``model``'s. Then ``model`` can be
    saved with :func:`meshtorch.checkpoint.save` or sample text like the unsplit LM.

    With ``previous`` (a model of the same config) under 2BW, the stages' previous
    weight version ``W(t-1)`` (:meth:`Pipeline.weight_versions`) is gathered into it
    as well, so a checkpoint can hold both versions (:func:`restore_previous`)."""
    _gather(pipe, model, optimizer, None)
    if previous is not None and pipe.schedule.name == "2bw":
        _, prev = pipe.weight_versions()
        _gather(pipe, previous, None, {n: w for (n, _), w in zip(named_model_parameters(pipe.module), prev,
                                                                 strict=True)})


def restore_previous(pipe: Pipeline, previous: DecoderLM) -> None:
    """Make ``previous``'s parameters (the whole model's ``W(t-1)``, e.g. loaded from a
    checkpoint that :func:`gather_whole` filled) this stage's previous 2BW weight
    version; call it after setting ``pipe.batches_trained``. A no-op for the other schedules."""
    whole = dict(previous.named_parameters())
    pipe.set_weight_versions([whole[n].detach() for n, _ in named_model_parameters(pipe.module)])


def _gather(pipe: Pipeline, model: DecoderLM, optimizer: torch.optim.Optimizer | None,
            values: dict[str, torch.Tensor] | None) -> None:
    """Fill ``model`` (and ``optimizer``'s state) on every stage from the stage that owns
    each parameter: its own parameter, or ``values[name]`` (local tensors of the owner)."""
    comm, axis = current().comm, pipe.axis
    me, p = pipe.stage, pipe.num_stages
    tag = 3  # apart from the executor's activation (1) and gradient (2) tags
    for name, param in model.named_parameters():
        src = owner_stage(name, model.cfg, p, pipe.virtual_stages, pipe.schedule.placement)
        state = optimizer.state.get(param, {}) if optimizer is not None else {}
        if me == src and values is not None:
            with torch.no_grad():
                param.copy_(values[name])
        if me == src:
            # tensors travel flat (0-d ones too) with their shapes in the header
            header = {k: {"shape": list(v.shape)} if isinstance(v, torch.Tensor) else {"value": v}
                      for k, v in sorted(state.items())}
            for dst in range(p):
                if dst == me:
                    continue
                send_value(comm, param.detach(), axis, dst, tag)
                if optimizer is not None:
                    text = bytearray(json.dumps(header).encode())
                    send_value(comm, torch.frombuffer(text, dtype=torch.uint8), axis, dst, tag)
                    for k in header:
                        if isinstance(state[k], torch.Tensor):
                            send_value(comm, state[k].detach().reshape(-1), axis, dst, tag)
            continue
        with torch.no_grad():
            param.copy_(local(recv_value(comm, axis, src, tag)))
        if optimizer is not None:
            header = json.loads(bytes(recv_value(comm, axis, src, tag).tolist()).decode())
            optimizer.state[param] = {k: recv_value(comm, axis, src, tag).reshape(h["shape"]) if "shape" in h
                                      else h["value"] for k, h in header.items()}
    comm.wait_sends()


__all__ = ["LMStage", "gather_whole", "layer_ranges", "lm_loss", "lm_pipeline", "named_model_parameters",
           "owner_stage", "restore_previous", "sync_tied"]
