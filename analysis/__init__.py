"""Sweep analysis: MLflow runs -> one DataFrame -> Pareto frontiers -> tables, plots, HTML; final test evaluation.

In the order data flows: :mod:`analysis.runs` (the record -> ``SweepRuns``), :mod:`analysis.confirmed` (the
answer), :mod:`analysis.pareto` (frontiers, hypervolume), :mod:`analysis.plots` and :mod:`analysis.views` (the
figures), :mod:`analysis.report` (what the report says: a ``Report``, nothing written), :mod:`analysis.render`
(Markdown and HTML), :mod:`analysis.publish` (the directory and the parent run), :mod:`analysis.evaluate` (the
frontier re-trained and scored on a held-out test split). Nothing here trains during ``report``; only ``evaluate``
trains, and only it reads a test split. The report's definitions: docs/report.md.
"""
