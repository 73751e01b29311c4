"""Formatting shared by the text, HTML, markdown and widget renderers: plain data in, short words out.

Nothing here imports torch or touches a live object: evidence dicts, report
views and fact tuples are read as plain data. :func:`layer_rows` is the one
place that knows where per-parameter dtypes live in a report's facts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

from ..knowledge import SHORT_DTYPE  # noqa: F401  (renderers' import point; the table is torch-free)

#: How people say a dtype in a sentence.
SPOKEN_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}
#: Largest finite values of the half-precision formats (the probe chart draws both).
FP16_MAX = 65504.0
BF16_MAX = 3.3895313892515355e38
#: A list or dict in evidence longer than this is summarised and the full value folded away.
EVIDENCE_INLINE_ITEMS = 6

_IRREGULAR = {"info": "info", "kind": "kinds", "evidence": "evidence", "data": "data", "analysis": "analyses"}


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "error") == "1 error"``, ``plural(2, "error") == "2 errors"``; ``many`` for irregular words."""
    if n == 1:
        return f"{n} {word}"
    if many is None:
        many = _IRREGULAR.get(word) or (word[:-1] + "ies" if word.endswith("y") and word[-2:-1] not in "aeiou" else word + ("es" if word.endswith(("s", "x", "ch", "sh")) else "s"))
    return f"{n} {many}"


_COUNTED = re.compile(r"\b1 (\w+?)s\b")


def singular_counts(text: str) -> str:
    """Mend titles written for plurals when a count is 1: ``"Cast 1 parameters of 1 modules"`` -> ``"Cast 1 parameter of 1 module"``."""
    return _COUNTED.sub(lambda m: f"1 {m.group(1)}", text)


def precision_word(mode: Any) -> Any:
    """accelerate's ``"no"`` mixed precision is fp32 to a reader; other values unchanged."""
    return "fp32" if mode == "no" else mode


def dtype_word(dtype: str) -> str:
    """``"float32"`` -> ``"fp32"``."""
    return SPOKEN_DTYPE.get(dtype, SHORT_DTYPE.get(dtype, dtype))


def rst_to_plain(text: str) -> str:
    """Docstring reStructuredText for people: ````x```` -> ``x``, ``:func:`x``` -> ``x``."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def format_number(value: Any, digits: int = 3) -> str:
    """A number as people read it: ``70000.0`` -> ``"70,000"``, ``1.2e+38`` stays short, NaN/inf spelled out."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == int(value) and abs(value) < 1e6:
        return f"{int(value):,}"
    return f"{value:.{digits}g}"


def short_list(items: list[Any], limit: int = 6) -> str:
    """``0, 4, 8, ...`` : the first ``limit`` items, then an ellipsis when there are more."""
    head = ", ".join(str(i) for i in items[:limit])
    return head + (", ..." if len(items) > limit else "")


# -- module paths -------------------------------------------------------------------------------

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_KINDS = (
    ("MLP projection", re.compile(r"(gate_proj|up_proj|down_proj|fc_?1|fc_?2|c_fc|c_proj\b.*mlp|mlp\.|dense_h_to_4h|dense_4h_to_h|\bw[123]$|wi|wo$|experts)")),
    ("attention projection", re.compile(r"(q_proj|k_proj|v_proj|o_proj|qkv|c_attn|query|key|value|attn|attention|out_proj)")),
    ("norm", re.compile(r"(norm|ln_|\bln\b|layernorm)")),
    ("embedding", re.compile(r"(embed|wte|wpe|tok_embeddings)")),
    ("output head", re.compile(r"(lm_head|classifier|score|head)$")),
)


def layer_of(path: str) -> int | None:
    """The first integer component of a module path (``model.layers.12.mlp.up_proj`` -> 12), or None."""
    m = _LAYER_INDEX.search(path)
    return int(m.group(1)) if m else None


def model_part(path: str) -> str:
    """The part of a model a module path names, for summaries: ``"MLP projection"``, ``"attention projection"``,
    ``"norm"``, ``"embedding"``, ``"output head"``, else ``"module"``."""
    low = path.lower()
    for label, pattern in _KINDS:
        if pattern.search(low):
            return label
    return "module"


