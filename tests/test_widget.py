"""The ipywidgets report, clicked headlessly on real broken setups.

Marked ``colab``: the same tests run with ipywidgets 7.7.1 + IPython 7.34
(``make test-colab``) and with ipywidgets 8 + IPython 9.
"""

from __future__ import annotations

import json
import re
import sys
import time

import pytest
import torch
from setups import PAYLOAD, SCRIPT, bf16_model, tiny_gemma3

import mpdoctor
from mpdoctor.render.html import COLORS, e
from mpdoctor.render.widget import WIDGET_VIEW_MIME, ReportWidget, iter_widgets
from mpdoctor.rules.engine.changes import SetAttrTo
from mpdoctor.rules.engine.findings import Finding
from mpdoctor.rules.engine.fixes import UNDO_BUDGET_BYTES, Applicability, Fix

pytestmark = pytest.mark.colab



def stepped(model: torch.nn.Module) -> tuple[torch.amp.GradScaler, torch.optim.Optimizer]:
    """An enabled CPU GradScaler and an AdamW after one real step (scale tensor, growth tracker, grads, state)."""
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    loss = model(torch.ones(2, 8, dtype=model[0].weight.dtype)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return scaler, opt


def snapshot(obj: object) -> dict:
    """Every instance attribute; tensors as (identity, dtype, values) so an exact undo can be checked."""
    out = {}
    for key, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            out[key] = ("tensor", id(value), value.dtype, value.detach().clone())
        else:
            out[key] = ("value", value)
    return out


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        if a[key][0] == "tensor":
            if a[key][1:3] != b[key][1:3] or not torch.equal(a[key][3], b[key][3]):
                return False
        elif a[key] != b[key]:
            return False
    return True


def widget_for(**namespace) -> ReportWidget:
    rw = mpdoctor.diagnose(namespace=namespace).widget()
    rw.confirm_delay = 0.0
    return rw


def checks(rw: ReportWidget) -> set[str]:
    return {f.check for f in rw.report.findings}


def cache_flags(rw: ReportWidget) -> dict[str, str]:
    """``path -> use_cache`` as the caches panel shows them."""
    rows = re.findall(r"<tr>(.*?)</tr>", rw.caches_panel.value.split("<tbody>")[1])
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in rows]
    return {c[0]: c[1] for c in cells}


def only(buttons: list):
    assert len(buttons) == 1, [b.description for b in buttons]
    return buttons[0]


# -- safe fixes ----------------------------------------------------------------------


def test_clicking_disable_scaler_turns_off_the_live_scaler_and_the_refreshed_report_drops_the_finding():
    model = bf16_model()
    scaler, _opt = stepped(model)
    before = snapshot(scaler)
    rw = widget_for(model=model, scaler=scaler)
    first_report = rw.report
    assert "scaler-with-bf16" in checks(rw)

    only(rw.buttons("Disable scaler (GradScaler)")).click()

    assert scaler.is_enabled() is False
    assert rw.report is not first_report, "the report must be re-diagnosed, not patched"
    assert "scaler-with-bf16" not in checks(rw)
    assert not rw.buttons("Disable scaler (GradScaler)")
    html = "".join(rw.html_values())
    assert "applied" in html and "gone after re-diagnosis" in html
    assert "scaler = torch.amp.GradScaler(&#x27;cpu&#x27;, enabled=False)" in html  # the code to paste
    # The card says plainly what running the old cell again does: it builds the object as it was.
    assert "running the cell that builds the object again builds it as it was, undoing this fix" in html
    assert "disabled" not in first_report.to_text().split("scalers")[-1]  # the old report is untouched

    only(rw.buttons("Undo")).click()

    assert scaler.is_enabled() is True
    assert same(before, snapshot(scaler)), "undo must restore the scaler exactly"
    assert "scaler-with-bf16" in checks(rw)
    assert not rw.buttons("Undo") and rw.applied == []


