"""GPUs by the name CUDA gives them: each kind's nominal bf16 rate and the built-in device spec
(:data:`meshtorch.plan.devices.DEVICES`) that prices it when it has no measurement of its own.

One table for everything that reads a GPU's name: ``meshtorch train --rules auto`` picks the spec
that prices its run (:func:`meshtorch.recipes.lm.plan_cli.hardware_of_run`), ``meshtorch plan
--calibrate`` the spec whose links a measured GPU keeps
(:func:`meshtorch.plan.gpu_calibration.measure_gpu`), and ``benchmarks/gpu_step.py`` the nominal
rate it reports MFU against.

Example:
    >>> from meshtorch.plan.gpus import gpu_kind, spec_of_gpu
    >>> gpu_kind("NVIDIA H100 PCIe").bf16_flops / 1e12, spec_of_gpu("NVIDIA H100 PCIe")
    (756.0, ('h100', True))
    >>> gpu_kind("NVIDIA GeForce RTX 4090") is None, spec_of_gpu("NVIDIA GeForce RTX 4090")
    (True, ('h100', False))
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# the spec of a GPU without one of its own
DEFAULT_GPU_SPEC = "h100"


@dataclass(frozen=True)
class GPUKind:
    """One kind of GPU: ``word``, what its name (``torch.cuda.get_device_name()``) contains; its
    nominal dense (no sparsity) bf16 tensor-core FLOP/s from NVIDIA's data sheets; and ``spec``, the
    built-in device spec of its own kind, or ``None`` (priced as :data:`DEFAULT_GPU_SPEC`'s)."""

    word: str
    bf16_flops: float
    spec: str | None = None


# the first match wins, so the more specific names come first
GPUS: tuple[GPUKind, ...] = (
    GPUKind("H100 PCIe", 756e12, "h100"), GPUKind("H100 NVL", 835e12, "h100"),
    GPUKind("H100", 989e12, "h100"), GPUKind("H200", 989e12), GPUKind("H800", 989e12),
    GPUKind("B200", 2250e12), GPUKind("A100", 312e12, "a100"), GPUKind("A800", 312e12),
    GPUKind("L40S", 362e12), GPUKind("L4", 121e12),
)


def _words(name: str) -> str:
    # one spelling for a name as CUDA gives it and as a file name (gpu_calibration.device_name)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def gpu_kind(name: str) -> GPUKind | None:
    """The row of :data:`GPUS` of the GPU called ``name`` (as ``torch.cuda.get_device_name()`` or
    :func:`~meshtorch.plan.gpu_calibration.device_name` spells it), or ``None`` if none matches.

    Example:
        >>> gpu_kind("NVIDIA A100-SXM4-80GB").word, gpu_kind("nvidia-h100-80gb-hbm3").word
        ('A100', 'H100')
    """
    words = _words(name)
    return next((kind for kind in GPUS if _words(kind.word) in words), None)


def spec_of_gpu(name: str) -> tuple[str, bool]:
    """The built-in device spec (a key of :data:`~meshtorch.plan.devices.DEVICES`) that prices the
    GPU called ``name``, and whether it is of the GPU's own kind (else :data:`DEFAULT_GPU_SPEC`).

    Example:
        >>> spec_of_gpu("NVIDIA A100-SXM4-80GB"), spec_of_gpu("NVIDIA L4")
        (('a100', True), ('h100', False))
    """
    kind = gpu_kind(name)
    if kind is not None and kind.spec is not None:
        return kind.spec, True
    return DEFAULT_GPU_SPEC, False