def summarize_modules(modules: dict[str, Any], roles: dict[str, str] | None = None) -> list[str]:
    """Group module paths by kind, role and dtypes into sentences.

    ``{"model.layers.0.mlp.up_proj": ["float32"], ...}`` ->
    ``["24 MLP projections in 6 layers are fp32: layers 0, 4, 8, 12, 16, 20"]``.
    """
    roles = roles or {}
    groups: dict[tuple[str, str, str], list[str]] = {}
    for path, dtypes in modules.items():
        values = dtypes if isinstance(dtypes, (list, tuple)) else [dtypes]
        words = "/".join(dtype_word(str(d)) for d in values)
        role = roles.get(path, "")
        groups.setdefault((model_part(path), role if role not in ("", "compute", "norm", "native-norm") else "", words), []).append(path)
    out = []
    for (kind, role, words), paths in groups.items():
        label = f"{role} {kind}" if role else kind
        layers = sorted({i for i in (layer_of(p) for p in paths) if i is not None})
        what = plural(len(paths), label)
        verb = "is" if len(paths) == 1 else "are"
        if len(layers) > 1:
            out.append(f"{what} in {len(layers)} layers {verb} {words}: layers {short_list(layers)}")
        elif len(paths) == 1:
            out.append(f"{paths[0]} is {words}")
        else:
            out.append(f"{what} {verb} {words}: {short_list(paths, 3)}")
    return out


# -- evidence ---------------------------------------------------------------------------------


class EvidenceItem(NamedTuple):
    """One fact of a finding as shown: ``key``, a short ``summary``, and the ``full`` value when it was folded."""

    key: str
    summary: str
    full: str | None


def _plain(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e6:
        return f"{int(value)}"  # a finding's message writes a measured value with :g (scale 65536): the evidence agrees
    if isinstance(value, float):
        return format_number(value, 4)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_plain(v)}" for k, v in value.items()) + "}"
    return str(value)


def _full_lines(value: Any) -> str:
    if isinstance(value, dict):
        return "\n".join(f"{k}: {_plain(v)}" for k, v in value.items())
    return "\n".join(_plain(v) for v in value)


def summarize_evidence(evidence: dict) -> list[EvidenceItem]:
    """The evidence of a finding, each long list or dict summarised with its full value kept for folding.

    ``modules`` and ``roles`` (module path -> dtypes / role) become one
    ``modules`` item in words; any other list or dict longer than
    :data:`EVIDENCE_INLINE_ITEMS` is counted; floats are rounded; empty
    lists, dicts and strings are left out.
    """
    items: list[EvidenceItem] = []
    modules = evidence.get("modules")
    roles = evidence.get("roles") if isinstance(evidence.get("roles"), dict) else None
    for key, value in evidence.items():
        if key == "roles" and isinstance(modules, dict):
            continue  # folded into the modules summary
        if isinstance(value, (list, tuple, dict, str)) and not value:
            continue  # an empty field says nothing to a reader (``patched_forwards=[]``); to_dict() keeps it
        if key == "modules" and isinstance(value, dict) and value:
            full = "\n".join(
                f"{path}: {_plain(d)}" + (f" ({roles[path]})" if roles and path in roles else "")
                for path, d in value.items()
            )
            sentences = summarize_modules(value, roles)
            folded = len(value) > 1 or len(full) > 80
            items.append(EvidenceItem(key, "; ".join(sentences), full if folded else None))
        elif isinstance(value, (list, tuple, dict)) and len(value) > EVIDENCE_INLINE_ITEMS:
            noun = "entries" if isinstance(value, dict) else "items"
            head = list(value)[:3]
            items.append(EvidenceItem(key, f"{len(value)} {noun}: {', '.join(_plain(h) for h in head)}, ...", _full_lines(value)))
        else:
            items.append(EvidenceItem(key, _plain(value), None))
    return items


# -- the per-layer strip ----------------------------------------------------------------------


class ParamRow(NamedTuple):
    """One parameter as the layer strip reads it."""

    model: str
    name: str
    dtype: str
    numel: int


class LayerStrip(NamedTuple):
    """A grid of one model: ``cells[(layer, kind)] = dtypes`` over ``layers`` x ``kinds``."""

    model: str
    layers: list[int]
    kinds: list[str]
    cells: dict[tuple[int, str], tuple[str, ...]]
    differing: list[int]


