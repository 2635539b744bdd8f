"""Ops on MeshTensors, one file per family; all re-exported by ``meshtorch``."""
