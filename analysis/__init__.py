"""Sweep analysis: MLflow runs -> one DataFrame -> Pareto frontiers -> tables, plots, HTML; final test evaluation.

Modules, in the order data flows through them:

- :mod:`analysis.runs`: a sweep's parent and child runs from any MLflow tracking URI -> ``SweepRuns``
  (one DataFrame row per trial, failed and early-stopped trials kept and marked);
- :mod:`analysis.pareto`: non-dominated trials (score up, trainable parameters per task down),
  hypervolume, best configuration per method and size;
- :mod:`analysis.plots`: the PNG plots (matplotlib) and the interactive page (plotly);
- :mod:`analysis.views`: parallel coordinates and hyperparameter importance (Optuna);
- :mod:`analysis.report`: what the report says: the AdaptBert-shaped tables, the answer's decisions, the
  published reference (a ``Report``, nothing written);
- :mod:`analysis.render`: the ``Report`` as Markdown and HTML, and the display form of its tables;
- :mod:`analysis.publish`: the report directory written into place and logged to the parent run;
- :mod:`analysis.evaluate`: re-train the frontier with several seeds and score it on a held-out test split.

Nothing here trains during ``report``; only ``evaluate`` trains, and only it reads a test split.
"""
