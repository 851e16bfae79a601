"""The MLflow record: its reader and writer (the only modules of the library that import MLflow), the durable
buffer behind every write, the driver's own state of the sweep, and how old records are still read.

- ``reader``, ``writer``, ``tracking_buffer``, ``trial_logger`` (Tune's callback that records each trial);
- ``sweep_state``: the driver's state, which the record only logs; ``epoch_kept``: the epoch a trial keeps;
- ``stores``: the tracking URI and storage path; ``ui_links``: the MLflow UI's links;
- ``legacy``: what earlier versions wrote, read here. The record's names are ``base/record_names.py``.

May import: core/ (the trial specification a trial's run logs), methods/, inputs/, base/.
"""
