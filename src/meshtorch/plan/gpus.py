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


# Sources: NVIDIA's own spec tables, each read through the copy named (the search tools used hold
# no nvidia.com page itself); every number below checked against them, 2026-11. NVIDIA prints
# tensor-core rates "with sparsity": the dense rate here is half, rounded down to the TFLOP/s
# (1,979 -> 989, 1,513 -> 756, 1,671 -> 835; the L40S's printed dense 362.05 -> 362). TF32 is not
# fp32: fp32 here is the sheet's plain "FP32" row. NVLink and PCIe figures are both-ways totals; a
# row keeps half, each way. The PCIe and NVL cards' NVLink bridges join 2 cards (H200 NVL: 2 or 4)
# only, so a mesh axis of more of them crosses PCIe: their link here is PCIe's.
# - H100 SXM, H100 PCIe: "NVIDIA H100 Tensor Core GPU" datasheet, SXM and PCIe columns
#   (https://www.nvidia.com/en-us/data-center/h100/), read as HPC Tech's copy of its table
#   (https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html, "* Shown with sparsity"):
#   BF16 1,979* | 1,513*, FP32 67 | 51, 80 GB | 80 GB, 3,350 | 2,000 GB/s, "NVLink: 900GB/s PCIe
#   Gen5: 128GB/s" | "NVLINK: 600GB/s PCIe Gen5: 128GB/s". The H100 PCIe product brief
#   PB-11133-001_v02 (copy: https://manuals.plus/m/d4b5dc21484df3ba8fbe84918338461cc074a3fcebcc
#   13423eadc2b10ac3bda4) says "greater than 2,000 gigabytes per second" and a 350 W card.
# - H100 NVL: the same page's later table, columns "H100 SXM | H100 NVL" (per GPU; the first NVL
#   sheets quoted the pair of cards), read as a public markdown copy of that table: BF16 1,671*,
#   FP32 60, 94GB, 3.9TB/s, "NVIDIA NVLink: 600GB/s PCIe Gen5: 128GB/s".
# - H200 SXM, H200 NVL: "NVIDIA H200 Tensor Core GPU" (https://www.nvidia.com/en-us/data-center/
#   h200/), read as a public markdown copy of its table: BF16 1,979* | 1,671*, FP32 67 | 60,
#   141GB | 141GB, 4.8TB/s | 4.8TB/s, "NVIDIA NVLink: 900GB/s PCIe Gen5: 128GB/s" | "2- or 4-way
#   NVIDIA NVLink bridge: 900GB/s per GPU PCIe Gen5: 128GB/s". (A third-party survey says the
#   H200 datasheet PDF prints 4.2TB/s for the NVL; not read, and a summary of the H200 NVL
#   product brief PB-12128-001 gives 4,813 GB/s: 4.8 kept.)
# - H800 SXM, H800 PCIe: NO NVIDIA data sheet found (a third-party survey of NVIDIA's pages
#   found none either). Rates: the H100 SXM / PCIe sheet's (the same GH100 silicon). The H800's
#   NVLink, "400 GB/s total aggregate bidirectional", is a third-party article's ("NVIDIA H800 vs
#   H100: The Invisible Bottlenecks...", reposted at https://www.tumgag.com/tag/nvidia%20h100);
#   Reuters' first report (March 2023, https://fudzilla.net/news/ai/56578-nvidia-modifies-h100-to-
#   sell-it-to-china) said "approximately half of the H100". Unverified: calibrate one to price it.
# - B200: the HGX B200 column of "Individual Blackwell GPU Specifications" on NVIDIA's HGX page
#   (https://www.nvidia.com/en-us/data-center/hgx/), read as copied at https://zdszero.github.io/
#   Computer/Artificial_Intelligence/Hardware.html: "FP16/BF16 Tensor Core 4.5 PFLOPS" (a sparse
#   figure: the table's footnote, "Dense is one-half sparse spec shown"), "FP32 75 TFLOPS",
#   "180GB HBM3E | 7.7TB/s", "5th Generation NVLink: 1.8TB/s". The DGX B200 page (1,440GB total,
#   64TB/s: 8 TB/s a GPU) and the GTC 2024 figures (192 GB, 8 TB/s) differ; the HGX ones are kept.
# - A100 SXM4 / PCIe, 80 GB / 40 GB: "NVIDIA A100 Tensor Core GPU" datasheet
#   (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-
#   us-nvidia-1758950-r4-web.pdf), read as quoted in public notes: "BFLOAT16 Tensor Core 312 TFLOPS
#   | 624 TFLOPS*", "FP32 19.5 TFLOPS", "GPU Memory Bandwidth: 1,555GB/s | 1,935GB/s | 1,555GB/s |
#   2,039GB/s" (40GB PCIe | 80GB PCIe | 40GB SXM | 80GB SXM), SXM "NVLink: 600GB/s PCIe Gen4:
#   64GB/s", PCIe "NVIDIA NVLink Bridge for 2 GPUs: 600GB/s PCIe Gen4: 64GB/s".
# - A800 SXM4 80 GB, A800 80 GB PCIe: NO NVIDIA data sheet found (NVIDIA's only A800 page is the
#   A800 40GB Active workstation card, which is not a row here). Rates: the A100 80 GB sheet's;
#   NVLink 400 GB/s (A100: 600) per the distributor specs Reuters reported on 2022-11-08 (copy:
#   https://tadviser.com/a/e.php?id=700768). Unverified against NVIDIA's own text.
# - L40S: "NVIDIA L40S" datasheet (https://www.nvidia.com/en-us/data-center/l40s/), read as the
#   L40 / L40S table copied at https://www.mullet.se/product.html?product_id=355414: "BFLOAT16
#   Tensor Core TFLOPS 362.05 | 733*", "FP32 TFLOPS 91.6", "48 GB GDDR6 with ECC", "864GB/s",
#   "PCIe Gen4 x16: 64GB/s bidirectional"; no NVLink.
# - L4: "NVIDIA L4 Tensor Core GPU" datasheet (https://www.nvidia.com/en-us/data-center/l4/; copy
#   https://www.cisco.com/c/dam/en/us/products/collateral/servers-unified-computing/ucs-c-series-
#   rack-servers/nvidia-l4-gpu.pdf), read as quoted in public notes: "FP32 30.3 teraFLOPs",
#   "BFLOAT16 Tensor Core 242 teraFLOPS*" ("Specifications are one-half lower without sparsity"),
#   "GPU memory 24GB", "300GB/s"; PCI Express 4.0 x16 (https://store.sourcecode.com/en-us/
#   bg-bucket-compare/125/9820); no NVLink.
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
    in the name and whose memory is the size the name states, if it states one (``40GB``), the one
    with the most words (``H100 PCIe`` before ``H100``); ``None`` if none.

    Example:
        >>> gpu_kind("NVIDIA A100-SXM4-80GB").spec, gpu_kind("nvidia-h100-80gb-hbm3").spec
        ('a100', 'h100')
        >>> gpu_kind("NVIDIA A100-PCIE-40GB").spec, gpu_kind("NVIDIA GH200 480GB")
        ('a100-pcie-40gb', None)
        >>> gpu_kind("NVIDIA A800 40GB Active") is None  # the a800 row is an 80 GB card
        True
    """
    words = set(_words(name))
    # a size the name states ("NVIDIA A800 40GB Active") is the card's: a row of another size is
    # another card, whose memory would plan layouts that do not fit (or waste what is there)
    sizes = {int(m[1]) for w in words if (m := re.fullmatch(r"(\d+)gb", w))}
    matches = [kind for kind in GPUS if kind.words <= words
               and sizes <= {round(kind.memory_bytes / GB)}]
    return max(matches, key=lambda kind: len(kind.words), default=None)


def not_known(name: str) -> str:
    """Why the GPU called ``name`` has no row (:func:`gpu_kind` gives ``None``), for an error.

    Example:
        >>> not_known("NVIDIA H100 80GB HBM3 MIG 1g.10gb")[:45]
        'is a MIG slice (a part of a GPU, with part of'
    """
    if "mig" in _words(name):
        return ("is a MIG slice (a part of a GPU, with part of its memory and compute; "
                "meshtorch.plan.gpus.GPUS has whole GPUs only)")
    return "is not in meshtorch.plan.gpus.GPUS"


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
            f"the GPU {name!r} {not_known(name)}, so the planner has no rates for it "
            f"(known: {', '.join(k.word for k in GPUS)}); run `meshtorch plan --calibrate --device cuda` "
            "on it once (it measures the GPU and stores a device file that meshtorch train --rules auto "
            "then uses), or price it with --hardware FILE (a JSON device file: docs/planner.md)")
    return kind.spec