def test_the_gemma3_nested_cache_fix_switches_off_text_config_use_cache_and_undo_restores_it():
    gemma = tiny_gemma3(text_use_cache=True)
    text_before = snapshot(gemma.config.text_config)
    gen_before = snapshot(gemma.generation_config)
    rw = widget_for(gemma=gemma)
    assert "cache-in-training" in checks(rw)

    only(rw.buttons("Set use_cache=False")).click()

    assert gemma.config.text_config.use_cache is False
    assert gemma.generation_config.use_cache is False
    assert "cache-in-training" not in checks(rw)
    assert "gemma.config.text_config.use_cache = False" in "".join(rw.html_values())
    assert cache_flags(rw)["gemma.config.text_config.use_cache"] == "False"

    only(rw.buttons("Undo")).click()

    assert gemma.config.text_config.use_cache is True and gemma.generation_config.use_cache is True
    assert same(text_before, snapshot(gemma.config.text_config))
    assert same(gen_before, snapshot(gemma.generation_config))
    assert "cache-in-training" in checks(rw)


def test_undo_still_works_after_several_refreshes_and_other_fixes():
    model = bf16_model()
    scaler, _opt = stepped(model)
    gemma = tiny_gemma3(text_use_cache=True)
    rw = widget_for(model=model, scaler=scaler, gemma=gemma)

    only(rw.buttons("(GradScaler)")).click()
    only(rw.buttons("Re-diagnose")).click()
    only(rw.buttons("Set use_cache=False")).click()
    only(rw.buttons("Re-diagnose")).click()
    assert checks(rw) == set() and len(rw.applied) == 2

    rw.buttons("Undo")[0].click()  # the oldest: the scaler fix, from the very first report

    assert scaler.is_enabled() is True and gemma.config.text_config.use_cache is False
    assert checks(rw) == {"scaler-with-bf16"}
    assert [a.fix_view["title"] for a in rw.applied] == [
        "Set use_cache=False on text_config, generation_config"
    ]


# -- unsafe fixes --------------------------------------------------------------------


def fp16_setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 8, dtype=torch.float16)).float().sum().backward()
    opt.step()  # momentum buffers: optimizer state to cast along
    return model, opt, torch.amp.GradScaler("cpu")


def test_the_unsafe_cast_needs_a_confirming_second_click_and_undo_restores_fp16_exactly():
    model, opt, scaler = fp16_setup()
    params = list(model.parameters())
    saved = [
        (p.data_ptr(), p.detach().clone(), p.grad.detach().clone(), opt.state[p]["momentum_buffer"].clone())
        for p in params
    ]
    rw = widget_for(m16=model, opt=opt, scaler=scaler)
    (finding,) = rw.report.findings_for("fp16-trainable-params-with-scaler")
    assert not finding.fixes[0].safe

    button = only(rw.buttons("(unsafe;"))
    assert "mpd-unsafe" in button._dom_classes and button.description.startswith("\u26a0 Cast 2 trainable fp16")
    button.click()

    assert model.weight.dtype == torch.float16, "one click must not apply an unsafe fix"
    armed = only(rw.buttons("Click again to confirm"))
    assert "mpd-armed" in armed._dom_classes
    assert "cast 2 trainable fp16 parameters to float32" in armed.description
    armed.click()

    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params)
    assert list(model.parameters()) == params, "the Parameter objects are kept (optimizers hold them)"
    assert all(opt.state[p]["momentum_buffer"].dtype == torch.float32 for p in params)
    assert "fp16-trainable-params-with-scaler" not in checks(rw)

    only(rw.buttons("Undo")).click()

    for p, (ptr, data, grad, momentum) in zip(params, saved):
        assert p.dtype == torch.float16 and p.data_ptr() == ptr and torch.equal(p.detach(), data)
        assert torch.equal(p.grad, grad) and torch.equal(opt.state[p]["momentum_buffer"], momentum)
    assert "fp16-trainable-params-with-scaler" in checks(rw)


def test_a_double_click_is_not_a_confirmation():
    model, opt, scaler = fp16_setup()
    rw = widget_for(m16=model, opt=opt, scaler=scaler)
    rw.confirm_delay = 0.05
    only(rw.buttons("(unsafe;")).click()
    only(rw.buttons("Click again to confirm")).click()  # at once: the second half of a double-click
    assert model.weight.dtype == torch.float16
    time.sleep(0.06)
    only(rw.buttons("Click again to confirm")).click()
    assert model.weight.dtype == torch.float32


