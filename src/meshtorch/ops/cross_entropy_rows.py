"""Cross-entropy of low-precision logit rows with float32 precision and no float32 [rows, vocab] tensor
kept: the local kernel of :func:`~meshtorch.ops.nn.cross_entropy`'s fused hard-target path.

``-log_softmax(t, dtype=float32)[target]`` is the float32 loss of bf16 logits, but autograd keeps its
float32 [rows, vocab] output for the backward, whose gradient is another: at GPT-2's 8192 x 50304
each is 1.5 GiB, twice the bf16 logits. Plain PyTorch's ``F.cross_entropy`` under CUDA autocast
keeps them too (autocast runs ``log_softmax`` in float32: measured on an H100, its peak is 5x the
logits' bytes). Float32 it must stay: a split vocabulary reduces a float32 ``reduce_logsumexp``
across processors, and layouts never change results. Float32 logits on the CPU and CUDA take it too
(:data:`FLOAT32_DEVICES`): there its cache-sized chunks (the CPU) and generated kernels (CUDA) are
faster than the whole-tensor formula, and keep less.

:func:`cross_entropy_rows` keeps float32 and drops the tensors. Forward, chunk by chunk of rows:
``log_softmax(chunk, dtype=float32)`` and the target's entry (the loss the whole-tensor formula
gives, row for row); each chunk's float32 block dies before the next one is made. Saved: the logits
and the ids (plus the [rows] float32 log-sum-exp where ``z_loss`` asks for it). Backward, chunk by
chunk again: ``softmax(chunk, dtype=float32)``, minus one at the target, times the upstream
gradient, written in the logits' dtype. Float32 temporaries: a chunk of :data:`CHUNK_BYTES` (by
device type; :func:`chunk_bytes` sets it) and its cast copy at most, plus a number per row.

On CUDA (``chunk_bytes`` 0, :data:`KERNELS`) and under ``torch.compile`` the rows are one chunk, the
backward's softmax is ``exp(x - lse)`` from the saved log-sum-exp and the one-hot a compare:
Inductor makes the forward one reduction kernel and the backward one pointwise kernel, each reading
the bf16 logits (and the backward writing their bf16 gradient), holding no float32 [rows, vocab]
block at all. Eager on CUDA, those two kernels are made by ``torch.compile`` of the two formulas
(for the first shape, then one version for any number of rows; per device): 1.44 ms forward and
backward at [8192, 50304] bf16 on an H100, where 256 MiB chunks took 9.33 and plain PyTorch 4.52.
Float32 logits under ``torch.compile`` are one chunk of the chunks' own ops instead (``log_softmax``
and ``gather`` forward, ``softmax`` and ``scatter_add`` backward), so that a compiled step keeps the
eager step's values (bitwise where its backend runs the same ATen ops, as ``aot_eager``); Inductor
fuses them.

Example:
    >>> import torch, torch.nn.functional as F
    >>> from meshtorch.ops.cross_entropy_rows import cross_entropy_rows
    >>> t = torch.randn(5, 11, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
    >>> ids = torch.tensor([0, 3, 10, 4, 4])
    >>> loss = cross_entropy_rows(t, ids)
    >>> loss.dtype
    torch.float32
    >>> torch.allclose(loss, F.cross_entropy(t.float(), ids, reduction="none"), rtol=1e-6, atol=1e-6)
    True
    >>> loss.sum().backward(); t.grad.dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

import torch

from meshtorch.caching import dispatch_mode_active
from meshtorch.context import current, here
from meshtorch.errors import ArgumentError
from meshtorch.lowering.lower import is_dynamo_compiling

#: float32 bytes of one chunk of rows (forward's log-probabilities, backward's probabilities) by the
#: logits' device type; any other type takes CUDA's (an accelerator's: few, large chunks), a meta
#: tensor of a planner's trace the type the plan prices. Read-only: set it with :func:`chunk_bytes`.
#:
#: - ``"cpu"``: 2 MiB, 10 rows of a 50304-word vocabulary: a chunk, its bf16 rows and the backward's
#:   product stay in the caches (here a core's 1 MiB L2, a shared 32 MiB L3). Measured on this
#:   project's shared 2-core CPU, one thread, bf16 forward + backward, the least of 7 runs of each
#:   size interleaved: 1 to 4 MiB within the noise of each other and the fastest at every shape; 2
#:   MiB vs 256 MiB: [2048, 50304] 249 vs 1213 ms, [4096, 16384] 125 vs 706, [512, 50304] 34 vs
#:   211, [64, 128256] 16 vs 20, [8, 50304] the same (one chunk); 16 MiB 1.1x to 2.7x 2 MiB's time.
#:   Again: ``python benchmarks/cross_entropy.py --rows 2048 --vocab 50304 --chunk-mib 1 2 4 16 256``
#: - ``"cuda"``: 0, no chunks: the rows whole in the two kernels ``torch.compile`` generates for them
#:   (:data:`KERNELS`), as inside a compiled step. Measured on an H100 (torch 2.11, [8192, 50304]
#:   bf16, forward + backward): chunks of 16 / 64 / 256 / 1024 MiB took 11.3 / 10.2 / 9.4 / 9.1 ms,
#:   plain PyTorch's ``F.cross_entropy`` under autocast 4.6 ms (and 5x the logits' bytes of memory),
#:   the kernels 1.44 (nothing beyond the logits' gradient): each chunk is a float32 softmax
#:   written and read back, forward and backward. Again:
#:   ``python benchmarks/cross_entropy.py --chunk-mib 0 16 256`` (0: the kernels).
CHUNK_BYTES: dict[str, int] = {"cpu": 2 << 20, "cuda": 0}
#: :data:`CHUNK_BYTES`' value for "no chunks": the whole rows in generated kernels (see :func:`chunk_bytes`)
KERNELS = 0


@contextlib.contextmanager
def chunk_bytes(n: int, device_type: str | None = None) -> Iterator[None]:
    """Chunks of ``n`` bytes of float32 rows for :func:`cross_entropy_rows` on ``device_type``
    (``"cpu"``, ``"cuda"``, ...; ``None``: every device) inside the block, the sizes before restored at
    its exit. Smaller chunks hold less float32 at once (about two chunks beside the logits and their
    gradient) and, on a CPU, stay in its caches; each costs a few kernel launches. Values do not
    depend on it: every row's loss and gradient is its own. Inside a processor's program it is that
    processor's (each thread-processor its own, none leaking past the block); outside one it is the
    process's, which thread-processors launched in the block read (processes of the ``torch``
    backend run their own: set it in the program); under ``torch.compile`` the rows are one chunk
    whatever it says.

    ``n = 0`` (:data:`KERNELS`, CUDA's default): no chunks; the rows whole, in the two kernels
    ``torch.compile`` generates (for the first shape, then one for any number of rows; per device)
    for the forward's log-sum-exp and pick and the backward's ``softmax - onehot``: each reads the
    low-precision logits once, and nothing float32 beyond a number per row is made. Its values equal
    the chunks' to float32 rounding (between chunk sizes they are bitwise equal). Where the compile
    fails (no Inductor backend for the device, e.g. no C++ compiler or Triton) the rows run in
    chunks (:func:`fallback_bytes`), and a ``RuntimeWarning`` says why, once per process and device.

    Example:
        >>> import torch
        >>> from meshtorch.ops.cross_entropy_rows import chunk_bytes, chunk_rows
        >>> with chunk_bytes(4 * 1000 * 3, "cpu"):  # 3 rows of a 1000-word vocabulary
        ...     chunk_rows(1000, "cpu"), chunk_rows(1000, "cuda")
        (3, 0)
        >>> with chunk_bytes(1):  # below a row: a row a chunk, on every device
        ...     chunk_rows(1000, "cpu"), chunk_rows(1000, "cuda")
        (1, 1)
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ArgumentError(f"chunk_bytes({n!r}): the chunk size must be a whole number of bytes, 0 or more, "
                            f"e.g. chunk_bytes(16 << 20) for 16 MiB of float32 rows, or 0 for no chunks (the "
                            f"rows whole in generated kernels)")
    if device_type is not None and _device_type(device_type) != device_type:
        raise ArgumentError(f"chunk_bytes(..., device_type={device_type!r}): give a device type as "
                            f"torch.device(...).type names it, e.g. 'cpu' or 'cuda' (None: every device)")
    new = dict.fromkeys(CHUNK_BYTES, n) if device_type is None else {device_type: n}
    if here.ctx is not None:  # a thread-processor's program (inside use()): its own sizes
        before = _thread.sizes
        _thread.sizes = {**(before or CHUNK_BYTES), **new}
        try:
            yield
        finally:
            _thread.sizes = before
        return
    before = {k: CHUNK_BYTES[k] for k in new}
    CHUNK_BYTES.update(new)  # (key by key: a processor reading meanwhile finds every key)
    try:
        yield
    finally:
        CHUNK_BYTES.update(before)


class _Sizes(threading.local):
    def __init__(self) -> None:
        # (set per thread, no class attribute of the name: see meshtorch.context._Local)
        self.sizes: dict[str, int] | None = None  # this thread's chunk_bytes block's, else None


_thread = _Sizes()


def _device_type(name: object) -> str | None:
    """``torch.device(name).type``, or None where ``name`` is no device torch knows."""
    if not isinstance(name, str):
        return None
    try:
        return torch.device(name).type
    except (RuntimeError, ValueError):
        return None


def chunk_rows(vocab: int, device_type: str) -> int:
    """Rows of ``vocab`` float32 entries that fit a chunk of :data:`CHUNK_BYTES` on ``device_type``
    (at least one), or 0 where that device's setting is :data:`KERNELS` (no chunks).

    Example:
        >>> from meshtorch.ops.cross_entropy_rows import chunk_rows
        >>> chunk_rows(50304, "cpu"), chunk_rows(50304, "cuda")
        (10, 0)
    """
    device_type = _priced(device_type)
    sizes = _thread.sizes or CHUNK_BYTES
    n = sizes.get(device_type, sizes["cuda"])
    return KERNELS if n == KERNELS else max(1, n // (4 * max(vocab, 1)))


def _priced(device_type: str) -> str:
    """``device_type``, or for a planner's meta trace the device it prices (as
    ``meshtorch.plan.tracing.device_type`` says; this module sits below the planner)."""
    if device_type == "meta":
        return getattr(current().tracer, "device", "cuda")
    return device_type


#: device types on which float32 logits take :func:`cross_entropy_rows` too (bf16 and fp16 logits
#: take it everywhere), forward + backward against ``-log_softmax(x).gather(ids)``
#: (``benchmarks/cross_entropy.py``'s "rows fp32" and "formula fp32"):
#:
#: - ``"cpu"``: on this project's CPU, one thread: [4096, 16384] 194 vs 402 ms
#:   (``benchmarks/results/cross_entropy.md``), [256, 50304] 40 vs 63 ms (``--rows 256 --vocab
#:   50304``); at [1024, 2048] 3.8 vs 3.5 where the allocator keeps the formula's 8 MiB float32 blocks
#:   between calls (a loop of the loss alone) and 4.1 vs 9.0 where it page-faults them afresh; in a
#:   training step (issue 27's LM, one processor, the two losses interleaved) 3.7 ms less per 305 ms
#:   step.
#: - ``"cuda"``: on an H200 (torch 2.11, [8192, 50304] float32, the rows in :data:`KERNELS`): 1.77 vs
#:   3.71 ms, 1.5 GiB of memory beyond the logits (their gradient) against 4.6 GiB
#:   (``benchmarks/results/h200/cross_entropy.md``).
#:
#: Its peak is the logits plus a few chunks (on CUDA their gradient), where the formula holds three
#: float32 copies of them. Elsewhere float32 keeps the formula (unmeasured against it there).
FLOAT32_DEVICES = ("cpu", "cuda")


def takes_float32(device_type: str) -> bool:
    """Whether float32 logits on ``device_type`` (a meta tensor's: the priced device) take
    :func:`cross_entropy_rows` in ``mt.cross_entropy`` (:data:`FLOAT32_DEVICES`).

    Example:
        >>> from meshtorch.ops.cross_entropy_rows import takes_float32
        >>> takes_float32("cpu"), takes_float32("cuda"), takes_float32("mps")
        (True, True, False)
    """
    return _priced(device_type) in FLOAT32_DEVICES


class _CrossEntropyRows(torch.autograd.Function):
    """``logsumexp_fp32(x) - x[ids]`` (+ ``z_loss * logsumexp**2``) per row of ``x`` [rows, vocab],
    ``valid`` (a bool per row, or ``None``) zeroing the loss and gradient of ignored rows.

    How the rows are computed (``ctx.how``): ``"chunks"`` (eager, :func:`chunk_rows` rows at a
    time), ``"kernels"`` (eager, :data:`KERNELS`), ``"whole"`` (traced by Dynamo: one reduction
    forward, ``exp(x - lse)`` backward) or ``"one"`` (float32 logits traced by Dynamo: the chunks'
    own ops over the rows as one chunk, so that a compiled step has the eager step's values row for
    row, bitwise where its backend runs the same ATen ops, as ``aot_eager``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None,
                z_loss: float) -> torch.Tensor:
        step = 0
        if is_dynamo_compiling():
            how = "one" if x.dtype == torch.float32 else "whole"
        else:
            step = chunk_rows(x.shape[-1], x.device.type)  # (the backward's chunks too)
            how = "chunks"
            if step == KERNELS:
                step, loss, lse = _kernel_forward(x, ids, z_loss)
                if step == KERNELS:
                    how = "kernels"
        if how == "whole":
            # Inductor: one reduction kernel over the bf16 rows; nothing float32 [rows, vocab] is made
            lse = torch.logsumexp(x.float(), -1)
            loss = lse - x.gather(-1, ids[:, None]).squeeze(-1).float()
        elif how == "one":
            picked, lse = _chunk_loss(x, ids[:, None], z_loss)
            loss = -picked.squeeze(-1)
        elif how == "chunks":
            picked, lses = [], []
            # split: every chunk's view made in one call (a Python call per kernel is the cost here)
            for chunk, at in zip(x.split(step), ids[:, None].split(step)):
                got, chunk_lse = _chunk_loss(chunk, at, z_loss)  # (its float32 block freed in there)
                picked.append(got)
                if z_loss:
                    lses.append(chunk_lse)
            loss = -torch.cat(picked).squeeze(-1)
            lse = torch.cat(lses) if z_loss else None
        if z_loss and how != "kernels":  # (the kernel adds its own)
            loss = loss + z_loss * lse.square()
        if valid is not None:
            loss = loss.masked_fill(~valid, 0.0)
        ctx.how, ctx.z_loss, ctx.step = how, z_loss, step
        ctx.save_for_backward(x, ids, valid, lse if z_loss or how in ("whole", "kernels") else None)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, ids, valid, lse = ctx.saved_tensors
        g = grad.float() if valid is None else grad.float().masked_fill(~valid, 0.0)
        how = ctx.how
        if torch.is_grad_enabled():
            # a backward with create_graph=True (a gradient penalty's second backward): the whole
            # formula, which autograd differentiates again, its log-sum-exp made differentiably
            return _whole_grad(x, ids, g, torch.logsumexp(x.float(), -1), ctx.z_loss), None, None, None
        # one pointwise kernel for Inductor: the saved log-sum-exp, no reduction (a compiled
        # backward, compiled autograd's too, traces the formula inline: no nested compile)
        if how == "whole" or (how == "kernels" and is_dynamo_compiling()):
            return _whole_grad(x, ids, g, lse, ctx.z_loss), None, None, None
        if how == "kernels":
            return _kernel_backward(x, ids, g, lse, ctx.z_loss), None, None, None
        # d loss / d x = softmax(x) * (1 + 2 z lse) - onehot(ids), times the row's upstream gradient
        scale = g * (1 + 2 * ctx.z_loss * lse) if ctx.z_loss else g
        if how == "one":
            minus = (-g[:, None] if ctx.z_loss
                     else torch.full((x.shape[0], 1), -1.0, dtype=torch.float32, device=x.device))
            p = _chunk_grad(x, ids[:, None], scale[:, None], minus, ctx.z_loss)
            return (p if ctx.z_loss else torch.mul(p, g[:, None])).to(x.dtype), None, None, None
        out = torch.empty_like(x)
        step = min(ctx.step, x.shape[0])  # (rows fewer than a chunk's: minus_one no longer than them)
        if ctx.z_loss:
            minus = (-g[:, None]).split(step)
            for chunk, at, into, by, less in zip(x.split(step), ids[:, None].split(step), out.split(step),
                                                 scale[:, None].split(step), minus):
                into.copy_(_chunk_grad(chunk, at, by, less, True))
        else:  # (p - onehot) * g, the product written in x's dtype: one float32 pass less
            minus_one = torch.full((step, 1), -1.0, dtype=torch.float32, device=x.device)
            for chunk, at, into, by in zip(x.split(step), ids[:, None].split(step), out.split(step),
                                           g[:, None].split(step)):
                torch.mul(_chunk_grad(chunk, at, by, minus_one[:len(at)], False), by, out=into)
        return out, None, None, None


def _chunk_loss(chunk: torch.Tensor, at: torch.Tensor, z_loss: float
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of rows' forward: ``log_softmax(chunk, dtype=float32)[at]`` per row (a column) and,
    with ``z_loss``, each row's log-sum-exp to float32 rounding (the largest log-probability is
    ``max - lse``, made from ``max - max = 0`` exactly); the chunk's float32 block dies on return."""
    logp = torch.log_softmax(chunk, -1, dtype=torch.float32)
    return logp.gather(-1, at), (chunk.amax(-1).float() - logp.amax(-1)) if z_loss else None


def _chunk_grad(chunk: torch.Tensor, at: torch.Tensor, by: torch.Tensor, less: torch.Tensor,
                z_loss: float) -> torch.Tensor:
    """One chunk of rows' float32 gradient: ``softmax(chunk)`` with, given ``z_loss``, each row
    times ``by`` and ``less`` (``-g``) added at its target (the whole gradient), else ``less`` (-1)
    added at its target (``softmax - onehot``: the caller multiplies by ``g`` as it writes it in
    the logits' dtype, one float32 pass less)."""
    p = torch.softmax(chunk, -1, dtype=torch.float32)
    if z_loss:
        p.mul_(by)
    p.scatter_add_(-1, at, less)
    return p


def _whole_grad(x: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, lse: torch.Tensor,
                z_loss: float) -> torch.Tensor:
    """``(softmax(x) * (1 + 2 z lse) - onehot(ids)) * g`` over the whole rows, softmax as
    ``exp(x - lse)``, written in ``x``'s dtype: the compiled backward (``lse`` saved) and a
    ``create_graph`` one (``lse`` remade differentiably), float32 [rows, vocab] blocks and all."""
    scale = g * (1 + 2 * z_loss * lse) if z_loss else g
    hit = torch.arange(x.shape[-1], device=x.device) == ids[:, None]
    p = torch.exp(x.float() - lse[:, None])
    return (p * scale[:, None] - hit * g[:, None]).to(x.dtype)


def _rows_forward(x: torch.Tensor, ids: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of :data:`KERNELS`: each row's float32 loss and log-sum-exp (one reduction)."""
    lse = torch.logsumexp(x.float(), -1)
    loss = lse - x.gather(-1, ids[:, None]).squeeze(-1).float()
    return (loss + z_loss * lse.square() if z_loss else loss), lse


class _Kernels:
    """:data:`KERNELS`' compiled functions, made on first use; ``failed`` says, by device type, why
    they cannot be made there (then that device's calls chunk). One lock: thread-processors share
    Dynamo's caches, and on torch 2.11 one's compile refused another's compiled call meanwhile (see
    ``meshtorch.compiler``)."""

    lock = threading.Lock()
    forward: object = None
    backward: object = None
    failed: dict[str, str] = {}
    last_error = ""  # the last call's own error, which sent it to the chunks (for a diagnosis)
    compiled_calls = 0  # calls the compiled functions answered (fullgraph: none ran uncompiled)


def _recompile_room() -> contextlib.AbstractContextManager:
    """Dynamo's recompile limit at least 64 for a kernel call (a device, a z_loss and the first shape
    each make a version; later row counts share one dynamic version), the user's setting elsewhere."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # (the older name: torch < 2.6)
        if isinstance(getattr(config, name, None), int):
            return config.patch(**{name: max(getattr(config, name), 64)})
    return contextlib.nullcontext()


def _compiled(fn: object) -> object:
    return torch.compile(fn, fullgraph=True)


def _dynamo_off() -> bool:
    """Whether compiled functions run eagerly now: Dynamo disabled (``TORCHDYNAMO_DISABLE=1``,
    ``torch._dynamo.config.disable``) or ``torch.compiler.set_stance("force_eager")`` or
    ``"eager_on_recompile"`` (its stance read
    from torch's private ``eval_frame._stance`` where this torch has one). The kernels' formulas run
    eagerly would make float32 [rows, vocab] blocks: the forward chunks instead."""
    dynamo = torch._dynamo
    if getattr(dynamo.config, "disable", False):
        return True
    stance = getattr(getattr(dynamo, "eval_frame", None), "_stance", None)
    # (eager_on_recompile: a new shape would run the formula eagerly, with no word)
    return getattr(stance, "stance", "default") in ("force_eager", "eager_on_recompile")


def _kernel_call(name: str, fn: object, *args: object) -> object:
    """``fn(*args)`` compiled (autocast off: the kernels' precision is their own), or None where it
    cannot be: compiling failed for the device (:attr:`_Kernels.failed`, warned once), or the call
    raised anything else (a user's bad ids, a refused recompile: this call alone chunks, where the
    error comes back in the user's words). Under a dispatch mode or with Dynamo off ``fn`` runs as
    it is: the same numbers, float32 [rows, vocab] temporaries and all."""
    device = args[0].device.type
    if dispatch_mode_active() or _dynamo_off():  # (no compile then: see dispatch_mode_active)
        with torch.autocast(device, enabled=False):
            return fn(*args)
    with _Kernels.lock:
        if device in _Kernels.failed:
            return None
        compiled = getattr(_Kernels, name) or _compiled(fn)
        setattr(_Kernels, name, compiled)
        try:
            with torch.autocast(device, enabled=False), _recompile_room():
                out = compiled(*args)
            _Kernels.compiled_calls += 1
            return out
        except _OUT_OF_MEMORY:
            raise
        except Exception as e:  # noqa: BLE001 - sorted below
            if not isinstance(e, _compile_failed()):
                _Kernels.last_error = f"{type(e).__name__}: {e}"[:2000]
                return None  # this call's own trouble: chunks say it in the user's words
            # no backend for the device (no C++ compiler, no Triton)
            said = str(e).strip().splitlines()
            _Kernels.failed[device] = f"{type(e).__name__}: {said[0] if said else ''}"[:300]
            warnings.warn(f"cross_entropy_rows: generating its kernels failed on {device} "
                          f"({_Kernels.failed[device]}); the rows run in chunks of "
                          f"{fallback_bytes(device) >> 20} MiB of float32 there instead (set them "
                          f"with meshtorch.ops.cross_entropy_rows.chunk_bytes)", RuntimeWarning, stacklevel=3)
    return None


_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # (torch.* from 2.5)


def _compile_failed() -> type[BaseException]:
    """What a compile that cannot be done raises (Inductor's errors, a missing compiler among them);
    looked up when needed: importing Dynamo at meshtorch's import costs every process seconds."""
    return getattr(getattr(torch._dynamo, "exc", None), "BackendCompilerFailed", RuntimeError)


def fallback_bytes(device_type: str) -> int:
    """The chunks where :data:`KERNELS` cannot be compiled on ``device_type``: the CPU's measured
    size there, 256 MiB elsewhere.

    Example:
        >>> from meshtorch.ops.cross_entropy_rows import fallback_bytes
        >>> fallback_bytes("cpu") >> 20, fallback_bytes("cuda") >> 20
        (2, 256)
    """
    return 2 << 20 if device_type == "cpu" else 256 << 20


def _kernel_forward(x: torch.Tensor, ids: torch.Tensor, z_loss: float
                    ) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """(0, loss, lse) from the compiled forward; on a planner's meta trace the same outputs from ops
    that move the kernel's bytes (read the logits once); (rows of a fallback chunk, None, None)
    where the kernels cannot be compiled or Dynamo is off (:func:`_dynamo_off`)."""
    if x.device.type == "meta":
        lse = x.amax(-1).float()
        return KERNELS, lse - x.gather(-1, ids[:, None]).squeeze(-1).float(), lse
    out = None if _dynamo_off() else _kernel_call("forward", _rows_forward, x, ids, z_loss)
    if out is None:
        return max(1, fallback_bytes(x.device.type) // (4 * max(x.shape[-1], 1))), None, None
    return KERNELS, *out


def _kernel_backward(x: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, lse: torch.Tensor,
                     z_loss: float) -> torch.Tensor:
    """:func:`_whole_grad` compiled (one pointwise kernel); on a meta trace an op that reads the logits
    and writes their gradient; where compiling failed since the forward, the formula eagerly."""
    if x.device.type == "meta":
        return torch.mul(x, g[:, None].to(x.dtype))
    out = _kernel_call("backward", _whole_grad, x, ids, g, lse, z_loss)
    return _whole_grad(x, ids, g, lse, z_loss) if out is None else out


def cross_entropy_rows(t: torch.Tensor, ids: torch.Tensor, dim: int = -1, ignore_index: int | None = None,
                       z_loss: float = 0.0) -> torch.Tensor:
    """Per-example float32 ``-log_softmax(t)[ids]`` over ``dim`` of local logits ``t`` (bf16, fp16 or
    float32: the arithmetic is float32), ``ids`` holding ``t``'s other dims in order; a position whose id is
    ``ignore_index`` gets loss and gradient 0; ``z_loss`` adds ``z_loss * logsumexp(t)**2``.
    Autograd keeps ``t``, ``ids`` and at most a float32 number per row (see the module's docstring).
    Ids must be in range (or ``ignore_index``): the caller checks them.

    Example:
        >>> import torch
        >>> from meshtorch.ops.cross_entropy_rows import cross_entropy_rows
        >>> t = torch.zeros(2, 4, dtype=torch.bfloat16)
        >>> [round(x, 5) for x in cross_entropy_rows(t, torch.tensor([1, -100]), ignore_index=-100).tolist()]
        [1.38629, 0.0]
    """
    x = t.movedim(dim, -1)
    out_shape = x.shape[:-1]
    # a view where t's vocabulary is its last, contiguous dim (the LM's logits); else a copy, which
    # autograd then keeps in place of t
    x = x.reshape(-1, x.shape[-1])
    ids = ids.reshape(-1)
    valid = None
    if ignore_index is not None:
        valid = ids != ignore_index
        ids = ids.clamp(0, x.shape[-1] - 1)  # in bounds for gather; the row's loss is zeroed
    return _CrossEntropyRows.apply(x, ids, valid, float(z_loss)).reshape(out_shape)
