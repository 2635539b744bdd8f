"""Applications built on the library: the library never imports them.

``meshtorch.recipes.lm`` is ``meshtorch train``, ``meshtorch generate`` and
``meshtorch plan``: a Transformer trained on text, data-, model- or
pipeline-parallel.
"""
