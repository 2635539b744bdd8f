"""Suite-wide setup.

``mt.launch(backend="torch")`` forks its processors from a fork server that has imported torch
and meshtorch (``meshtorch.launcher.preload``); a processor running a test's function also
imports the test's module, and pytest's (the launcher's main module). Preloading those two
packages in the server as well saves every processor of the suite their import (~0.08 s CPU each).
"""

import multiprocessing

multiprocessing.set_forkserver_preload(["pytest", "hypothesis"])
