"""Inference and generation in the kernel that trained: what the user holds to generate with (KV caches, 4D masks)."""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts, ModelFacts
from ...facts.inference import AttentionMaskFacts, KVCacheFacts
from ..engine.changes import CastCacheTensors, ClampMaskToDtype
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
from . import check

_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


def promoted(a: str, b: str) -> str:
    """The dtype ``torch.cat`` of two floating dtypes gives (fp16 with bf16 is fp32)."""
    if a == b:
        return a
    bits_a, bits_b = _BITS.get(a, 32), _BITS.get(b, 32)
    if bits_a == bits_b:
        return "float32"
    return a if bits_a > bits_b else b


def _generating_models(facts: Facts) -> list[ModelFacts]:
    """The transformers models a cache can be handed to, with a floating dtype."""
    return [m for m in facts.models if m.is_pretrained and m.tensors.main_dtype in _BITS]


def _cast_code(cache: KVCacheFacts, dtype: str) -> str:
    if cache.legacy:  # a tuple of (key, value) pairs: a new tuple, or each tensor's data in place as the fix does
        return (f"{cache.name} = type({cache.name})(tuple(t.to(torch.{dtype}) for t in layer) "
                f"for layer in {cache.name})")  # fmt: skip
    return (f"for layer in {cache.name}.layers:  # transformers < 4.56: {cache.name}.key_cache / value_cache\n"
            f"    layer.keys, layer.values = layer.keys.to(torch.{dtype}), layer.values.to(torch.{dtype})")  # fmt: skip


def _cast_fix(cache: KVCacheFacts, dtype: str) -> Fix:
    return Fix(
        f"Cast {cache.name}'s keys and values to {_SHORT.get(dtype, dtype)} (the model's dtype)",
        _cast_code(cache, dtype),
        applicability=Applicability.SAFE,
        changes=(CastCacheTensors(cache.ref, dtype, cache.name),),
        recipe="kv-cache-cast",
    )


def _consequence(cache: KVCacheFacts, dtype: str) -> tuple[Severity, str]:
    """The severity and what happens at the next call, for a cache whose tensors are not all in ``dtype``."""
    short = _SHORT.get(dtype, dtype)
    if cache.static:
        return Severity.ERROR, (
            f"the next forward copies {short} keys into it and fails "
            "(index_copy_(): self and source expected to have the same dtype)."
        )
    met = sorted({promoted(d, dtype) for d in cache.dtypes} - {dtype})
    converted = "once converted to a DynamicCache at the call, " if cache.legacy else ""
    if met:
        return Severity.ERROR, (
            f"{converted}the next forward concatenates its {short} keys onto them, gets {'/'.join(_SHORT.get(d, d) for d in met)} "
            f"keys and fails in attention (Expected query, key, and value to have the same dtype)."
        )
    return Severity.WARNING, (
        f"{converted}the next forward silently upcasts it to {short}: the cached prefix keeps the rounding of "
        f"{'/'.join(_SHORT.get(d, d) for d in cache.dtypes if d != dtype)}, so the continuation differs from the "
        f"model's own."
    )


