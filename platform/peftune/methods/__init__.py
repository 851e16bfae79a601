"""PEFT methods, one module each, registered by name on import."""

from peftune.methods import bitfit, frozen, full, layernorm, lora, top_k  # noqa: F401  (registration)
from peftune.methods.base import (  # noqa: F401
    MethodConfig,
    MethodSpec,
    TaskContext,
    get_method,
    make_method_config,
    method_names,
    register_method,
)