#: Models with at least this many numbered layers get a strip.
STRIP_MIN_LAYERS = 4

def _place(name: str) -> tuple[int, str] | None:
    """``model.layers.3.mlp.up_proj.weight`` -> ``(3, "mlp.up_proj")``; None outside numbered layers.

    The layer is the first integer component; the column is the module path under it, with any
    further indices folded to ``*`` (``experts.17.down_proj`` -> ``experts.*.down_proj``), so a
    mixture of 256 experts is 3 rows of the strip, not 768. A parameter held directly by the
    numbered module is in the column named after its container (``layers.*``).
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            inner = parts[i + 1 : -1]
            if inner:
                column = ".".join(["*" if q.isdigit() else q for q in inner])
            else:
                column = f"{parts[i - 1]}.*" if i else "*"
            return int(part), column
    return None


def layer_strips(rows: Iterable[ParamRow], min_layers: int = STRIP_MIN_LAYERS) -> list[LayerStrip]:
    """Per model with ``min_layers`` or more numbered layers: layer index x module kind -> dtypes.

    ``differing`` lists the layers whose row is not the most common row, the
    ones a reader should look at. One pass of string splits per parameter: a
    50,000-tensor model draws in tens of milliseconds.
    """
    by_model: dict[str, dict[tuple[int, str], list[str]]] = {}
    kinds_of: dict[str, dict[str, None]] = {}
    for r in rows:
        placed = _place(r.name)
        if placed is None:
            continue
        cells = by_model.get(r.model)
        if cells is None:
            cells = by_model[r.model] = {}
            kinds_of[r.model] = {}
        kinds_of[r.model][placed[1]] = None
        dtypes = cells.get(placed)
        if dtypes is None:
            cells[placed] = [r.dtype]
        elif r.dtype not in dtypes:
            dtypes.append(r.dtype)
    strips = []
    for model, cells in by_model.items():
        kinds = list(kinds_of[model])
        layers = sorted({layer for layer, _ in cells})
        if len(layers) < min_layers:
            continue
        frozen = {k: tuple(sorted(v)) for k, v in cells.items()}
        signature = {layer: tuple(frozen.get((layer, k), ()) for k in kinds) for layer in layers}
        counts: dict[tuple, int] = {}
        for sig in signature.values():
            counts[sig] = counts.get(sig, 0) + 1
        common = max(counts, key=counts.get)
        differing = [layer for layer in layers if signature[layer] != common]
        strips.append(LayerStrip(model, layers, kinds, frozen, differing))
    return strips


# -- numerics -----------------------------------------------------------------------------------


class ProbeBar(NamedTuple):
    """One module of the probe chart: its largest forward output and backward gradient (None: not seen)."""

    module: str
    out_absmax: float | None
    grad_absmax: float | None


def probe_bars(rows: list[dict]) -> list[ProbeBar]:
    """The probe table's rows (``report.probe_table`` as records) as chart bars, in forward order."""
    out = []
    for r in rows:
        out.append(ProbeBar(str(r.get("module", "")), _float(r.get("out_absmax")), _float(r.get("grad_absmax"))))
    return out


