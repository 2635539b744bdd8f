"""Pipeline parallelism along a mesh axis (GPipe, 1F1B, PipeDream-2BW, ZB-H1, and interleaved
1F1B over virtual stages: several model chunks per stage).

A schedule is data (:mod:`~meshtorch.pipeline.schedule`); the same table
drives the executor, the simulator (:mod:`~meshtorch.pipeline.simulate`) and
the PNG timeline (:mod:`~meshtorch.pipeline.plot`).

Example:
    >>> from meshtorch.pipeline import build_schedule, simulate
    >>> round(simulate(build_schedule("1f1b", 4, 12), forward=1.0).bubble_fraction, 4)
    0.2
"""

from meshtorch.pipeline.pipeline import Pipeline, split_microbatches
from meshtorch.pipeline.schedule import SCHEDULES, TABLES, Action, Schedule
from meshtorch.pipeline.schedule import build as build_schedule
from meshtorch.pipeline.simulate import Simulation, memory, simulate

__all__ = ["SCHEDULES", "TABLES", "Action", "Pipeline", "Schedule", "Simulation", "build_schedule", "memory",
           "simulate", "split_microbatches"]
