"""Suite-wide setup.

``mt.launch(backend="torch")`` forks its processors from a fork server that has imported torch
and meshtorch (``meshtorch.launcher.preload``); a processor running a test's function also
imports the test's module, and pytest's (the launcher's main module). Preloading those two
packages in the server as well saves every processor of the suite their import (~0.08 s CPU each).
"""

import multiprocessing

multiprocessing.set_forkserver_preload(["pytest", "hypothesis"])


import pytest  # noqa: E402 - after the fork server's preload list, which must come first
import torch  # noqa: E402


def _process_wide_switches() -> tuple:
    """torch's process-wide switches a test may set for a block (attention kernels, conversion
    flags): a block entered and left on several thread-processors at once restores them out of
    order and leaves them set (a test did: every later test of its worker lost fused attention)."""
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(),
            torch.__future__.get_swap_module_params_on_conversion(),
            torch.__future__.get_overwrite_module_params_on_conversion())


@pytest.fixture(autouse=True)
def _switches_restored():
    before = _process_wide_switches()
    yield
    after = _process_wide_switches()
    if after != before:
        raise AssertionError(f"this test left torch's process-wide switches changed: {before} -> {after} "
                             "(attention kernels flash/mem-efficient/math, conversion swap/overwrite); set "
                             "them around mt.launch, not inside thread-processors")


@pytest.fixture(autouse=True)
def _dispatch_mode_flags_restored():
    """torch's process-wide "a dispatch mode is active" flags as they were before the test: dispatch
    modes entered and left on several thread-processors at once (a FLOP counter or an op recorder
    in each one's program) leave them set after all have exited, a torch bug no test can avoid."""
    from mesh_harness import torch_mode_flags_kept

    with torch_mode_flags_kept():
        yield

