"""Reading a model's Hugging Face config tree into config facts, every nested sub-config included.

Values are read from the config's ``__dict__`` and then its class attributes, never through ``getattr`` on the
instance, so no property or ``__getattr__`` runs and a config missing an attribute simply yields ``None``.
"""

from __future__ import annotations

from typing import Any

from ...facts.configs import ConfigFacts
from ...redact import redact, safe_value
from ..live.introspect import is_a, raw_attr

_CONFIG_CLASSES = (
    "transformers.configuration_utils.PreTrainedConfig",
    "transformers.configuration_utils.PretrainedConfig",
)
_GENERATION_CONFIG = ("transformers.generation.configuration_utils.GenerationConfig",)
MISSING = object()
#: How deep nested sub-configs are followed.
MAX_DEPTH = 4


def _dtype_text(value: Any) -> str | None:
    if value is None:
        return None
    text = str(safe_value(value))  # never str() of a user object: its __str__ / __repr__ may hang
    return text[6:] if text.startswith("torch.") else text


def _is_dict(value: Any) -> bool:
    # isinstance() would read a non-dict's __class__ (user code); the MRO through type's descriptor does not.
    return any(c is dict for c in type.__dict__["__mro__"].__get__(type(value)))


def _one(path: str, key: str, config: Any, live: Any, generation: bool = False) -> ConfigFacts:
    use_cache = raw_attr(config, "use_cache", MISSING)
    dtype = raw_attr(config, "dtype", None)
    if dtype is None:
        dtype = raw_attr(config, "torch_dtype", None)
    attn = raw_attr(config, "_attn_implementation_internal", None)
    if attn is None:  # not `or`: the truth value of a user object is user code
        attn = raw_attr(config, "_attn_implementation", None)
    quant = raw_attr(config, "quantization_config", None)
    quant_method = bnb_dtype = quant_4bit = None
    if quant is not None:
        qdict = quant
        if not _is_dict(qdict):
            try:
                qdict = object.__getattribute__(quant, "__dict__")  # a BitsAndBytesConfig's fields
            except Exception:
                qdict = {}
        if not _is_dict(qdict):
            qdict = {}
        quant_method = safe_value(dict.get(qdict, "quant_method")) or None
        bnb_dtype = _dtype_text(dict.get(qdict, "bnb_4bit_compute_dtype"))
        # BitsAndBytesConfig keeps the flag as _load_in_4bit behind a property; a dict config has load_in_4bit.
        flag = dict.get(qdict, "_load_in_4bit", dict.get(qdict, "load_in_4bit"))
        quant_4bit = flag if type(flag) is bool else None
    return ConfigFacts(
        path=path,
        key=key,
        class_name=type(config).__name__,
        model_type=safe_value(raw_attr(config, "model_type", None)) or None,
        has_use_cache=use_cache is not MISSING,
        use_cache=None if use_cache is MISSING else safe_value(use_cache),
        dtype=_dtype_text(dtype),
        attn_implementation=safe_value(attn) if attn is not None else None,
        quant_method=quant_method,
        bnb_compute_dtype=bnb_dtype,
        is_generation_config=generation,
        ref=live.add(config) if live is not None else id(config),
        quant_4bit=quant_4bit,
        quant_ref=(live.add(quant) if live is not None else id(quant)) if quant is not None else 0,
    )


def read_configs(model_path: str, module: Any, live: Any = None) -> tuple[ConfigFacts, ...]:
    """Return the config tree of ``module`` (root first, then sub-configs, then the generation config)."""
    out: list[ConfigFacts] = []
    root = raw_attr(module, "config", None)
    if root is not None and is_a(root, _CONFIG_CLASSES):
        stack = [(f"{model_path}.config", "config", root, 0)]
        seen: set[int] = set()
        while stack:
            path, key, cfg, depth = stack.pop(0)
            if id(cfg) in seen:
                continue
            seen.add(id(cfg))
            out.append(_one(path, key, cfg, live))
            if depth >= MAX_DEPTH:
                continue
            try:
                items = list(object.__getattribute__(cfg, "__dict__").items())
            except Exception:
                items = []
            for sub_key, value in items:
                if isinstance(sub_key, str) and is_a(value, _CONFIG_CLASSES):
                    # A sub-config key is a user string shown in every rendering: redact it at the source.
                    stack.append((f"{path}.{redact(sub_key)}", redact(sub_key), value, depth + 1))
    gen = raw_attr(module, "generation_config", None)
    if gen is not None and is_a(gen, _GENERATION_CONFIG):
        out.append(_one(f"{model_path}.generation_config", "generation_config", gen, live, generation=True))
    return tuple(out)
