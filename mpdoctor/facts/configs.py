"""Config facts: the Hugging Face config tree of a model, with every nested sub-config.

Values are read from the config's ``__dict__`` and then its class attributes,
never through ``getattr`` on the instance, so no property or ``__getattr__``
runs and a config missing an attribute simply yields ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConfigFacts:
    """The precision-relevant settings of one config or sub-config.

    ``path`` is what the user types (``model.config.text_config``);
    ``has_use_cache`` tells an absent flag from one set to False.
    """

    path: str
    key: str
    class_name: str
    model_type: str | None
    has_use_cache: bool
    use_cache: Any
    dtype: str | None
    attn_implementation: str | None
    quant_method: str | None
    bnb_compute_dtype: str | None
    is_generation_config: bool = False
    #: The config object's ref in the live table (fixes resolve it there).
    ref: int = 0
    quant_4bit: bool | None = None
    #: Ref of the quantization config (a ``BitsAndBytesConfig`` or a dict), 0 when there is none.
    quant_ref: int = 0
