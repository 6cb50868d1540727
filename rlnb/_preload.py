"""Imported by the workers' fork server (``rlnb._dask.prestart_fork_server``): what every worker of an embedded
cluster needs, imported once with the garbage collector paused, then frozen.

With the collector paused, importing torch, Dask and gymnasium takes ~0.95 s instead of ~1.15 s on this machine
(it would otherwise scan the growing heap over and over). ``gc.freeze()`` then moves everything imported to
the permanent generation: forked workers never scan those objects, nor touch their pages by doing so.
"""

import signal

from rlnb._dask import STOP_SIGNALS, WORKER_PRELOAD, _left_to_driver, import_with_collector_paused

import_with_collector_paused(WORKER_PRELOAD, freeze=True)

# the workers it forks ignore a stop signal sent to the driver's process group from their first instant on, not only
# once Dask has set them up (rlnb._dask.leave_stop_signals_to_driver, which WorkerRuntime calls then)
for _name in STOP_SIGNALS:
    signal.signal(getattr(signal, _name), _left_to_driver)
