"""Measurements beside the runtime, not in it: nothing of the sweep or a trial imports this package (a layer above the
sweep, beside analysis, under the command line).

- :mod:`peftune.benchmarks.throughput`: ``peftune bench``, the core's training throughput against the HF Trainer
  (and peft's LoRA), and packed trials against solo ones;
- :mod:`peftune.benchmarks.driver`: ``python -m peftune.benchmarks.driver``, the sweep driver's own cost as a sweep
  grows, through the real ``run_sweep`` with a trainable that trains nothing (``orchestrator.SweepHooks``).

What they measured lives in docs/benchmarks.md.
"""
