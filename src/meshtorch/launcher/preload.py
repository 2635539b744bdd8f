"""What a processor that ``mt.launch(backend="torch")`` starts imports before it runs anything.

The fork server (:mod:`meshtorch.launcher.processes`) imports this module once; every
processor forked from it then starts with torch, ``torch.distributed``, the torch
communicator and meshtorch's public API already imported, instead of importing them
afresh (about a second of CPU per processor), and Dynamo, which torch's optimizers import
on first use (about another second). Importing it starts
no thread of meshtorch's and touches no GPU: a process forked after it may still use CUDA.

Example:
    >>> import sys
    >>> import meshtorch.launcher.preload
    >>> "meshtorch.comm.torch" in sys.modules and "meshtorch.models" in sys.modules
    True
"""

from __future__ import annotations

import torch
import torch.distributed  # noqa: F401 - imported for the processors forked after it

import meshtorch
import meshtorch.comm.torch  # noqa: F401 - the communicator every processor makes

# the package binds its public API lazily, on the first use of a name: bind it here, once
meshtorch.__all__  # noqa: B018 - the attribute access is the point

# torch.optim's optimizers import Dynamo at their first add_param_group (torch._disable_dynamo
# imports it lazily): about a second of CPU in every processor that trains, paid here once instead.
# Importing it leaves the CUDA driver alone (a driver started before the fork would be unusable in
# the processors): checked on CUDA builds with and without a GPU (torch 2.11 on an H200: no CUDA
# initialiser called, and a process forked after it computes on CUDA; test_launch_processes)
import torch._dynamo  # noqa: E402,F401
