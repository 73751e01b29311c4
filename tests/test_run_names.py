"""The run's reports name every object by the name the user gave it, in a notebook that rebuilds its objects.

Notebook 09's pattern: a ``fresh()`` helper rebuilds ``model``, ``optimizer`` and the scaler as globals before each
lesson, so freed objects' ids are handed to new objects of other kinds. A name found through an id must never
follow the id to another object (the GradScaler was once called ``optimizer``).
"""

from __future__ import annotations

import gc
import re

import pytest
import torch
from notebook_shell import loaded_shell

from mpdoctor.attach.runtime.protocol import ProtocolObserver, modules_in_user_frames

pytestmark = pytest.mark.colab

FRESH = """
import torch
def fresh(init_scale=65536.0):
    global model, optimizer, amp_scaler
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    amp_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
x = torch.randn(16, 8)
"""

#: A lesson whose loop unscales twice before update(): the protocol finding names the scaler and the optimizer.
UNSCALE_TWICE = """
fresh()
for _ in range(2):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    amp_scaler.scale(loss).backward()
    amp_scaler.unscale_(optimizer)
    try:
        amp_scaler.unscale_(optimizer)
    except RuntimeError:
        pass
    amp_scaler.step(optimizer)
    amp_scaler.update()
"""


@pytest.fixture
def shell():
    with loaded_shell(("model", "optimizer", "amp_scaler", "fresh", "x", "loss", "r")) as sh:
        yield sh


#: Run at module level, as a notebook cell runs (its frame's locals are its globals: nothing else holds the objects).
REUSE = """
optimizer = Thing()
first = observer._name(optimizer, "default")
freed = id(optimizer)
del optimizer
gc.collect()
entry = observer._found_names.get(freed)
stale = entry is not None and entry[0]() is not None  # a cached name that could still match an object
alive, amp_scaler = [], None
for _ in range(100_000):  # CPython usually hands a freed block to a later object of the same size
    candidate = Thing()
    if id(candidate) == freed:
        amp_scaler = candidate
        break
    alive.append(candidate)
second = observer._name(amp_scaler, "default") if amp_scaler is not None else None
"""


def test_a_name_found_for_a_freed_object_is_never_given_to_the_object_that_reuses_its_id():
    class Thing:
        pass

    ns = {"Thing": Thing, "observer": ProtocolObserver(), "gc": gc}
    exec(REUSE, ns)
    assert ns["first"] == "optimizer"
    # The invariant: a name cached for an object dies with it, whatever object gets its id next.
    assert not ns["stale"]
    if ns["amp_scaler"] is not None:  # and when the interpreter did hand the id on (usual), the new object is
        assert ns["second"] == "amp_scaler"  # named by its own name, never the freed optimizer's


def test_every_string_of_a_lesson_report_names_the_scaler_amp_scaler_across_rebuilt_lessons(shell, capsys):
    shell.run_cell(FRESH, store_history=True)
    for _lesson in range(4):
        shell.run_cell(UNSCALE_TWICE, store_history=True)
    from mpdoctor.attach.runtime import session

    observer = session.observer(shell)
    found = [f for f in observer.findings if f.check == "amp-unscale-twice"]
    assert found, "the lessons unscale twice: the watcher must say so"
    report = session.cell_report(observer, found)
    text = report.to_text() + report.to_html() + report.to_json()
    assert "amp_scaler" in text
    # the scaler is never called by another object's name, in messages, evidence or fix code
    assert not re.search(r"optimizer\.(unscale_|update|step)\(optimizer\)", text)
    assert "scaler = optimizer" not in text and "scaler = model" not in text
    for f in found:
        assert f.evidence.get("scaler", "amp_scaler") == "amp_scaler", f.evidence


def test_parameters_whose_gradients_overflow_are_named_by_module_path_in_a_notebook(shell):
    shell.run_cell(FRESH, store_history=True)
    shell.run_cell("""
fresh(init_scale=1024.0)
for i in range(30):
    # Every other batch carries values past fp16's 65504 into the model: inf whatever the scale.
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x * (1e5 if i % 2 else 1.0)).float().pow(2).mean()
    amp_scaler.scale(loss).backward()
    amp_scaler.step(optimizer)
    amp_scaler.update()
""", store_history=True)
    from mpdoctor.attach.runtime import session

    observer = session.observer(shell)
    unsettled = [f for f in observer.findings if f.check == "amp-scale-unsettled"]
    assert unsettled, [f.check for f in observer.findings]
    named = unsettled[0].evidence.get("overflow_params") or {}
    assert named and all(n.startswith("model.") for n in named), named
    assert "param_groups" not in unsettled[0].message


def test_modules_in_user_frames_lists_the_callers_models_by_name():
    net = torch.nn.Linear(2, 2)
    head = torch.nn.Linear(2, 1)
    found = dict(modules_in_user_frames())
    assert found.get("net") is net and found.get("head") is head


#: A lesson that unscales twice with nothing to catch it: the watcher, the cell reader and the crash hook all see it.
UNSCALE_TWICE_RAISES = """
fresh()
optimizer.zero_grad()
with torch.autocast("cpu", dtype=torch.float16):
    loss = model(x).float().pow(2).mean()
amp_scaler.scale(loss).backward()
amp_scaler.unscale_(optimizer)
amp_scaler.unscale_(optimizer)
amp_scaler.step(optimizer)
amp_scaler.update()
"""


