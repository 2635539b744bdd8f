"""``meshtorch train``, ``generate`` and ``plan``: a Transformer trained on text on a processor mesh.

:mod:`~meshtorch.recipes.lm.config` holds the options (sections model,
parallelism, optimizer, run), :mod:`~meshtorch.recipes.lm.trainer` the one
training loop (a plain or a pipelined step), :mod:`~meshtorch.recipes.lm.steps`
the step the planner traces and :mod:`~meshtorch.recipes.lm.cli` the command line.

Example:
    >>> from meshtorch.recipes.lm import TrainConfig
    >>> TrainConfig.of(steps=5, mesh="b:4").parallelism.mesh
    'b:4'
"""

from meshtorch.recipes.lm.config import TrainConfig, check_config, model_dims
from meshtorch.recipes.lm.trainer import train

__all__ = ["TrainConfig", "check_config", "model_dims", "train"]
