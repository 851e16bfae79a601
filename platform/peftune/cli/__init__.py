"""The command line: ``peftune`` (``commands.main``, the entry point) and what ``jobs/*.py`` run.

- ``commands``: the parser and the small commands; ``sweep_command``: ``peftune sweep`` and the jobs' ``job_main``;
- ``train_command``: ``peftune train``; ``common``: argparse's types, the checks, the exit statuses;
- ``services``: ``peftune up`` / ``down``.

May import: everything below it: benchmarks/, analysis, sweep/, stats/, record/, core/, methods/, inputs/, base/.
"""
