"""Hostile namespaces: diagnose() and %mpdoctor survive whatever a notebook kernel holds.

Namespaces are generated at random (hypothesis) from a pool built once per
session: tiny real models, optimizers, scalers, a Trainer whose optimizer is
None, DDP / ``torch.compile`` / PEFT wrappers, meta / multi-device /
zero-element / fp8-int8-uint8-bool-complex modules, a config missing
attributes; mixed with objects whose ``__getattr__``, ``__getattribute__``,
``__class__``, ``__len__``, ``__iter__`` raise or hang, MagicMocks, a lazy
module, weakref proxies (one dead), recursive containers and containers of
10^6 elements. A "hang" sleeps boundedly and records that it was called: the
property is that it never is.

Examples per run: :data:`HOSTILE_EXAMPLES` (500) namespaces for diagnose(),
:data:`MAGIC_EXAMPLES` through a real InteractiveShell. ``CI`` set in the
environment derandomizes hypothesis (a fixed sequence); locally it is random.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scenarios import (
    HOSTILE_CALLS,
    BrokenNamedModules,
    EvilDict,
    EvilStr,
    MetaHostile,
    UnprintableFailure,
    hostile_pool,
    lazy_module_is_unloaded,
)
from setups import tiny_llama

import mpdoctor
import mpdoctor.diagnosis
import mpdoctor.objects.discovery.subjects as discover_mod
from mpdoctor.objects.discovery.subjects import CONTAINER_DEPTH, CONTAINER_WIDTH
from mpdoctor.objects.readers.tensors import Tallier

HOSTILE_EXAMPLES = 500
MAGIC_EXAMPLES = 60
IN_CI = bool(os.environ.get("CI"))
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]

settings.register_profile(
    "mpdoctor-hostile", max_examples=HOSTILE_EXAMPLES, derandomize=IN_CI, deadline=None, suppress_health_check=_SUPPRESS
)
HOSTILE = settings.get_profile("mpdoctor-hostile")
MAGIC = settings(HOSTILE, max_examples=MAGIC_EXAMPLES)

#: Where a real object is put, and whether discovery must find it there.
PLACEMENTS = {
    "top": True,
    "alias": True,  # under two names: still one subject
    "list": True,
    "tuple": True,
    "dict": True,
    "nested": True,  # CONTAINER_DEPTH lists deep: the deepest discovery follows
    "too_deep": False,  # one level deeper
    "beyond_width": False,  # at index CONTAINER_WIDTH of a list
    "with_huge": True,  # next to a 10^6-element list in a tuple
    "dict_subclass": False,  # discovery never runs a dict subclass's methods
    "private": False,  # _name, as %who_ls skips it
    "hidden": False,  # in user_ns_hidden
    "object": True,  # passed positionally to diagnose()
}


@dataclass
class Generated:
    """One generated namespace and what diagnose() must make of it."""

    namespace: dict = field(default_factory=dict)
    objects: list = field(default_factory=list)
    hidden: set = field(default_factory=set)
    expected: list = field(default_factory=list)  # live objects, each exactly one subject
    forbidden: list = field(default_factory=list)  # real objects placed where discovery must not look
    tensors: int = 0
    scan: bool = False
    target: str | None = None

    def describe(self) -> str:
        names = {str(k): type(v).__name__ for k, v in dict.items(self.namespace)}
        objects = [type(o).__name__ for o in self.objects]
        return f"namespace={names} objects={objects} hidden={sorted(self.hidden)} scan={self.scan} target={self.target}"

    __repr__ = describe


def _nest(value: Any, levels: int) -> Any:
    for _ in range(levels):
        value = [value]
    return value


@st.composite
def namespaces(draw: st.DrawFn) -> Generated:
    pool = hostile_pool()
    gen = Generated()
    reals = draw(st.lists(st.sampled_from(range(len(pool.real))), max_size=6, unique=True))
    hostile = draw(st.lists(st.sampled_from(sorted(pool.hostile)), max_size=10, unique=True))
    huge = draw(st.lists(st.sampled_from(sorted(pool.huge)), max_size=2, unique=True))
    # Hostile objects are drawn by key: hypothesis itself must not touch them (a dead proxy raises on isinstance).
    filler_keys = hostile or ["none"]
    for i, index in enumerate(reals):
        real = pool.real[index]
        name = f"{draw(st.sampled_from(['m', 'obj', 'x', 'trainer', 'model', 'opt']))}_{i}"
        where = draw(st.sampled_from(sorted(PLACEMENTS)))
        junk = [pool.hostile[k] for k in draw(st.lists(st.sampled_from(filler_keys), max_size=3))]
        value = real.value
        if where == "top":
            gen.namespace[name] = value
        elif where == "alias":
            gen.namespace[name] = value
            gen.namespace[name + "_again"] = value
        elif where == "list":
            gen.namespace[name] = [*junk, value, *junk]
        elif where == "tuple":
            gen.namespace[name] = (*junk, value)
        elif where == "dict":
            gen.namespace[name] = {EvilStr("evil"): junk, 10**400: value, "key": value, 3: junk}
        elif where == "nested":
            gen.namespace[name] = _nest(value, CONTAINER_DEPTH)
        elif where == "too_deep":
            gen.namespace[name] = _nest(value, CONTAINER_DEPTH + 1)
        elif where == "beyond_width":
            gen.namespace[name] = [None] * CONTAINER_WIDTH + [value]
        elif where == "with_huge":
            gen.namespace[name] = (pool.huge["huge_list"], value)
        elif where == "dict_subclass":
            gen.namespace[name] = EvilDict(key=value)
        elif where == "private":
            gen.namespace["_" + name] = value
        elif where == "hidden":
            gen.namespace[name] = value
            gen.hidden.add(name)
        elif where == "object":
            gen.objects.append(value)
        if PLACEMENTS[where]:
            gen.expected.extend(real.objects)
            gen.tensors += real.tensors
        else:
            gen.forbidden.append(value)
    for key in hostile:
        gen.namespace[key] = pool.hostile[key]
        if draw(st.booleans()):
            gen.objects.append(pool.hostile[key])
    for key in huge:
        gen.namespace[key] = pool.huge[key]
    if draw(st.booleans()):
        gen.namespace[EvilStr("evil_name")] = pool.hostile[filler_keys[0]]
    # A real object that is forbidden in one place may be expected through another.
    expected_ids = {id(o) for o in gen.expected}
    gen.forbidden = [o for o in gen.forbidden if id(o) not in expected_ids]
    gen.scan = draw(st.booleans())
    gen.target = draw(st.sampled_from([None, None, "T4", "A100"]))
    return gen


def reachable_slots(namespace: dict, hidden: set) -> int:
    """How many values discovery may look at: names plus plain-container items within depth and width."""
    count = 0
    stack = [(v, 0) for k, v in dict.items(namespace) if type(k) is str and not k.startswith("_") and k not in hidden]
    seen: set[int] = set()
    while stack:
        value, depth = stack.pop()
        count += 1
        cls = type(value)
        if cls is list or cls is tuple or cls is dict:
            if depth >= CONTAINER_DEPTH or id(value) in seen:
                continue
            seen.add(id(value))
            items = list(dict.values(value))[:CONTAINER_WIDTH] if cls is dict else value[:CONTAINER_WIDTH]
            stack.extend((v, depth + 1) for v in items)
    return count


@dataclass
class Counts:
    classified_in_discovery: int = 0
    tallied_tensors: int = 0
    in_discovery: bool = False


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counts]:
    """Count class look-ups made by discovery and tensors tallied by fact gathering (our own functions)."""
    counts = Counts()
    classify, discover, add = discover_mod._classify, mpdoctor.diagnosis.discover, Tallier.add

    def counting_classify(cls: type):
        if counts.in_discovery:
            counts.classified_in_discovery += 1
        return classify(cls)

    def counting_discover(*a: Any, **k: Any):
        counts.in_discovery = True
        try:
            return discover(*a, **k)
        finally:
            counts.in_discovery = False

    def counting_add(self: Tallier, *a: Any, **k: Any) -> None:
        counts.tallied_tensors += 1
        add(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(discover_mod, "_classify", counting_classify)
        m.setattr(mpdoctor.diagnosis, "discover", counting_discover)
        m.setattr(Tallier, "add", counting_add)
        yield counts


def _subject_objects(report: mpdoctor.Report) -> list:
    return [s.obj for s in report.subjects]


def check_report_against(gen: Generated, report: mpdoctor.Report) -> None:
    """Every real object placed where discovery looks is exactly one subject; nothing else is."""
    objs = _subject_objects(report)
    for expected in gen.expected:
        hits = [o for o in objs if o is expected]
        assert len(hits) == 1, f"{type(expected).__name__} reported {len(hits)} times ({gen.describe()})"
    expected_ids = {id(o) for o in gen.expected}
    extra = [type(o).__name__ for o in objs if id(o) not in expected_ids]
    assert not extra, f"unexpected subjects {extra} ({gen.describe()})"
    for forbidden in gen.forbidden:
        assert not any(o is forbidden for o in objs), f"{type(forbidden).__name__} found where discovery must not look"


@pytest.fixture(scope="module", autouse=True)
def _pool():
    """Build the pool before hypothesis starts drawing (building seeds ``random``)."""
    return hostile_pool()


@HOSTILE
@given(gen=namespaces())
def test_diagnose_never_raises_never_calls_hostile_code_and_reports_each_real_subject_once(gen, monkeypatch):
    HOSTILE_CALLS.clear()
    pool = hostile_pool()
    with counting(monkeypatch) as counts:
        report = mpdoctor.diagnose(
            *gen.objects, namespace=gen.namespace, hidden=gen.hidden, scan=gen.scan, target=gen.target
        )
    assert HOSTILE_CALLS == [], f"hostile code ran: {HOSTILE_CALLS[:5]}"
    assert lazy_module_is_unloaded(pool.lazy), "diagnose() loaded a lazy module"
    assert isinstance(report, mpdoctor.Report)
    check_report_against(gen, report)
    # Work bounded by what discovery may look at and by the tensors, never by container sizes.
    slots = reachable_slots(gen.namespace, gen.hidden) + len(gen.objects)
    assert counts.classified_in_discovery <= slots + 40 * (len(report.subjects) + 1)
    # (3x: a subject whose facts fail is retried alone once, then the rest are gathered together.)
    assert counts.tallied_tensors <= 3 * gen.tensors
    # Every internal error names a deliberately broken subject or a check, and renders.
    for f in report.findings_for("internal-error"):
        assert f.subject and f.message
    assert "Traceback" not in report.to_text()


@MAGIC
@given(gen=namespaces(), flags=st.sampled_from(["", "--text", "--json", "--markdown", "--scan --text", "--target T4"]))
def test_the_magic_never_leaves_an_exception_in_the_cell(shell, capsys, gen, flags):
    HOSTILE_CALLS.clear()
    added = dict(gen.namespace)  # str-subclass keys included: user_ns can hold them
    shell.user_ns.update(added)
    try:
        capsys.readouterr()
        result = shell.run_cell(f"__r = %mpdoctor {flags}", store_history=False)
        named = [k for k in added if type(k) is str and k.isidentifier()][:3]
        result_named = shell.run_cell(f"%mpdoctor {' '.join(named)} --text", store_history=False)
        out = capsys.readouterr()
    finally:
        for k in added:
            shell.user_ns.pop(k, None)
        shell.user_ns.pop("__r", None)
    assert result.error_in_exec is None and result.error_before_exec is None, result
    assert result_named.error_in_exec is None, result_named
    assert "Traceback" not in out.out and "Traceback" not in out.err
    assert HOSTILE_CALLS == [], f"hostile code ran: {HOSTILE_CALLS[:5]}"


def test_a_rendering_failure_is_one_line_in_the_cell_and_the_report_is_still_returned(shell, capsys, monkeypatch):
    import mpdoctor.render.html as html_mod

    def broken(report):
        raise RuntimeError("renderer broke")

    monkeypatch.setattr(html_mod, "render_html", broken)  # our own renderer, not a library
    shell.user_ns["model"] = torch.nn.Linear(2, 2)
    try:
        result = shell.run_cell("__r = %mpdoctor", store_history=False)
        bare = shell.run_cell("%mpdoctor", store_history=False)
        out = capsys.readouterr()
        report = shell.user_ns.pop("__r", None)
    finally:
        shell.user_ns.pop("model", None)
    assert result.error_in_exec is None and bare.error_in_exec is None
    assert "Traceback" not in out.out + out.err
    assert "mpdoctor: could not display the report (RuntimeError: renderer broke)" in out.out
    assert isinstance(report, mpdoctor.Report)


# -- specific hostile objects, one by one -----------------------------------------------------


def test_a_module_whose_named_modules_raises_is_an_internal_error_finding_and_the_rest_is_reported():
    report = mpdoctor.diagnose(namespace={"broken": BrokenNamedModules(), "model": tiny_llama()})
    (err,) = report.findings_for("internal-error")
    assert err.subject == "broken" and "named_modules is broken" in err.message
    assert report.findings_for("cache-in-training")


def test_an_exception_that_cannot_be_printed_is_still_an_internal_error_finding():
    report = mpdoctor.diagnose(namespace={"broken": UnprintableFailure(), "model": tiny_llama()})
    errors = report.findings_for("internal-error")
    assert [e.subject for e in errors] == ["broken"]
    assert "_UnprintableError" in errors[0].message or "could not" in errors[0].message
    assert report.findings_for("cache-in-training")
    report.to_text(), report.to_html(), report.to_json(), report.to_markdown()


def test_a_hostile_metaclass_is_never_asked_anything():
    HOSTILE_CALLS.clear()
    mpdoctor.diagnose(namespace={"cls": MetaHostile, "obj": MetaHostile(), "box": [MetaHostile()], "d": {1: MetaHostile}})
    assert HOSTILE_CALLS == []


def test_dict_keys_that_are_not_plain_strings_or_small_ints_are_neither_named_nor_followed():
    HOSTILE_CALLS.clear()
    model = torch.nn.Linear(2, 2)
    report = mpdoctor.diagnose(namespace={"d": {EvilStr("k"): model, 10**5000: model, (1, 2): model}})
    assert report.subjects == () and HOSTILE_CALLS == []
    named = mpdoctor.diagnose(namespace={"d": {"k" * 500: model}})
    assert len(named.subjects[0].name) < 100  # a long key is shortened in the name


def test_a_namespace_that_is_a_dict_subclass_with_hostile_items_is_still_read():
    HOSTILE_CALLS.clear()
    model = torch.nn.Linear(2, 2)
    report = mpdoctor.diagnose(namespace=EvilDict(model=model))
    assert [s.name for s in report.subjects] == ["model"] and HOSTILE_CALLS == []


def test_a_trainer_before_train_has_no_optimizer_subject():
    pool = hostile_pool()
    trainer = next(r.value for r in pool.real if r.key == "trainer_without_optimizer")
    assert trainer.optimizer is None
    report = mpdoctor.diagnose(namespace={"trainer": trainer})
    assert {s.kind for s in report.subjects} == {"trainer", "model", "training_args", "accelerator"}
    assert not report.findings_for("internal-error")


def test_a_real_distributed_data_parallel_wrapper_is_one_model_subject():
    pool = hostile_pool()
    ddp = next(r.value for r in pool.real if r.key == "ddp")
    report = mpdoctor.diagnose(namespace={"ddp": ddp, "inner": ddp.module})
    (model,) = report.facts.models
    assert model.name == "ddp" and model.inner_class == "Sequential"


def test_meta_multi_device_zero_element_and_exotic_dtype_modules_are_tallied_without_reading_data():
    pool = hostile_pool()
    by_key = {r.key: r.value for r in pool.real}
    ns = {k: by_key[k] for k in ("meta_model", "two_devices", "zero_elements", "exotic_dtypes")}
    report = mpdoctor.diagnose(namespace=ns, scan=True)
    hist = report.histogram
    assert set(hist["object"]) == set(ns)
    assert {"float8_e4m3fn", "int8", "uint8", "bool", "complex64"} <= set(hist["dtype"])
    assert hist.query("object == 'two_devices'")["devices"].str.contains("meta").any()
    assert not [f for f in report.findings_for("internal-error") if f.subject in ns]


def test_exotic_dtypes_make_no_check_fail():
    pool = hostile_pool()
    exotic = next(r.value for r in pool.real if r.key == "exotic_dtypes")
    report = mpdoctor.diagnose(namespace={"exotic": exotic})
    failed = [f.subject for f in report.findings_for("internal-error")]
    assert failed == [], [f.message for f in report.findings_for("internal-error")]


def _shaped(n: int, model: torch.nn.Module) -> dict:
    """The huge pool's shape with ``n`` elements per container (the pool itself has 10^6)."""
    return {
        "huge_list": list(range(n)),
        "huge_tuple": tuple(range(n)),
        "huge_dict": dict.fromkeys(range(n)),
        "huge_set": set(range(n)),
        "huge_range": range(n),
        "box": (list(range(n)), [dict.fromkeys(range(n)), model]),
    }


