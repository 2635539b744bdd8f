"""What a processor that ``mt.launch(backend="torch")`` starts imports before it runs anything.

The fork server (:mod:`meshtorch.launcher.processes`) imports this module once; every
processor forked from it then starts with torch, ``torch.distributed``, the torch
communicator and meshtorch's public API already imported, instead of importing them
afresh (about a second of CPU per processor). Importing it starts no thread of
meshtorch's and touches no GPU: a process forked after it may still use CUDA.

Example:
    >>> import sys
    >>> import meshtorch.launcher.preload
    >>> "meshtorch.comm.torch" in sys.modules and "meshtorch.models" in sys.modules
    True
"""

from __future__ import annotations

import torch.distributed  # noqa: F401 - imported for the processors forked after it

import meshtorch
import meshtorch.comm.torch  # noqa: F401 - the communicator every processor makes

# the package binds its public API lazily, on the first use of a name: bind it here, once
meshtorch.__all__  # noqa: B018 - the attribute access is the point
