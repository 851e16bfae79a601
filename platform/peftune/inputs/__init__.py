"""The inputs of a trial: the pretrained encoder and the tasks' data.

- ``backbone`` (with ``dropout``, its cheap CPU mask): the compact BERT encoder and its checkpoints;
- ``tasks``: tasks as declarations (kind, head, loss, metric, labels);
- ``tables``: a task's file read into validated rows;
- ``data``: each task's splits, the tokenize-once cache, the batches.

May import: base/.
"""