def _float(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def scan_summary(rows: list[dict]) -> dict:
    """What the value scan found in numbers: values read, NaN, Inf, the largest abs value and fp16 headroom."""
    if not rows:
        return {}
    finite = [r["absmax"] for r in rows if isinstance(r.get("absmax"), (int, float)) and math.isfinite(r["absmax"])]
    peak = max(finite) if finite else 0.0
    return {
        "rows": len(rows),
        "values": sum(r.get("elements", 0) for r in rows),
        "nan": sum(r.get("nan", 0) for r in rows),
        "inf": sum(r.get("inf", 0) for r in rows),
        "absmax": peak,
        "fp16_overflow": sum(r.get("fp16_overflow", 0) for r in rows),
        "fp16_headroom": (FP16_MAX / peak) if peak else math.inf,
    }


def fix_label(title: str, limit: int = 90) -> tuple[str, str]:
    """A button label and its full text: the API hint for confirmation is dropped (the button asks itself)."""
    full = singular_counts(title)
    short = re.sub(r":\s*apply\(confirm=True\)\)", ")", full)
    if len(short) > limit:
        cut = short[: limit - 1]
        head = cut.rsplit(" ", 1)[0]  # at a word when one ends in the second half, else mid-name
        short = (head if len(head) > limit // 2 else cut) + "\u2026"
    return short, full


# -- the cause of an exception ----------------------------------------------------------------------------


def cause_label(report: Any) -> str | None:
    """``"cause of RuntimeError: ..."`` when the report's first finding is the cause of an exception, else None."""
    cause = getattr(report, "cause", None)
    findings = getattr(report, "findings", None)
    if cause is None or not findings or findings[0] is not cause:
        return None
    raised_by = getattr(report, "raised_by", None)
    by = f" (raised by {raised_by})" if raised_by else ""
    return f"cause of {getattr(report, 'exception', None) or 'the exception'}{by}"


def cause_layout(findings: list[dict]) -> tuple[list[int], list[int]]:
    """Under an exception's heading: the findings shown open (the cause, and the finding holding the planned fix
    that resolves it when the cause's own fixes are alternatives: the plan is never folded away) and those
    folded under "also found", as indices into ``findings`` (the cause first)."""
    if not findings:
        return [], []
    rest = list(range(1, len(findings)))
    cause = findings[0]
    if any(fx.get("planned") and fx.get("applicability") != "display-only" for fx in cause["fixes"]):
        return [0], rest
    named = {m.group(1) for fx in cause["fixes"] if (m := _RESOLVED_BY.search(fx.get("note") or ""))}
    lifted = [i for i in rest if any(fx.get("planned") and fx["title"] in named for fx in findings[i]["fixes"])]
    return [0, *lifted], [i for i in rest if i not in lifted]


#: An alternative's note naming the planned fix that resolves its finding (``treatment.plan`` writes it).
_RESOLVED_BY = re.compile(r"the planned fix '(.+)' already resolves")


def also_found_label(count: int) -> str:
    """The heading the findings after an exception's cause are folded under."""
    return f"also found ({count})"


def fix_kind(fx: dict, siblings: list[dict]) -> str:
    """How every renderer labels a fix (text, static HTML, widget): its applicability (``safe``, ``unsafe``,
    ``display-only``), prefixed ``alternative, `` when the plan holds another fix of the finding instead.

    A display-only fix is never planned (nothing changes in place); it is an alternative only beside a fix
    that is planned, else it is the advice itself.
    """
    kind = fx.get("applicability") or ("safe" if fx.get("safe") else "unsafe")
    if fx.get("planned", True):
        return kind
    if kind == "display-only" and not any(s.get("planned") and s is not fx for s in siblings):
        return kind
    return f"alternative, {kind}"


# -- fix buttons --------------------------------------------------------------------------------------------


def proof_words(proof: str) -> str:
    """What a fix's proof record claims, in a few words for its button (the record itself is in its tooltip)."""
    if not proof:
        return "not tried on your step"
    if proof.startswith("verified on your step together with"):
        return "verified on your step with the plan"
    if proof.startswith("verified on your step"):
        return "verified on your step"
    if proof.startswith("checked on"):
        return "checked, not on your step"
    return "not verified on your step"


def alternative_to(fx: dict, siblings: list[dict]) -> str:
    """The planned fix ``fx`` is an alternative to: its finding's planned fix, or the one its note names ("")."""
    planned = next((s for s in siblings if s is not fx and s.get("planned")), None)
    if planned is not None:
        return singular_counts(planned["title"])
    named = _RESOLVED_BY.search(fx.get("note") or "")
    return singular_counts(named.group(1)) if named else ""


def fix_button_label(fx: dict, siblings: list[dict], limit: int = 90) -> str:
    """A fix button's label: what it changes, whether it is safe, whether it was verified on the user's step, and
    for an alternative, what it is an alternative to."""
    short, _ = fix_label(fx["title"], limit)
    safe = fx.get("safe", fx.get("applicability") == "safe")
    facts = ["safe" if safe else "unsafe", proof_words(fx.get("proof") or "")]
    if fx.get("planned") is False:
        other = alternative_to(fx, siblings)
        facts.append(f"alternative to “{fix_label(other, limit // 2)[0]}”" if other else "alternative, not in the plan")
    return f"{'' if safe else chr(0x26A0) + ' '}{short} ({'; '.join(facts)})"