def test_apply_all_safe_fixes_applies_only_the_safe_ones():
    model = bf16_model()
    m16, opt, scaler = fp16_setup()
    gemma = tiny_gemma3(text_use_cache=True)
    rw = widget_for(model=model, m16=m16, opt=opt, scaler=scaler, gemma=gemma)
    assert {"scaler-with-bf16", "cache-in-training", "fp16-trainable-params-with-scaler"} <= checks(rw)
    safe = [fx for fx in rw.report.fixes if fx.safe]
    button = only(rw.buttons("Apply all safe fixes"))
    assert button.description == f"Apply all safe fixes ({len(safe)})"

    button.click()

    # The scaler serves the fp16 model's steps: disabling it is unsafe, so the bulk action leaves it on.
    assert scaler.is_enabled() is True and gemma.config.text_config.use_cache is False
    assert m16.weight.dtype == torch.float16, "the unsafe cast is never applied in bulk"
    assert [a.fix for a in rw.applied] == safe
    assert "cache-in-training" not in checks(rw) and "scaler-with-bf16" in checks(rw)
    assert rw.apply_all_button.disabled and rw.apply_all_button.layout.display == "none", "no disabled '(0)' button"


# -- failures ------------------------------------------------------------------------


class StubbornScaler(torch.amp.GradScaler):
    """A real GradScaler whose ``_enabled`` silently ignores assignments after construction."""

    def __setattr__(self, name, value):
        if name == "_enabled" and "_enabled" in self.__dict__:
            return
        super().__setattr__(name, value)


def test_a_fix_that_does_not_take_shows_why_in_the_widget_and_the_finding_stays():
    model = bf16_model()
    scaler = StubbornScaler("cpu")
    rw = widget_for(model=model, scaler=scaler)

    only(rw.buttons("(GradScaler)")).click()  # must not raise

    assert scaler.is_enabled() is True
    assert "scaler-with-bf16" in checks(rw) and rw.applied == []
    html = "".join(rw.html_values())
    assert "Not applied, nothing was changed" in html and "did not take" in html
    assert "Traceback" not in html
    assert "failed and was rolled back" in rw.status


def _report_with_a_big_backup_fix(scaler: torch.amp.GradScaler):
    """A report whose only finding offers a safe fix with an undo backup over the budget."""

    def build():
        base = mpdoctor.diagnose(scaler, names={id(scaler): "scaler"})
        findings = []
        if scaler.is_enabled():
            fix = Fix(
                "Disable the scaler",
                "scaler._enabled = False", applicability=Applicability.SAFE,
                changes=(SetAttrTo(base.live.add(scaler), "_enabled", False, "scaler._enabled"),),
                backup_bytes=UNDO_BUDGET_BYTES + 2**30,
            ).bind(base.live)
            findings.append(
                Finding("big-undo", "warning", "scaler", "A fix with a large undo backup.", {}, [fix])
            )
        return mpdoctor.Report(findings, base.facts, rediagnose=build)

    return build()


def test_a_fix_needing_confirmation_shows_the_message_then_applies_on_a_second_click():
    scaler = torch.amp.GradScaler("cpu")
    rw = ReportWidget(_report_with_a_big_backup_fix(scaler))
    rw.confirm_delay = 0.0

    only(rw.buttons("Disable the scaler")).click()

    assert scaler.is_enabled() is True
    assert "undo backup" in "".join(rw.html_values())
    armed = only(rw.buttons("Click again to confirm"))
    assert "GiB undo backup" in armed.description
    armed.click()
    assert scaler.is_enabled() is False and not rw.report.findings


def test_apply_all_skips_a_fix_needing_confirmation_and_says_so():
    scaler = torch.amp.GradScaler("cpu")
    rw = ReportWidget(_report_with_a_big_backup_fix(scaler))
    only(rw.buttons("Apply all safe fixes")).click()
    assert scaler.is_enabled() is True
    assert "Click its button to confirm" in "".join(rw.html_values())
    assert "could not be applied" in rw.status


# -- what it shows -------------------------------------------------------------------


