"""Rotary frequencies: plain, or rescaled as Llama 3.x (``llama3``) and linear rope scaling do.

:attr:`TransformerConfig.rope_scaling <meshtorch.models.TransformerConfig>` holds the scaling in
transformers' names (``rope_type`` and its parameters, as in a ``config.json``'s
``rope_parameters`` less ``rope_theta``, which is ``rotary_base``). Both supported kinds
change the inverse frequencies once, whatever the sequence length:

- ``linear`` (``factor``): every frequency divided by ``factor`` (positions interpolated).
- ``llama3`` (``factor, low_freq_factor, high_freq_factor, original_max_position_embeddings``):
  frequencies whose wavelength exceeds ``original_max_position_embeddings / low_freq_factor``
  are divided by ``factor``, those below ``original_max_position_embeddings / high_freq_factor``
  are kept, and those between blend the two linearly in ``original / wavelength`` (none where
  ``low_freq_factor == high_freq_factor``; ``high_freq_factor < low_freq_factor`` is refused).

``dynamic`` and ``yarn`` depend on the sequence length or scale the attention, and are not
supported (:data:`ROPE_TYPES` lists what is).

Example:
    >>> from meshtorch.models.rope import inverse_frequencies
    >>> inverse_frequencies(4, 100.0).tolist()
    [1.0, 0.1]
    >>> inverse_frequencies(4, 100.0, {"rope_type": "linear", "factor": 2.0}).tolist()
    [0.5, 0.05]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from meshtorch.errors import ArgumentError

# each supported rope_type -> its parameters (all required)
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# rope types transformers knows that change more than fixed frequencies (not supported)
UNSUPPORTED = ("dynamic", "yarn", "longrope")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check_rope_scaling(scaling: Any, where: str = "rope_scaling") -> None:
    """Raise :class:`ArgumentError` unless ``scaling`` is ``None`` or a rope scaling this module
    computes (a dict: ``rope_type`` of :data:`ROPE_TYPES` and each of its parameters, no others),
    naming the key and what it must be.

    Example:
        >>> check_rope_scaling({"rope_type": "linear", "factor": 4.0})
        >>> try:
        ...     check_rope_scaling({"rope_type": "yarn", "factor": 4.0})
        ... except ArgumentError as e:
        ...     print(str(e).split("; ")[1])
        supported: 'linear', 'llama3', or no scaling (plain rotary positions)
    """
    if scaling is None:
        return
    if not isinstance(scaling, Mapping):
        raise ArgumentError(f"{where} must be a dict such as {{'rope_type': 'linear', 'factor': 2.0}} or "
                            f"None (plain rotary positions), got {scaling!r}")
    kind = scaling.get("rope_type")
    if kind not in ROPE_TYPES:
        why = (" (it depends on the sequence length or scales attention)" if kind in UNSUPPORTED else "")
        raise ArgumentError(f"{where} rope_type={kind!r} is not supported{why}; supported: "
                            f"{', '.join(map(repr, ROPE_TYPES))}, or no scaling (plain rotary positions)")
    want = ROPE_TYPES[kind]
    missing = [k for k in want if k not in scaling]
    unknown = sorted(set(scaling) - {"rope_type", *want})
    if missing or unknown:
        raise ArgumentError(f"{where} rope_type={kind!r} takes exactly {list(want)}; "
                            + (f"missing {missing}" if missing else f"unknown {unknown}"))
    for k in want:
        v = scaling[k]
        whole = k == "original_max_position_embeddings"
        if not _number(v) or (whole and not isinstance(v, int)):
            raise ArgumentError(f"{where} {k}={v!r} must be a {'whole' if whole else 'finite'} number > 0")
    if kind == "llama3" and scaling["high_freq_factor"] < scaling["low_freq_factor"]:
        # (equal factors blend no band, which transformers loads: each frequency is kept or divided)
        raise ArgumentError(f"{where} high_freq_factor={scaling['high_freq_factor']} must be at least "
                            f"low_freq_factor={scaling['low_freq_factor']} (wavelengths below "
                            "original_max_position_embeddings / high_freq_factor are kept, those above "
                            "original_max_position_embeddings / low_freq_factor divided by factor)")


def inverse_frequencies(d_kv: int, base: float, scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """The ``d_kv / 2`` inverse frequencies (float64) of rotary positions at ``base``, rescaled
    by ``scaling`` (see :func:`check_rope_scaling`); position ``p`` of pair ``i`` turns by
    ``p * inverse_frequencies(...)[i]``."""
    half = d_kv // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    if scaling is None:
        return inv
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv / factor
    old = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv
    # long wavelengths (low frequencies) slow down by factor, short ones stay; between, a blend
    if high > low:
        blend = (old / wavelength - low) / (high - low)
        between = (1 - blend) * inv / factor + blend * inv
    else:  # no band between: a wavelength of exactly old / low is divided (transformers' 0 / 0 there)
        between = inv / factor
    out = torch.where(wavelength > old / low, inv / factor, between)
    return torch.where(wavelength < old / high, inv, out)
