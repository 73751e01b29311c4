"""Checks on the KV cache: caches built during training, including nested sub-configs; a held cache a failed call
left half-updated."""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts, ModelFacts
from ...knowledge import CACHE_CHANGES_LOGITS
from ..engine.changes import CropCacheLayers, SetAttrTo
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
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


@check("kv-cache-half-updated", Severity.ERROR, fix_safety=(Applicability.SAFE,))
def kv_cache_half_updated(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A dynamic KV cache the user holds whose layers hold different numbers of tokens.

    What it does
        A ``DynamicCache`` held by name whose self-attention layers disagree on their length (``cache.layers[i].keys``
        along the sequence dimension).
    Why is this bad?
        A forward appends the new tokens to each layer as it reaches it. When it raises part-way (a cache in the
        wrong dtype: the first layer concatenates, then attention refuses the mixed dtypes), the layers before the
        failing one have taken the new tokens and the others have not. ``get_seq_length()`` reads the first layer,
        so every later call builds its positions and mask for the wrong length: fixing the cause and running the
        cell again fails with "The size of tensor a (10) must match the size of tensor b (12)" (measured), or
        worse, runs with a misaligned cache.
    Example
        model.generate(ids, past_key_values=cache)  # raises in layer 1: layer 0 already holds the new tokens
        # cast the cache, run the cell again: RuntimeError: The size of tensor a ... must match ...
    Use instead
        cache.crop(min(layer.keys.shape[-2] for layer in cache.layers))  # the tokens every layer holds
        model.generate(ids, past_key_values=cache)
    Severity
        Error: any call that reuses the cache is built for the wrong length.
    Fix safety
        Safe, in place: every layer cropped to the length all of them hold (what the cache held before the call
        that failed in its first forward; before the failing step when it failed later), so the entries dropped
        are only those of the call that failed. Undo puts the very tensors back. Not offered for sliding-window
        layers, which count tokens beyond what they keep.
    Sources
        transformers ``cache_utils`` (``DynamicLayer.update`` concatenates per layer, ``Cache.get_seq_length``
        reads layer 0, ``DynamicCache.crop``); measured on a tiny Llama (tests/stack/test_cache_rollback.py).
    """
    for cache in facts.kv_caches:
        if len(set(cache.lengths)) < 2:
            continue
        keep = min(cache.lengths)
        shown = ", ".join(str(n) for n in cache.lengths[:6]) + (", ..." if len(cache.lengths) > 6 else "")
        yield rule.finding(
            cache.name,
            f"{cache.name} ({cache.class_name}) holds different numbers of tokens per layer ({shown}): a call failed "
            f"part-way through a forward, after the first layers had taken its tokens. Every call that reuses it "
            f"reads the first layer's length and fails or runs misaligned; all its layers hold the first {keep}.",
            {"lengths": list(cache.lengths), "keep": keep},
            [
                Fix(
                    f"Crop {cache.name} back to the {keep} tokens every layer holds",
                    f"{cache.name}.crop({keep})  # drops what the failed call appended to the first layers",
                    applicability=Applicability.SAFE,
                    changes=(CropCacheLayers(cache.ref, keep, cache.name),),
                    recipe="cache-crop",
                    cost="none: only the tokens of the call that failed are dropped",
                )
            ],
        )

