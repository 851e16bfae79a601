"""PEFT methods, one module each, registered by name on import: the layer between the inputs (the encoder they
hook into) and the core (the model they are part of); may import inputs/ and base/."""

from peftune.methods import (  # noqa: F401  (registration)
    adapter,
    bitfit,
    dora,
    frozen,
    full,
    hyperformer,
    ia3,
    layernorm,
    lora,
    lora_adapter,
    prefix,
    prompt,
    top_k,
    vera,
)
from peftune.methods.base import (  # noqa: F401
    MethodConfig,
    MethodOption,
    MethodSpec,
    PeftFormat,
    TaskContext,
    display_order,
    get_method,
    make_method_config,
    method_names,
    option,
    peft_exports,
    register_method,
)
