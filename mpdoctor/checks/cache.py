"""Checks on the KV cache: caches built during training, including nested sub-configs."""

from __future__ import annotations

from collections.abc import Iterator

from ..facts import Facts, ModelFacts
from ..knowledge import CACHE_CHANGES_LOGITS
from ..treatment.changes import SetAttrTo
from ..treatment.findings import Finding, Severity
from ..treatment.fixes import Fix
from ..treatment.rules import Applicability, Rule
from . import check


def _cached(m: ModelFacts) -> list:
    return [c for c in m.configs if c.use_cache is True]


def _transformers_before(version: str | None, major: int, minor: int) -> bool:
    try:
        parts = [int(x) for x in (version or "").split(".")[:2]]
        return (parts[0], parts[1]) < (major, minor)
    except (ValueError, IndexError):
        return False


def cache_off_fix(m: ModelFacts):
    """Set ``use_cache=False`` on every config and sub-config (and the generation config) of ``m``."""
    configs = _cached(m)
    code = "\n".join(f"{c.path}.use_cache = False" for c in configs)
    where = ", ".join(c.key for c in configs)
    return Fix(
        f"Set use_cache=False on {where}",
        code, applicability=Applicability.SAFE,
        changes=tuple(SetAttrTo(c.ref, "use_cache", False, f"{c.path}.use_cache") for c in configs),
        recipe="cache-off",
    )


@check("cache-in-training", Severity.INFO, Severity.ERROR, fix_safety=(Applicability.SAFE,))
def cache_in_training(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A model in training mode whose config (or a nested sub-config) keeps ``use_cache=True``.

    What it does
        ``use_cache=True`` on a model in train mode, on the root config or on a
        nested one (``Gemma3ForConditionalGeneration`` has only
        ``config.text_config.use_cache``, so ``model.config.use_cache = False``
        is not enough).
        A transformers model with gradient checkpointing on is left to
        ``gradient-checkpointing-with-cache``: transformers then drops the
        cache at every training forward itself.
    Why is this bad?
        Every training forward builds and returns a KV cache nobody reads:
        memory spent for nothing, and incompatible with gradient checkpointing.
        With accelerate's fp32 output conversion wrapped around ``forward``
        (fp16/bf16 mixed precision) and transformers before 4.51, cache classes
        carrying a ``.dtype`` attribute are taken for tensors and crash:
        ``'HybridCache' object has no attribute 'float'``.
    Example
        model.train()
        out = model(**batch)  # config.use_cache is True: the forward builds a KV cache
    Use instead
        model.config.use_cache = False  # and config.text_config.use_cache on multimodal models
        model.train()
        out = model(**batch)
    Severity
        Error when the crash combination is present (a wrapped forward and transformers before 4.51);
        info otherwise: the default ``use_cache=True`` of every transformers config is harmless in the
        healthy QLoRA, PEFT, FSDP and DeepSpeed recipes (the cache is dropped after each forward).
    Fix safety
        Set ``use_cache=False`` on the config, every sub-config and the
        generation config, in place (undo it before ``generate()``, which
        reads the generation config). Not offered for recurrent/hybrid model
        types where the uncached path computes differently.
    Sources
        LLaMA-Factory #7373; transformers issue #36814 and PR #37044.
    """
    tf_version = facts.runtime.versions.get("transformers")
    for m in facts.models:
        if not m.training or (m.tensors.gradient_checkpointing and m.is_pretrained):
            continue
        cached = [c for c in _cached(m) if not c.is_generation_config]
        if not cached:
            continue
        crash = m.forward_wrapped and _transformers_before(tf_version, 4, 51)
        nested = [c for c in cached if c.key != "config"]
        fixes = [] if (m.model_type or "") in CACHE_CHANGES_LOGITS else [cache_off_fix(m)]
        flags = ", ".join(f"{c.path}.use_cache" for c in cached)
        msg = (
            f"{m.name} is in training mode with {flags} = True: every forward builds a KV cache nobody reads"
            + (
                ", and accelerate's fp32 output conversion will crash on it ('...Cache' object has no attribute 'float')."
                if crash
                else f" (memory for nothing; setting only {m.config_path}.config.use_cache is not enough here)." if nested
                else " (memory for nothing, freed after each step)."
            )
        )
        yield rule.finding(
            cached[0].path + ".use_cache",
            msg,
            {
                "training": True,
                "use_cache_true": [c.path for c in cached],
                "forward_wrapped_fp32": m.forward_wrapped,
                "transformers": tf_version,
                "model_type": m.model_type,
            },
            fixes,
            severity=Severity.ERROR if crash else Severity.INFO,
        )


@check("gradient-checkpointing-with-cache", Severity.INFO, Severity.WARNING, fix_safety=(Applicability.SAFE,))
def gradient_checkpointing_with_cache(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """Gradient checkpointing switched on while the cache is still on.

    What it does
        A model with gradient checkpointing enabled on some module (the
        ``gradient_checkpointing`` flag that transformers' ``activation_checkpointing_enable()``
        and its alias ``gradient_checkpointing_enable()`` set) and
        ``use_cache=True`` on a config or sub-config. Info for a transformers
        model, warning for other modules.
    Why is this bad?
        The two are incompatible: a transformers model drops the cache at every
        training forward and logs "use_cache=True is incompatible with gradient
        checkpointing" (so the flag says the opposite of what runs); in custom
        modules recomputation in backward meets a cache built in forward and
        the memory checkpointing saves is spent on the cache.
    Example
        model.gradient_checkpointing_enable()
        model.train()  # config.use_cache is still True
    Use instead
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        model.train()
    Severity
        Info for a transformers model (it drops the cache itself and warns); warning for other modules,
        where the cache defeats the memory checkpointing saves.
    Fix safety
        Set ``use_cache=False`` on every config and sub-config (and the
        generation config), in place.
    Sources
        transformers ``GradientCheckpointingLayer``: "use_cache=True is incompatible with gradient checkpointing".
    """
    for m in facts.models:
        if not m.tensors.gradient_checkpointing:
            continue
        cached = [c for c in _cached(m) if not c.is_generation_config]
        if not cached:
            continue
        flags = ", ".join(f"{c.path}.use_cache" for c in cached)
        msg = (
            f"{m.name} has gradient checkpointing on while {flags} is True; transformers drops the cache at every "
            "training forward and warns, so the flag says the opposite of what runs."
            if m.is_pretrained
            else f"{m.name} has gradient checkpointing on while {flags} is True; the cache defeats the memory "
            "checkpointing saves."
        )
        yield rule.finding(
            cached[0].path + ".use_cache",
            msg,
            {"gradient_checkpointing": True, "use_cache_true": [c.path for c in cached]},
            [] if (m.model_type or "") in CACHE_CHANGES_LOGITS else [cache_off_fix(m)],
            severity=Severity.INFO if m.is_pretrained else Severity.WARNING,
        )
