"""The base: what every layer stands on, importing nothing else of peftune (and neither Ray, MLflow nor torch).

- ``errors``: the errors a user can act on (one line, exit 2);
- ``validation``: the hardened YAML loader and pydantic's errors as one line naming the key;
- ``record_names``: the names of the MLflow record (tags, params, metrics, phases, splits, artifacts), here at the
  bottom because the tasks, the trial and the parameter counts use them as much as the record's reader and writer.

May import: nothing of peftune but this folder.
"""
