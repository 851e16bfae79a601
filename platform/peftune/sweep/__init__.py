"""The sweep: one Ray Tune experiment per sweep definition, on the driver and in Ray's workers.

- ``orchestrator``: ``run_sweep``, the one entry point, and its phases;
- ``spaces``: the sweep definitions and search spaces; ``search``: TPE per method and ASHA within one;
- ``carry``, ``confirm``: the carried trials and the confirmation; ``worker``, ``packing``, ``shared_data``: what
  runs in a Ray worker; ``resume``, ``lease``, ``stopping``: resuming, one driver per sweep, a stop asked for;
- ``console``: what a sweep prints.

May import: stats/, record/, core/, methods/, inputs/, base/; never analysis or the command line.
"""