def test_mpdoctor_after_a_crash_shows_the_mistake_once_as_the_cause(shell, capsys):
    shell.run_cell(FRESH, store_history=True)
    crash_cell = shell.execution_count
    result = shell.run_cell(UNSCALE_TWICE_RAISES, store_history=True)
    assert isinstance(result.error_in_exec, RuntimeError) and "unscale_" in str(result.error_in_exec)
    capsys.readouterr()
    shell.run_cell("r = %mpdoctor --text", store_history=True)
    report = shell.user_ns["r"]
    # this shell ran earlier lessons too: the cell that raised is reported once
    here = [f for f in report.findings
            if f.check == "amp-unscale-twice" and f"cell [{crash_cell}]" in (f.evidence.get("where") or f.subject)]
    assert len(here) == 1, [(f.check, f.subject) for f in report.findings]
    assert report.cause is not None and report.cause.check == "amp-unscale-twice" and report.findings[0] is report.cause
    assert "no problems found" not in report.to_text()
    # the next report has nothing new from the kernel: the crash was reported once
    shell.run_cell("r2 = %mpdoctor --text", store_history=True)
    assert shell.user_ns["r2"].cause is None
    shell.user_ns.pop("r2", None)


def test_a_raising_cell_shows_its_mistake_once(shell, capsys):
    shell.run_cell(FRESH, store_history=True)
    capsys.readouterr()
    shell.run_cell(UNSCALE_TWICE_RAISES, store_history=True)
    out = capsys.readouterr()
    shown = re.findall(r"^(?:ERROR|WARN|INFO)\s+(\S+)\s", out.out, flags=re.M)
    assert shown.count("amp-unscale-twice") == 1, out.out


def test_the_cell_reader_quotes_the_live_scalers_scale_not_the_default(shell, capsys):
    shell.run_cell(FRESH, store_history=True)
    shell.run_cell("""
fresh(init_scale=4096.0)
optimizer.zero_grad()
with torch.autocast("cpu", dtype=torch.float16):
    loss = model(x).float().pow(2).mean()
amp_scaler.scale(loss).backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
amp_scaler.step(optimizer)
amp_scaler.update()
""", store_history=True)
    capsys.readouterr()
    shell.run_cell("r = %mpdoctor --text", store_history=True)
    clip = [f for f in shell.user_ns["r"].findings if f.check == "amp-clip-before-unscale"]
    assert clip, [f.check for f in shell.user_ns["r"].findings]
    live = shell.user_ns["amp_scaler"].get_scale()
    assert f"({live:g} now)" in clip[0].message and "65536" not in clip[0].message, clip[0].message


def notebook_09_lessons(scaler: str) -> list[str]:
    """Notebook 09's code cells up to its reading of the loop, with its GradScaler named ``scaler``."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "notebooks" / "09_amp_loop.py").read_text()
    cells = re.split(r"^# %%.*$", text, flags=re.M)[1:]
    heads = re.findall(r"^# %%.*$", text, flags=re.M)
    code = []
    for head, body in zip(heads, cells):
        if "[markdown]" in head:
            if "mpdoctor reads the loop" in body:
                break
            continue
        body = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith(("%", "# %")))
        code.append(re.sub(r"\bscaler\b", scaler, body))
    return [c for c in code if c.strip()]


#: A GradScaler call on the bare name ``scaler`` (the name the user did not give it).
BARE = re.compile(r"(?<![\w.])scaler\.(scale|unscale_|step|update|get_scale|load_state_dict)\(|scaler=scaler|"
                  r"\bscaler \(GradScaler\)|: 'scaler'")


def test_notebook_09s_scaler_named_amp_scaler_is_amp_scaler_in_every_string_a_report_shows(shell, capsys):
    from mpdoctor.render.widget import ReportWidget, iter_widgets

    for cell in notebook_09_lessons("amp_scaler"):
        shell.run_cell(cell, store_history=True)  # two lessons raise, as the notebook expects
    shown = capsys.readouterr()
    shell.run_cell("r = %mpdoctor --text", store_history=True)
    report = shell.user_ns["r"]
    loop = [f for f in report.findings if f.check.startswith("amp-")]
    assert {f.check for f in loop} >= {"amp-clip-before-unscale", "amp-step-bypasses-scaler", "amp-unscale-twice",
                                       "amp-update-per-microbatch"}, [f.check for f in loop]
    rw = ReportWidget(report)
    labels = [str(getattr(w, attr, "")) for w in iter_widgets(rw.view) for attr in ("description", "value", "tooltip")]
    strings = {
        "cell output": shown.out + shown.err,
        "text": report.to_text(), "html": report.to_html(), "markdown": report.to_markdown(), "json": report.to_json(),
        "widget": "\n".join(labels),
        "fix code": "\n".join(fx.code for f in loop for fx in f.fixes),
        "evidence": "\n".join(repr(f.evidence) for f in loop),
        "messages": "\n".join(f.message for f in loop),
    }  # fmt: skip
    for where, text in strings.items():
        assert "amp_scaler" in text, where
        bare = BARE.search(text)
        assert bare is None, (where, text[max(0, bare.start() - 200) : bare.end() + 100])
    series = {r.scaler for r in report.scale_history}
    assert series == {"amp_scaler"}, series