def test_the_header_panels_and_issue_text_show_the_live_state():
    model = bf16_model()
    scaler, opt = stepped(model)
    gemma = tiny_gemma3(text_use_cache=True)
    rw = widget_for(model=model, scaler=scaler, opt=opt, gemma=gemma)
    rw.controller.adopt(rw.report.evolve(elapsed=0.0123))
    rw._render()

    header = rw.header.value
    c = rw.report.counts()
    assert c["warning"] >= 2  # scaler-with-bf16 and cache-in-training at least
    words = re.sub("<[^>]+>", "", header)
    assert f"{c['error']} errors" in words and f"{c['warning']} warnings" in words and f"{c['info']} info" in words
    for name, cls in (
        ("model", "Sequential"),
        ("scaler", "GradScaler"),
        ("opt", "AdamW"),
        ("gemma", "Gemma3ForConditionalGeneration"),
    ):
        assert re.search(f">{name}</code> <span style='[^']*'>{cls}</span>", header), name
    assert "cpu (live)" in header and "diagnosed in 12 ms" in header

    dtypes = rw.dtypes_panel.value
    for text in (
        "params",
        "grads",
        "buffers",
        "optimizer state",
        "bf16",
        "fp32",  # the same word as the layer strip's legend
        "i64",
        "trainable",
        "frozen",
        "KiB",
    ):
        assert text in dtypes, text
    for path in (
        "gemma.config.use_cache",
        "gemma.config.text_config.use_cache",
        "gemma.generation_config.use_cache",
    ):
        assert path in rw.caches_panel.value
    cells = re.findall(r"<td[^>]*>(.*?)</td>", rw.scaler_panel.value)
    assert cells == [
        "scaler",
        "True",
        "cpu",
        "65536",
        "1",
        "2000",
    ]  # name, enabled, device, scale, growth tracker, interval
    assert "autocast now" in rw.precision_panel.value and "bf16 native" in rw.precision_panel.value
    assert rw.issue_text.value == rw.report.to_markdown()
    # No model with 4 numbered layers, no scan, no probe: those tabs are hidden.
    assert rw.panel_titles() == ["dtypes", "caches", "scaler", "precision", "issue report"]

    from mpdoctor.rules.checks import REGISTRY

    why = REGISTRY["scaler-with-bf16"].why
    assert why and "``" in why, "the docstring is reStructuredText"
    shown = "".join(rw.html_values())
    assert e(why.replace("``", "")) in shown and "``" not in shown


def test_the_precision_panel_puts_requested_and_effective_side_by_side():
    from setups import tiny_trainer

    trainer = tiny_trainer(fp16=True)  # fp16 on a CPU: accelerate's native amp is off, the run is fp32
    rw = widget_for(trainer=trainer)
    html = rw.precision_panel.value
    assert "requested (args)" in html and "effective" in html and "ACCELERATE_MIXED_PRECISION" in html
    row = html.split("<tbody>")[1].split("</tr>")[0]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert cells[0] == "trainer" and cells[1] == "fp16" and "fp32" in cells[-1], "accelerate's 'no' is said as fp32"
    assert "font-weight:bold" in row.split("<td")[-1] and f"border:1px solid {COLORS['error']}" in row.split("<td")[-1], (
        "an effective precision differing from the request stands out"
    )


def test_every_user_string_is_escaped_in_every_html_widget_and_in_to_html():
    evil_cls = type(PAYLOAD, (torch.nn.Linear,), {})
    model = evil_cls(4, 4).to(torch.bfloat16)
    gemma = tiny_gemma3(text_use_cache=True)
    gemma.config.vision_config.use_cache = SCRIPT
    gemma.config.text_config.model_type = SCRIPT
    rw = widget_for(**{PAYLOAD: torch.amp.GradScaler("cpu"), "model": model, "gemma": gemma})
    assert f"Disable {PAYLOAD} (GradScaler) (safe; not tried on your step)" in [
        b.description for b in rw.buttons()
    ]  # button labels are text

    def assert_escaped() -> None:
        from ipywidgets import Button, Widget

        html = rw.html_values() + [rw.report.to_html()]
        for value in html:
            assert "<img" not in value.lower() and "<script" not in value.lower(), value[:300]
        joined = "".join(html)
        assert (
            "&lt;img src=x onerror=alert(1)&gt;" in joined
            and "&lt;script&gt;alert(1)&lt;/script&gt;" in joined
        )
        for w in iter_widgets(rw.view):
            assert isinstance(w, Widget)
            if not isinstance(w, Button):
                assert not getattr(w, "description", ""), "ipywidgets 7 renders descriptions as HTML"

    assert_escaped()
    only(rw.buttons(f"Disable {PAYLOAD} (GradScaler)")).click()
    assert "scaler-with-bf16" not in checks(rw)
    assert_escaped()  # the applied card shows the code with the name in it


