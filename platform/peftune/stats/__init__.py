"""The statistics of the decisions: the procedure (``decisions``) that the confirmation, the report and
``peftune decide`` share, and its simulation through the same code (``simulate``). docs/decisions.md.

May import: record/ (the old records' plans), base/; nothing of the sweep or the trial.
"""
