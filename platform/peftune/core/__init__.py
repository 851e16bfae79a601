"""The core: one trial, from the model to its checkpoint, and K trials packed over one frozen backbone.

- ``model``: backbone + method + task heads; ``params``: the parameter accounting; ``optim``: the clipped AdamW;
- ``checkpoint``: safetensors + JSON, and peft's format; ``train``: the trial's loop, evaluation and report;
- ``pack``: K trials over one backbone; ``trial_spec``: one trial as one object (the record logs it).

May import: methods/, inputs/, base/.
"""