def test_the_mimebundle_carries_the_widget_view_with_text_and_html_for_static_exports():
    model = bf16_model()
    report = mpdoctor.diagnose(namespace={"model": model, "scaler": torch.amp.GradScaler("cpu")})
    rw = report.widget()
    assert isinstance(rw, ReportWidget)
    bundle = rw.mimebundle()
    assert bundle[WIDGET_VIEW_MIME] == {"version_major": 2, "version_minor": 0, "model_id": rw.view.model_id}
    assert bundle["text/plain"] == report.to_text() and bundle["text/html"] == report.to_html()
    assert "mpdoctor-widget" in rw.view._dom_classes
    assert set(rw._repr_mimebundle_(include=["text/plain"])) == {"text/plain"}
    assert WIDGET_VIEW_MIME not in rw._repr_mimebundle_(exclude=[WIDGET_VIEW_MIME])
    json.dumps(bundle)


# -- in a real kernel ----------------------------------------------------------------


def _kernel_for_this_python(tmp_path, monkeypatch) -> str:
    kernel_dir = tmp_path / "kernels" / "mpdoctor-this-python"
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "this",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    return "mpdoctor-this-python"


SETUP_SOURCE = (
    "import torch\n"
    "model = torch.nn.Linear(4, 4).to(torch.bfloat16)\n"
    "scaler = torch.amp.GradScaler('cpu')\n"
    "%load_ext mpdoctor"
)


def test_in_a_real_kernel_the_magic_shows_the_widget_once_then_its_static_stand_in(tmp_path, monkeypatch):
    import nbclient
    import nbformat

    kernel = _kernel_for_this_python(tmp_path, monkeypatch)
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(SETUP_SOURCE),
        nbformat.v4.new_code_cell("%mpdoctor"),
        nbformat.v4.new_code_cell("r = %mpdoctor"),
        nbformat.v4.new_code_cell("r"),
        nbformat.v4.new_code_cell("r.widget()"),
        nbformat.v4.new_code_cell("%mpdoctor --text"),
    ]
    nbclient.NotebookClient(nb, kernel_name=kernel, timeout=120, shutdown_kernel="immediate").execute()

    def widget_outputs(cell) -> list:
        return [o for o in cell.outputs if WIDGET_VIEW_MIME in o.get("data", {})]

    for index in (1, 2, 3, 4):
        cell = nb.cells[index]
        assert len(cell.outputs) == 2, (cell.source, cell.outputs)
        view, static = cell.outputs
        assert set(view["data"]) == {WIDGET_VIEW_MIME, "text/plain"}, "the widget output carries no second report"
        assert view["data"]["text/plain"].startswith("mpdoctor | 0 errors | 1 warning")
        assert set(static["data"]) == {"text/plain", "text/html"}
        assert "scaler-with-bf16" in static["data"]["text/plain"]
        html = static["data"]["text/html"]
        assert "class='mpdoctor-fallback'" in html and "scaler-with-bf16" in html
        assert ":root:has(.mpdoctor-widget) .mpdoctor-fallback" in html, "hidden wherever the widget renders"
    text_cell = nb.cells[5]
    assert not widget_outputs(text_cell) and "scaler-with-bf16" in "".join(
        o.get("text", "") for o in text_cell.outputs
    )


def test_a_notebook_executed_by_nbconvert_exports_html_that_shows_the_report_without_the_widget_manager(
    tmp_path, monkeypatch
):
    import subprocess

    import nbformat

    kernel = _kernel_for_this_python(tmp_path, monkeypatch)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": "this", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(SETUP_SOURCE), nbformat.v4.new_code_cell("%mpdoctor")]
    path = tmp_path / "report.ipynb"
    nbformat.write(nb, str(path))
    done = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--execute", "--to", "html", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "report.html").read_text()
    # nbconvert saved the widget state, so the widget output becomes a widget-manager placeholder...
    assert "application/vnd.jupyter.widget-state+json" in page
    assert '<script type="application/vnd.jupyter.widget-view+json">' in page
    # ...and the static report is plain HTML beside it, outside any script: it shows with no network.
    outside_scripts = re.sub(r"<script.*?</script>", "", page, flags=re.S)
    assert "class='mpdoctor-fallback'" in outside_scripts or 'class="mpdoctor-fallback"' in outside_scripts
    assert "scaler-with-bf16" in outside_scripts and "(GradScaler)" in outside_scripts


# -- small things ------------------------------------------------------------------------------


