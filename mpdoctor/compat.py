"""The library APIs that moved between the releases mpdoctor supports, each resolved here once.

The releases are those of the support matrix (``docs/support-matrix.md``): torch 2.4 to 2.14, transformers
4.50 to 5.24, accelerate 0.30 to 1.15. Everything is resolved by looking for the API itself, never by
comparing version strings, so a release between two tested corners gets the right answer too.

Nothing here imports a library when this module is imported (the crash hook and ``%load_ext`` import
mpdoctor before torch): the answers that need one are functions that import it when called.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# -- Python -----------------------------------------------------------------------------------------------------

_TYPE_DICT = type.__dict__["__dict__"].__get__
_TYPE_MRO = type.__dict__["__mro__"].__get__


def code_qualname(frame: Any) -> str:
    """A frame's function as ``Class.method`` where it is a method, else its name.

    ``code.co_qualname`` arrived in Python 3.11; on 3.10 the class is found from the frame's ``self`` (or
    ``cls``): the class in its MRO whose attribute of that name holds this very code. Read through ``type``'s own
    descriptors, so no user ``__getattr__`` or property runs.
    """
    code = frame.f_code
    qualname = getattr(code, "co_qualname", None)
    if type(qualname) is str:
        return qualname
    name = code.co_name
    try:
        local = frame.f_locals
        owner = local.get("self", local.get("cls")) if code.co_argcount else None
        cls = owner if type(owner) is type else type(owner)  # not isinstance: it would read the user's __class__
        for c in _TYPE_MRO(cls) if owner is not None else ():
            attr = _TYPE_DICT(c).get(name)
            attr = getattr(attr, "__func__", attr)  # classmethod / staticmethod
            if getattr(attr, "__code__", None) is code:
                return f"{type.__dict__['__qualname__'].__get__(c)}.{name}"
    except Exception:  # an unreadable frame or class: the bare name is still true
        pass
    return name


# -- torch: GradScaler -----------------------------------------------------------------------------------------

#: Class paths a GradScaler can have: the device-generic class (``torch.amp.grad_scaler``, torch >= 2.3) and
#: the CUDA one users still construct (``torch.cuda.amp.GradScaler``, a deprecated subclass since torch 2.4).
GRAD_SCALER_CLASSES = ("torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler")

#: Module prefixes of the frames a GradScaler method runs in (both classes above).
GRAD_SCALER_MODULES = ("torch.amp", "torch.cuda.amp")


#: The mapping types of ``nn.Module._parameters`` / ``_buffers`` / ``_modules``: an ``OrderedDict`` up to torch 2.4,
#: a plain ``dict`` since. Read them with ``dict.items`` (no user code runs) after checking ``type(x) in`` this.
MODULE_DICTS: tuple[type, ...] = (dict, OrderedDict)


def grad_scaler_class() -> type:
    """The GradScaler class whose methods every GradScaler runs, the one the runtime watcher wraps.

    Returns
    -------
    type
        ``torch.amp.grad_scaler.GradScaler``: from torch 2.4 on (the floor), ``torch.cuda.amp.GradScaler``
        subclasses it without overriding ``scale``, ``unscale_``, ``step`` or ``update``.
    """
    from torch.amp.grad_scaler import GradScaler

    return GradScaler


def grad_scaler(device: str, **kwargs: Any) -> Any:
    """A new GradScaler for ``device`` (``"cuda"``, ``"cpu"``, ...), built as the fixes tell users to build one.

    Parameters
    ----------
    device : str
        The device type the scaler's tensors live on.
    **kwargs
        ``init_scale``, ``growth_factor``, ... as ``GradScaler`` takes them.

    Returns
    -------
    torch.amp.GradScaler
        The scaler.
    """
    return grad_scaler_class()(device, **kwargs)


# -- torch: where a gradient clip is applied -------------------------------------------------------------------


def clip_helper() -> tuple[Any, str] | None:
    """The helper every ``clip_grad_norm_`` clips through, as ``(module, attribute)``; None where there is none.

    torch >= 2.6 splits ``clip_grad_norm_`` into ``get_total_norm`` and
    ``clip_grad._clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)``, looked up at call time:
    wrapping it sees every clip, also through a ``clip_grad_norm_`` imported by name before the watch began.
    torch 2.4 and 2.5 clip inside ``clip_grad_norm_`` itself (see :func:`clip_entry_points`).
    """
    from torch.nn.utils import clip_grad

    return (clip_grad, "_clip_grads_with_norm_") if "_clip_grads_with_norm_" in vars(clip_grad) else None


def clip_entry_points() -> tuple[tuple[Any, str], ...]:
    """Where ``clip_grad_norm_`` is looked up when no helper exists (torch 2.4, 2.5), as ``(module, attribute)``.

    ``torch.nn.utils.clip_grad_norm_`` (what users, accelerate and Lightning call) and the function in its own
    module (what ``clip_grad.clip_grad_norm`` calls). A ``clip_grad_norm_`` bound by ``from torch.nn.utils
    import clip_grad_norm_`` before the watch began is not seen on these releases.
    """
    import torch.nn.utils
    from torch.nn.utils import clip_grad

    return ((torch.nn.utils, "clip_grad_norm_"), (clip_grad, "clip_grad_norm_"))


# -- transformers -----------------------------------------------------------------------------------------------


def rope_init_function(rope_type: str) -> Callable[..., Any] | None:
    """The function transformers computes a rotary embedding's ``inv_freq`` with, for ``rope_type``.

    ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` maps a rope type to
    ``fn(config, device) -> (inv_freq, attention_scaling)``. transformers 5.x drops ``"default"`` from the
    table (the rotary class computes it in ``compute_default_rope_parameters``): None then.

    Parameters
    ----------
    rope_type : str
        ``"default"``, ``"linear"``, ``"dynamic"``, ``"yarn"``, ``"llama3"``, ...

    Returns
    -------
    callable or None
        The function, or None for a type the table does not hold.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS.get(rope_type)


def config_dtype_attribute() -> str:
    """The attribute a transformers config keeps (and saves) its dtype under.

    ``dtype`` from transformers 4.56 on (a property of ``PretrainedConfig``, with ``torch_dtype`` its deprecated
    alias); ``torch_dtype`` before, where ``config.dtype`` is an unknown attribute that ``save_pretrained``
    cannot even serialise.
    """
    from transformers import PretrainedConfig

    return "dtype" if "dtype" in vars(PretrainedConfig) else "torch_dtype"


def cache_layers(cache: Any) -> list[tuple[Any, Any]]:
    """The ``(keys, values)`` tensors of each layer of a transformers KV cache, whatever its layout.

    transformers >= 4.56 keeps a cache as ``cache.layers``, each layer with ``keys`` and ``values``
    (None until it is filled); older releases keep two lists, ``key_cache`` and ``value_cache``.

    Parameters
    ----------
    cache : transformers.Cache
        A cache a model returned (``past_key_values``).

    Returns
    -------
    list of (keys, values)
        One pair per filled layer, in layer order.
    """
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers if getattr(layer, "keys", None) is not None]
    keys, values = getattr(cache, "key_cache", ()), getattr(cache, "value_cache", ())
    return [(k, v) for k, v in zip(keys, values) if getattr(k, "numel", None) is not None and k.numel()]


# -- accelerate -------------------------------------------------------------------------------------------------

#: The attributes of an ``Accelerator`` that hold its fp8 recipe handler, newest name first: accelerate >= 1.6
#: keeps a TransformerEngine recipe in ``te_recipe_handler`` (``TERecipeKwargs``); older releases keep any fp8
#: recipe in ``fp8_recipe_handler`` (``FP8RecipeKwargs``, with a ``backend`` of ``"TE"`` or ``"MSAMP"``).
ACCELERATE_FP8_RECIPE_ATTRS = ("te_recipe_handler", "fp8_recipe_handler")


# -- import-time noise of particular releases ------------------------------------------------------------------

#: Loggers that speak while their library is imported, about the library's own build rather than anything the
#: user did: torchao 0.18 logs "Failed to load .../_C_mxfp8...so" for each CUDA extension a CPU machine cannot
#: load, and torch >= 2.10 logs a ``_pytree`` deprecation for each Enum torchao registers with
#: ``register_constant``.
IMPORT_NOISE_LOGGERS = ("torchao", "torch.utils._pytree")


@contextmanager
def quiet_imports() -> Iterator[None]:
    """Import libraries for mpdoctor's own use without their import-time warnings (see ``IMPORT_NOISE_LOGGERS``).

    For the block only, those loggers drop records below ERROR; their levels are restored after it, so the
    user's own imports and every later message of these libraries are untouched. Wrap mpdoctor's imports of a
    library with it, never the user's code.
    """
    import logging

    loggers = [logging.getLogger(name) for name in IMPORT_NOISE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