@check("kv-cache-dtype-mismatch", Severity.ERROR, Severity.WARNING, fix_safety=(Applicability.SAFE,))
def kv_cache_dtype_mismatch(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A KV cache the user holds stores keys and values in another dtype than the model computes in.

    What it does
        A transformers cache held by name (``DynamicCache``, ``StaticCache``, an ``EncoderDecoderCache``, or the
        legacy format: a plain tuple of per-layer ``(key, value)`` pairs, converted with
        ``DynamicCache(ddp_cache_data=...)`` / ``from_legacy_cache`` at the call) whose stored key / value tensors are not in the dtype of every transformers model inspected beside it
        (a cache built before the model was cast to bf16 after fine-tuning, or cast by hand to save memory).
        An empty cache takes the model's dtype at its first update and is never reported; nor is a cache beside
        transformers models of different dtypes (which one it serves is not known).
    Why is this bad?
        ``model(..., past_key_values=cache)`` and ``generate(past_key_values=cache)`` meet the stored tensors
        at the first layer. A static cache copies the new keys into its buffers and fails
        (``index_copy_(): self and source expected to have the same dtype``). A dynamic cache concatenates:
        fp32 keys in a bf16 model (or fp16 with bf16) give fp32 keys and attention fails (``Expected query,
        key, and value to have the same dtype``); a bf16 cache in an fp32 model is silently upcast, and the
        prompt's keys keep their bf16 rounding.
    Example
        cache = model(prompt_ids, use_cache=True).past_key_values  # filled while the model was fp32
        model.to(torch.bfloat16)
        model.generate(next_ids, past_key_values=cache)  # RuntimeError: Expected query, key, and value ...
    Use instead
        model.to(torch.bfloat16)
        cache = model(prompt_ids, use_cache=True).past_key_values  # filled by the bf16 model
        model.generate(next_ids, past_key_values=cache)
    Fix safety
        Safe: the cache's keys and values are replaced by copies in the model's dtype, in place (the cache
        object stays the one the user holds; a ``StaticLayer``'s recorded ``dtype`` follows); undo puts the
        very tensors back. A legacy tuple cannot be re-bound: each of its tensors keeps its identity and takes
        cast data, undo gives it back its very storage.
    Severity
        Error when the next call fails (a static cache, or a dynamic one whose concatenation changes the
        keys' dtype); warning when a dynamic cache is silently upcast to the model's dtype.
    Sources
        transformers ``cache_utils`` (``DynamicLayer.update`` concatenates, ``StaticLayer.update`` uses
        ``index_copy_``); torch ``scaled_dot_product_attention``'s dtype check; transformers issue #30019
        (accelerate's fp32 output conversion turned a bf16 model's legacy cache into fp32, and generate failed).
    """
    models = _generating_models(facts)
    dtypes = {m.tensors.main_dtype for m in models}
    if len(dtypes) != 1:
        return  # no model, or models that disagree: which one a cache is for is not known
    (dtype,) = dtypes
    for cache in facts.kv_caches:
        if not cache.dtypes or set(cache.dtypes) == {dtype}:
            continue
        severity, consequence = _consequence(cache, dtype)
        held = "/".join(_SHORT.get(d, d) for d in cache.dtypes)
        names = ", ".join(m.name for m in models)
        yield rule.finding(
            cache.name,
            f"{cache.name} ({cache.class_name}) stores {held} keys and values while {names} computes in "
            f"{_SHORT.get(dtype, dtype)}: {consequence}",
            {"cache_dtypes": list(cache.dtypes), "model_dtype": dtype, "models": [m.name for m in models],
             "static": cache.static, "tensors": cache.tensors, "bytes": cache.bytes},  # fmt: skip
            [_cast_fix(cache, dtype)],
            severity=severity,
        )


def _eager(m: ModelFacts) -> bool:
    root = next((c for c in m.configs if not c.is_generation_config), None)
    return root is not None and root.attn_implementation == "eager"


def mask_clamp_fix(mask: AttentionMaskFacts) -> Fix:
    """Rebuild the held mask in place with its dtype's ``finfo.min`` where it holds ``-inf`` (safe)."""
    return Fix(
        f"Rebuild {mask.name} in place with torch.finfo(torch.{mask.dtype}).min where it holds -inf",
        f"{mask.name}.clamp_(min=torch.finfo({mask.name}.dtype).min)  # build it so: "
        f"mask.masked_fill(~allowed, torch.finfo(model.dtype).min)",
        applicability=Applicability.SAFE,
        changes=(ClampMaskToDtype(mask.ref, mask.name),),
        recipe="mask-dtype-min",
    )


@check("attention-mask-overflow", Severity.ERROR, Severity.INFO, fix_safety=(Applicability.SAFE,))
def attention_mask_overflow(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A 4D attention mask the user holds has rows made only of -inf: eager attention turns them into NaN.

    What it does
        A 4D additive attention mask held by name (``(batch, 1, query, key)``, ``0`` where attention is
        allowed, a large negative elsewhere) beside a transformers model, with query rows whose every entry
        is ``-inf``. The usual way to get one: the mask is filled with ``torch.finfo(torch.float32).min`` and
        cast to the fp16 model's dtype (``-3.4e38`` rounds to ``-inf`` in fp16); the rows of the left padding
        allow no key at all.
    Why is this bad?
        Softmax over a row of ``-inf`` is ``0/0``: NaN. In eager attention the padded rows' outputs are NaN,
        and at the next layer every real token meets them (``0 * NaN`` in the weighted sum of values): the whole
        sequence's logits are NaN. transformers builds its own masks with the compute dtype's ``finfo.min``,
        which is finite, so a fully masked row softmaxes to a harmless uniform row.
    Example
        mask = torch.zeros(b, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
        model(ids, attention_mask=mask.to(torch.float16))  # fp16 model: left-padded rows are -inf, logits NaN
    Use instead
        mask = torch.zeros(b, 1, n, n, dtype=model.dtype).masked_fill(~allowed, torch.finfo(model.dtype).min)
        model(ids, attention_mask=mask)
    Fix safety
        Safe: the mask's ``-inf`` entries become its dtype's ``finfo.min``, in place (the user's variable still
        names the same tensor object, whose data is replaced; nothing is rebound); what attention allows is
        unchanged. Undo gives the tensor back its very storage.
    Severity
        Error when a model beside it runs eager attention; info otherwise (torch's SDPA on this CPU keeps fully
        masked rows finite, eager attention and kernels that do not guard such rows do not).
    Sources
        transformers ``masking_utils`` (custom 4D masks are used as given; its own float masks use
        ``torch.finfo(dtype).min``); transformers issues on NaN logits with left padding in fp16.
    """
    models = [m for m in facts.models if m.is_pretrained]
    if not models:
        return
    eager = [m.name for m in models if _eager(m)]
    for mask in facts.attention_masks:
        if not mask.dead_rows:
            continue
        why = (" (torch.finfo(torch.float32).min rounds to -inf in fp16)" if mask.dtype == "float16"
               else "")  # fmt: skip
        where = (
            f"{', '.join(eager)} runs eager attention: those rows' softmax is NaN and the next layer spreads it to "
            "every token's logits."
            if eager
            else "torch's SDPA keeps such rows finite here; eager attention makes them NaN and spreads it to every token."
        )
        yield rule.finding(
            mask.name,
            f"{mask.name} ({mask.dtype} {tuple(mask.shape)}) has {mask.dead_rows} query rows made only of -inf"
            f"{why}: {where}",
            {"dtype": mask.dtype, "shape": list(mask.shape), "dead_rows": mask.dead_rows, "neg_inf": mask.neg_inf,
             "eager": eager},  # fmt: skip
            [mask_clamp_fix(mask)],
            severity=Severity.ERROR if eager else Severity.INFO,
        )


def _step(k: int | None) -> str:
    return "the prompt's prefill (step 0)" if k == 0 else f"decoding step {k}"


@check("probe-generation-nonfinite", Severity.ERROR)
def probe_generation_nonfinite(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A generation probe saw the logits or the sampling probabilities go NaN/Inf at some decoding step.

    What it does
        ``mpdoctor.probe(model, batch, generate=True)`` runs a few decoding steps of ``model.generate`` with
        hooks on every module and on the logits. This names the first step whose last-position logits, or
        their softmax in fp32 (what greedy search and sampling read), held NaN/Inf, and the step in which the
        first module whose output left its dtype's range ran (``probe-nonfinite`` names that module).
    Why is this bad?
        Greedy search takes the argmax of NaN logits (token 0, repeated) and sampling refuses them
        (``probability tensor contains either inf, nan or element < 0``): the text is garbage or generate
        raises. A step after the prefill going bad means the overflow grows with the cache (a longer context,
        a position, an accumulated residual), which a training forward on short sequences never shows.
    Example
        model.half()  # after fine-tuning in bf16
        mpdoctor.probe(model, {"input_ids": prompt}, generate=True)  # logits NaN from step 0
    Use instead
        model.to(torch.bfloat16)  # fp32's range; or keep the overflowing module in fp32
        model.generate(prompt, max_new_tokens=32)
    Fix safety
        No fix of its own: the module that overflowed carries the fixes (``probe-nonfinite``,
        ``probe-overflow``), which the generation probe checks on its own generate() call.
    Severity
        Error: the decoding steps the probe ran produced NaN/Inf.
    Sources
        transformers ``generate`` (``_sample``: argmax or ``torch.multinomial`` over the softmax of the
        last logits); mpdoctor's one-batch probe.
    """
    for p in facts.probes:
        g = getattr(p, "generation", None)
        if g is None or (g.first_bad_logits is None and g.first_bad_probs is None):
            continue
        hit = p.first_nonfinite()
        module = hit[0] if hit is not None and hit[1] == "forward" else None
        parts = []
        if g.first_bad_logits is not None:
            parts.append(f"its logits went NaN/Inf at {_step(g.first_bad_logits)}")
        if g.first_bad_probs is not None:
            parts.append(f"the probabilities at {_step(g.first_bad_probs)}")
        where = f"{p.model}.{module.path}" if module is not None and module.path else p.model
        first = (f"; the first module out of its dtype's range was {where} ({module.class_name}), "
                 f"at {_step(g.step_of(module.done))}" if module is not None else "")  # fmt: skip
        yield rule.finding(
            p.model,
            f"generate() on {p.model}: {' and '.join(parts)}, of {g.steps} step{'' if g.steps == 1 else 's'} run{first}.",
            {"steps": g.steps, "requested": g.requested, "first_bad_logits": g.first_bad_logits,
             "first_bad_probs": g.first_bad_probs, "logits_nonfinite": list(g.logits_nonfinite),
             "module": module.path if module is not None else None,
             "module_step": g.step_of(module.done) if module is not None else None},  # fmt: skip
        )
