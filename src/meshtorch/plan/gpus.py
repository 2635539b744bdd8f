"""GPUs by the name CUDA gives them, each with its data sheet's rates: the one table that every
place pricing a GPU reads.

Each row (:class:`GPUKind`) is one part: the words of its name, the built-in device spec it
becomes (a key of :data:`meshtorch.plan.devices.DEVICES`, e.g. ``--hardware h100-pcie``), and
its dense bf16 and fp32 FLOP/s, memory, memory bandwidth and the link between GPUs. Readers:
``meshtorch plan --hardware`` and ``mt.plan.device`` (the specs built from the rows:
:func:`meshtorch.plan.devices.gpu_spec`), ``meshtorch train --rules auto`` (the spec of the GPU
the run is on: :func:`meshtorch.recipes.lm.plan_cli.hardware_of_run`), ``meshtorch plan
--calibrate`` (the link a measured GPU keeps when it has no second GPU to measure one:
:func:`meshtorch.plan.gpu_calibration.measure_gpu`), ``benchmarks/gpu_step.py`` (the nominal
rate it reports MFU against), ``benchmarks/gpu_check.sh`` and ``benchmarks/plan_vs_gpu_step.py``
(the built-in spec to compare with the calibration).

A GPU whose name matches no row has no rates here: :func:`spec_of_gpu` raises and says how to
price it (``meshtorch plan --calibrate --device cuda`` on it, or ``--hardware FILE``); nothing
prices it as another GPU silently.

Example:
    >>> from meshtorch.plan.gpus import gpu_kind, spec_of_gpu
    >>> gpu_kind("NVIDIA H100 PCIe").bf16_flops / 1e12, spec_of_gpu("NVIDIA H100 PCIe")
    (756.0, 'h100-pcie')
    >>> spec_of_gpu("NVIDIA L4"), gpu_kind("NVIDIA GeForce RTX 4090") is None
    ('l4', True)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshtorch.errors import PlanError

# Seconds per message hop: NCCL's small-message latency over NVLink is a few µs (the figure the
# built-in specs always used); over PCIe (through the host bridge or a PCIe switch) we assume
# twice that. Assumptions, not data sheet numbers.
NVLINK_LATENCY = 5e-6
PCIE_LATENCY = 10e-6
GB = 10 ** 9


@dataclass(frozen=True)
class GPUKind:
    """One kind of GPU, from its vendor's data sheet (sources above :data:`GPUS`).

    ``word``: the words its name (``torch.cuda.get_device_name()``) contains, in any order and
    case, e.g. ``"A100 PCIe 40GB"`` matches ``NVIDIA A100-PCIE-40GB``; ``spec``: the built-in
    device spec it is (a key of :data:`meshtorch.plan.devices.DEVICES`); ``bf16_flops``: dense
    (no 2:4 sparsity) bf16 tensor-core FLOP/s, also its fp16 rate; ``fp32_flops``: plain fp32
    FLOP/s (PyTorch leaves TF32 matmuls off by default, so an fp32 matmul runs at this);
    ``memory_bytes`` (decimal GB, as the data sheet says) and ``memory_bandwidth`` (bytes/s);
    ``link``: what joins two GPUs of a mesh axis, ``link_bandwidth`` its bytes/s each way (half
    the data sheet's both-ways figure) and ``link_latency`` seconds a hop; ``roofline``: priced
    op by op (:mod:`meshtorch.plan.kernels`) with the kernel efficiencies measured on an H100 SXM
    (:data:`meshtorch.plan.devices.H100_KERNELS`), else by FLOPs at half the peak as the ``a100``
    spec always was (no kernel numbers were measured on an A100)."""

    word: str
    spec: str
    bf16_flops: float
    fp32_flops: float
    memory_bytes: int
    memory_bandwidth: float
    link: str
    link_bandwidth: float
    link_latency: float
    roofline: bool = True

    @property
    def words(self) -> frozenset[str]:
        return frozenset(_words(self.word))


def _nvlink(gb_per_s_both_ways: float) -> dict:
    return {"link": f"NVLink {gb_per_s_both_ways:g} GB/s", "link_bandwidth": gb_per_s_both_ways / 2 * GB,
            "link_latency": NVLINK_LATENCY}


def _pcie(gen: int) -> dict:
    # a x16 slot: PCIe 4.0 64 GB/s, 5.0 128 GB/s both ways
    both = {4: 64, 5: 128}[gen]
    return {"link": f"PCIe {gen}.0 x16 {both} GB/s", "link_bandwidth": both / 2 * GB,
            "link_latency": PCIE_LATENCY}


# Sources (NVIDIA's data sheets; "dense" = half the "with sparsity" figures they print):
# - H100 SXM5 / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" data sheet (nvidia.com/en-us/data-center/
#   h100): bf16 1,979 / 1,513 / 1,671 TFLOP/s with sparsity = 989 / 756 / 835 dense; fp32 67 / 51 /
#   60; 80 GB HBM3 3.35 TB/s / 80 GB HBM2e 2.0 TB/s / 94 GB HBM3 3.9 TB/s; NVLink 900 GB/s (SXM);
#   the PCIe and NVL cards: PCIe 5.0 128 GB/s, NVLink bridges of 600 GB/s join pairs only, so a
#   mesh axis of more than two cards crosses PCIe: their link here is PCIe's.
# - H200 SXM / NVL: "NVIDIA H200 Tensor Core GPU" data sheet (nvidia.com/en-us/data-center/h200):
#   bf16 1,979 / 1,671 with sparsity = 989 / 835 dense; fp32 67 / 60; 141 GB HBM3e 4.8 TB/s; NVLink
#   900 GB/s (SXM); NVL: 2- or 4-way NVLink bridges, PCIe 5.0 128 GB/s (its link here, as above).
# - H800 SXM / PCIe: the H100's silicon and rates with NVLink cut to 400 GB/s (NVIDIA H800 product
#   brief): 989 / 756 dense bf16, 67 / 51 fp32, 80 GB 3.35 / 2.0 TB/s.
# - B200 (HGX B200): "NVIDIA Blackwell" HGX B200 specifications (nvidia.com/en-us/data-center/hgx):
#   per GPU FP16/BF16 4.5 PFLOP/s with sparsity = 2.25 dense, fp32 75 TFLOP/s, 180 GB HBM3e at
#   7.7 TB/s, NVLink 5 1.8 TB/s.
# - A100 SXM4 / PCIe, 80 GB / 40 GB: "NVIDIA A100 Tensor Core GPU" data sheet
#   (nvidia.com/en-us/data-center/a100): bf16 312 dense (624 with sparsity), fp32 19.5; HBM2e
#   2,039 GB/s (SXM 80 GB), 1,935 (PCIe 80 GB), 1,555 (40 GB, both); NVLink 600 GB/s (SXM); PCIe
#   cards: PCIe 4.0 64 GB/s (NVLink bridges join pairs only). A800: the A100 with NVLink 400 GB/s.
# - L40S: "NVIDIA L40S" data sheet: bf16 733 with sparsity = 362 dense (366 printed for the
#   sparse TF32, 183 dense), fp32 91.6; 48 GB GDDR6 864 GB/s; PCIe 4.0 x16, no NVLink.
# - L4: "NVIDIA L4 Tensor Core GPU" data sheet: bf16 242 with sparsity = 121 dense, fp32 30.3;
#   24 GB GDDR6 300 GB/s; PCIe 4.0 x16, no NVLink.
GPUS: tuple[GPUKind, ...] = (
    GPUKind("H100", "h100", 989e12, 67e12, 80 * GB, 3.35e12, **_nvlink(900)),
    GPUKind("H100 PCIe", "h100-pcie", 756e12, 51e12, 80 * GB, 2.0e12, **_pcie(5)),
    GPUKind("H100 NVL", "h100-nvl", 835e12, 60e12, 94 * GB, 3.9e12, **_pcie(5)),
    GPUKind("H200", "h200", 989e12, 67e12, 141 * GB, 4.8e12, **_nvlink(900)),
    GPUKind("H200 NVL", "h200-nvl", 835e12, 60e12, 141 * GB, 4.8e12, **_pcie(5)),
    GPUKind("H800", "h800", 989e12, 67e12, 80 * GB, 3.35e12, **_nvlink(400)),
    GPUKind("H800 PCIe", "h800-pcie", 756e12, 51e12, 80 * GB, 2.0e12, **_pcie(5)),
    GPUKind("B200", "b200", 2250e12, 75e12, 180 * GB, 7.7e12, **_nvlink(1800)),
    GPUKind("A100", "a100", 312e12, 19.5e12, 80 * GB, 2.039e12, **_nvlink(600), roofline=False),
    GPUKind("A100 40GB", "a100-40gb", 312e12, 19.5e12, 40 * GB, 1.555e12, **_nvlink(600), roofline=False),
    GPUKind("A100 PCIe", "a100-pcie", 312e12, 19.5e12, 80 * GB, 1.935e12, **_pcie(4), roofline=False),
    GPUKind("A100 PCIe 40GB", "a100-pcie-40gb", 312e12, 19.5e12, 40 * GB, 1.555e12, **_pcie(4),
            roofline=False),
    GPUKind("A800", "a800", 312e12, 19.5e12, 80 * GB, 2.039e12, **_nvlink(400), roofline=False),
    GPUKind("A800 PCIe", "a800-pcie", 312e12, 19.5e12, 80 * GB, 1.935e12, **_pcie(4), roofline=False),
    GPUKind("L40S", "l40s", 362e12, 91.6e12, 48 * GB, 0.864e12, **_pcie(4)),
    GPUKind("L4", "l4", 121e12, 30.3e12, 24 * GB, 0.3e12, **_pcie(4)),
)

# The link a GPU not in :data:`GPUS` keeps when ``meshtorch plan --calibrate`` has no second GPU to
# measure one over: PCIe 4.0 x16, the least link of a data-center GPU of the last years (a guess on
# the safe side, said so in the calibration's printout).
FALLBACK_LINK = _pcie(4)


# the GPU whose kernel numbers (meshtorch.plan.devices.H100_KERNELS) were measured on it
KERNELS_MEASURED_ON = "h100"


def assumed(kind: GPUKind) -> str:
    """What the built-in spec of ``kind`` assumes beyond its data sheet, in words ("" if nothing):
    a roofline kind other than the H100 SXM is priced with the H100 SXM's measured kernel
    efficiencies (:func:`meshtorch.plan.devices.gpu_spec`).

    Example:
        >>> assumed(gpu_kind("NVIDIA H100 80GB HBM3")), assumed(gpu_kind("NVIDIA A100-SXM4-80GB"))
        ('', '')
        >>> assumed(gpu_kind("NVIDIA L4")).startswith("kernel efficiencies measured on an H100 SXM")
        True
    """
    if not kind.roofline or kind.spec == KERNELS_MEASURED_ON:
        return ""
    return (f"kernel efficiencies measured on an H100 SXM, assumed for the {kind.word} (`meshtorch plan "
            "--calibrate --device cuda` on one measures its own)")


def _words(name: str) -> list[str]:
    # one spelling for a name as CUDA gives it and as a file name (gpu_calibration.device_name)
    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


def gpu_kind(name: str) -> GPUKind | None:
    """The row of :data:`GPUS` of the GPU called ``name`` (as ``torch.cuda.get_device_name()`` or
    :func:`~meshtorch.plan.gpu_calibration.device_name` spells it): of the rows whose words are all
    in the name, the one with the most words (``H100 PCIe`` before ``H100``); ``None`` if none.

    Example:
        >>> gpu_kind("NVIDIA A100-SXM4-80GB").spec, gpu_kind("nvidia-h100-80gb-hbm3").spec
        ('a100', 'h100')
        >>> gpu_kind("NVIDIA A100-PCIE-40GB").spec, gpu_kind("NVIDIA GH200 480GB")
        ('a100-pcie-40gb', None)
    """
    words = set(_words(name))
    matches = [kind for kind in GPUS if kind.words <= words]
    return max(matches, key=lambda kind: len(kind.words), default=None)


def spec_of_gpu(name: str) -> str:
    """The built-in device spec (a key of :data:`~meshtorch.plan.devices.DEVICES`) of the GPU
    called ``name``; a GPU not in :data:`GPUS` raises :class:`~meshtorch.errors.PlanError` saying
    how to price it.

    Example:
        >>> spec_of_gpu("NVIDIA A100-SXM4-80GB"), spec_of_gpu("NVIDIA B200")
        ('a100', 'b200')
    """
    kind = gpu_kind(name)
    if kind is None:
        raise PlanError(
            f"the GPU {name!r} is not in meshtorch.plan.gpus.GPUS, so the planner has no rates for it "
            f"(known: {', '.join(k.word for k in GPUS)}); run `meshtorch plan --calibrate --device cuda` "
            "on it once (it measures the GPU and stores a device file that meshtorch train --rules auto "
            "then uses), or price it with --hardware FILE (a JSON device file: docs/planner.md)")
    return kind.spec