def test_open_findings_come_before_applied_cards():
    model = bf16_model()
    scaler, _opt = stepped(model)
    gemma = tiny_gemma3(text_use_cache=True)
    rw = widget_for(model=model, scaler=scaler, gemma=gemma)
    only(rw.buttons("(GradScaler)")).click()
    cards = ["".join(x.value for x in iter_widgets(c) if hasattr(x, "value") and isinstance(x.value, str)) for c in rw.findings_box.children]
    assert "cache-in-training" in cards[0], "the open finding first"
    assert "applied" in cards[-1] and "scaler-with-bf16" in cards[-1]


def test_an_armed_unsafe_fix_can_be_cancelled_without_rediagnosing():
    model, opt, scaler = fp16_setup()
    rw = widget_for(m16=model, opt=opt, scaler=scaler)
    report = rw.report
    only(rw.buttons("(unsafe;")).click()
    assert only(rw.buttons("Click again to confirm"))
    only(rw.buttons("Cancel")).click()
    assert not rw.buttons("Click again to confirm") and not rw.buttons("Cancel")
    assert only(rw.buttons("(unsafe;")) and rw.report is report, "no re-diagnosis was needed"
    assert model.weight.dtype == torch.float16


def test_a_clean_report_says_so_once_and_offers_no_disabled_apply_all():
    torch.manual_seed(0)
    rw = widget_for(model=torch.nn.Linear(4, 4))
    assert not rw.report.findings
    shown = "".join(rw.html_values())
    assert shown.count("no mixed-precision problems found") == 1 and "No problems found" not in shown
    assert rw.apply_all_button.layout.display == "none"


def test_the_copy_button_hands_the_issue_markdown_to_the_browser_escaped():
    import ipywidgets

    rw = widget_for(**{PAYLOAD: torch.amp.GradScaler("cpu"), "model": bf16_model()})
    if ipywidgets.__version__.startswith("7."):
        # classic Notebook's ipywidgets 7 frontend cannot create Output models: no button, the select-all hint
        assert not rw.buttons("Copy") and "select all (Ctrl/Cmd+A)" in "".join(rw.html_values())
        return
    only(rw.buttons("Copy to clipboard")).click()
    (out,) = rw._clipboard.outputs
    script = out["data"]["application/javascript"]
    assert script.startswith("navigator.clipboard && navigator.clipboard.writeText(")
    assert "<" not in script and ">" not in script.replace("&&", ""), "no markup can close the script"
    assert json.loads(script[script.index("(") + 1 : script.rindex(")")].replace("\\u003c", "<").replace("\\u003e", ">")) == rw.issue_text.value
    rw._render()
    assert rw._clipboard.outputs == (), "a redraw never copies again"


def test_buttons_say_one_parameter_not_one_parameters_and_keep_the_full_title_on_hover():
    from mpdoctor.render.formatting import fix_label

    short, full = fix_label("Cast 1 parameters of 1 modules of m to bf16 (keeps a 3.0 GiB undo backup: apply(confirm=True))")
    assert short == "Cast 1 parameter of 1 module of m to bf16 (keeps a 3.0 GiB undo backup)"
    assert full.endswith("apply(confirm=True))")
    long_short, long_full = fix_label("Set " + "very_long_name." * 20 + "use_cache=False")
    assert long_short.endswith("\u2026") and len(long_short) <= 90 and long_full.startswith("Set very_long_name")


def test_tabs_with_nothing_to_show_are_hidden_and_come_back_when_they_have_something():
    model = torch.nn.Linear(4, 4)
    rw = widget_for(model=model)
    assert rw.panel_titles() == ["dtypes", "precision", "issue report"]
    assert rw.watcher_note.value == ""
    rw.panels.selected_index = 1  # the reader is on "precision"
    rw.controller.adopt(mpdoctor.diagnose(namespace={"model": model, "scaler": torch.amp.GradScaler("cpu")}))
    rw._render()
    assert rw.panel_titles() == ["dtypes", "scaler", "precision", "issue report"]
    assert rw.panels.get_title(rw.panels.selected_index) == "precision"
    assert rw.panels.children[1] is rw.scaler_panel and "65536" in rw.scaler_panel.value
    rw.close()


def _fp16_adamw_under_a_scaler():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).half()
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(8, 4)

    def train_step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)  # ValueError: Attempting to unscale FP16 gradients.
        scaler.update()
        return loss

    return model, opt, scaler, train_step