def _discovery_work(monkeypatch, ns: dict) -> tuple[int, int]:
    """(class look-ups, dict keys read) of one ``discover`` over ``ns``: work counts, not times."""
    keys_read = []
    real_label = discover_mod._key_label
    with counting(monkeypatch) as counts, monkeypatch.context() as m:
        m.setattr(discover_mod, "_key_label", lambda key: keys_read.append(key) or real_label(key))
        counts.in_discovery = True
        subjects = discover_mod.discover(namespace=ns)
    assert [s.name for s in subjects] == ["box[1][1]"]
    return counts.classified_in_discovery, len(keys_read)


def test_huge_containers_are_not_iterated_beyond_the_container_width(monkeypatch):
    """Discovery over 10^6-element containers does the same work as over 10^3-element ones: as many class
    look-ups and dict keys read (work counts, which load on the machine cannot change)."""
    pool = hostile_pool()
    model = torch.nn.Linear(2, 2)
    ns = dict(pool.huge)
    ns["box"] = (pool.huge["huge_list"], [pool.huge["huge_dict"], model])
    assert set(_shaped(3, model)) == set(ns)
    with counting(monkeypatch) as counts:
        report = mpdoctor.diagnose(namespace=ns)
    assert [s.name for s in report.subjects] == ["box[1][1]"]
    assert counts.classified_in_discovery <= reachable_slots(ns, set()) + 40 * 2 < 200
    huge_work = _discovery_work(monkeypatch, ns)
    assert huge_work[1] <= CONTAINER_WIDTH  # the 10^6-key dict is read CONTAINER_WIDTH keys deep
    assert huge_work == _discovery_work(monkeypatch, _shaped(1000, model))  # 1,000x the elements, the same work


def test_discovering_100k_plain_objects_reads_each_value_once_and_never_its_attributes(monkeypatch):
    """Discovery of 100,000 plain objects: at most one class look-up per value, no attribute read on any of them
    (a ``__getattr__`` that counts), one subject. Work counts instead of a wall-clock ratio."""
    calls = []

    class Plain:
        def __getattr__(self, name):
            calls.append(name)
            raise AttributeError(name)

    ns = {f"v{i}": (Plain() if i % 3 == 0 else i if i % 3 == 1 else str(i)) for i in range(100_000)}
    ns["model"] = torch.nn.Linear(2, 2)
    with counting(monkeypatch) as counts:
        counts.in_discovery = True
        subjects = discover_mod.discover(namespace=ns)
    assert [s.name for s in subjects] == ["model"]
    assert counts.classified_in_discovery <= len(ns)
    assert calls == []
