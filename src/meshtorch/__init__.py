"""meshtorch: named tensor dimensions split over any axis of a processor mesh.

Example:
    >>> import meshtorch as mt
    >>> mt.Shape("batch:8,d_model:16").names
    ('batch', 'd_model')
"""

from __future__ import annotations

from meshtorch import errors
from meshtorch.errors import MeshTorchError

__version__ = "0.1.0"

__all__ = ["errors", "MeshTorchError", "__version__"]