def test_a_button_says_what_it_changes_whether_it_is_safe_verified_and_what_an_alternative_replaces():
    model, opt, scaler, train_step = _fp16_adamw_under_a_scaler()
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt, "scaler": scaler}, target="T4", step=train_step)
    rw = ReportWidget(report)
    labels = [b.description for b, _ in rw.fix_buttons]
    planned, eps = labels
    assert planned.startswith("\u26a0 Keep fp32 master weights: cast 4 trainable fp16 parameters of opt to fp32")
    assert planned.endswith("(unsafe; verified on your step)")
    assert "(unsafe; " in eps and "alternative to \u201cKeep fp32 master weights" in eps
    assert "(alternative)" not in " ".join(labels)
    assert "verified on your step: applied alone" in rw.fix_buttons[0][0].tooltip  # the proof record, in full
    rw.close()
    unproven = ReportWidget(mpdoctor.diagnose(namespace={"model": model, "opt": opt, "scaler": scaler}, target="T4"))
    assert unproven.fix_buttons[0][0].description.endswith("(unsafe; not tried on your step)")
    unproven.close()


def test_two_fixes_making_the_same_change_are_one_button_and_one_click_resolves_both_findings():
    model, opt, scaler, _ = _fp16_adamw_under_a_scaler()
    rw = widget_for(model=model, opt=opt, scaler=scaler)
    assert checks(rw) >= {"adam-eps-underflow", "fp16-trainable-params-with-scaler"}
    casts = [(b, group) for b, group in rw.fix_buttons if "to fp32" in b.description]
    (button, group), = casts  # the cast "of opt" and the cast "of model": one button
    assert len(group) == 2 and "of opt" in button.description  # the planned one of the two
    assert any("the same change as \u201cKeep fp32 master weights" in v for v in rw.html_values())
    first_card_buttons = [x for x in iter_widgets(rw.findings_box.children[0]) if x in [b for b, _ in rw.fix_buttons]]
    assert first_card_buttons[0] is button  # the planned fix comes first
    button.click()
    only(rw.buttons("Click again to confirm")).click()  # unsafe: the second click confirms
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not checks(rw) & {"adam-eps-underflow", "fp16-trainable-params-with-scaler"}
    rw.close()


def test_in_a_real_kernel_a_watched_cells_finding_is_said_once_its_banner_replaced_by_the_report(tmp_path, monkeypatch):
    import nbclient
    import nbformat

    kernel = _kernel_for_this_python(tmp_path, monkeypatch)
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "%load_ext mpdoctor\nimport torch\nmodel = torch.nn.Linear(8, 1)\n"
            "optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)\nscaler = torch.amp.GradScaler('cpu')\n"
            "x = torch.randn(16, 8)"
        ),
        # optimizer.step() straight after the scaled backward: the watcher announces it at once
        nbformat.v4.new_code_cell(
            "optimizer.zero_grad()\nscaler.scale(model(x).pow(2).mean()).backward()\noptimizer.step()\nprint('ran')"
        ),
    ]
    nbclient.NotebookClient(nb, kernel_name=kernel, timeout=120, shutdown_kernel="immediate").execute()
    outputs = nb.cells[1].outputs

    def says(o: dict) -> str:
        return o.get("text", "") + "".join(v for v in o.get("data", {}).values() if isinstance(v, str))

    assert any("ran" in o.get("text", "") for o in outputs)
    assert not any(o.get("name") == "stderr" for o in outputs), outputs
    shown = [o for o in outputs if "amp-step-bypasses-scaler" in says(o)]
    assert len(shown) == 1 and "class='mpdoctor-fallback'" in shown[0]["data"]["text/html"], outputs
    assert any(WIDGET_VIEW_MIME in o.get("data", {}) for o in outputs)  # the report, as the widget


def test_the_scaler_and_precision_tables_say_what_each_column_means():
    from setups import tiny_trainer

    rw = widget_for(trainer=tiny_trainer(fp16=True), scaler=torch.amp.GradScaler("cpu"))
    scaler, precision = rw.scaler_panel.value, rw.precision_panel.value
    assert ">growth tracker</code>: steps in a row without inf/NaN gradients" in scaler
    assert "title='how many clean steps in a row double the scale'" in scaler  # and on hover of the heading
    assert ">effective</code>: what the run computes in" in precision
    assert ">ACCELERATE_MIXED_PRECISION</code>: the environment variable accelerate reads" in precision
    rw.close()
