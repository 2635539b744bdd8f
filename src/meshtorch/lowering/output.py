"""The class the lowering builds its results as: :class:`~meshtorch.tensor.MeshTensor`.

``MeshTensor``'s operators (``x * y``) lower through this package, so the lowering sits below
the tensor type and cannot import it (that would be an import cycle). The core registers the
class itself when :mod:`meshtorch.tensor` defines it; a MeshTensor can only exist after that, so
every op the lowering receives finds it registered.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.lowering import output
    >>> output.tensor_type() is mt.MeshTensor
    True
"""

from __future__ import annotations

from meshtorch.errors import MeshTorchError

_registered: list[type] = []


def register(cls: type) -> type:
    """Make ``cls`` the class of the lowering's results (called once, by :mod:`meshtorch.tensor`)."""
    _registered[:] = [cls]
    return cls


def tensor_type() -> type:
    """The registered tensor class; raises if :mod:`meshtorch.tensor` was never imported."""
    if not _registered:
        raise MeshTorchError(
            "the lowering has no tensor class: import meshtorch.tensor (or meshtorch) before lowering ops")
    return _registered[0]
