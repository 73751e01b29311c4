"""What is shown is safe: no script from user strings, no secret, no evaluation.

- HTML: script payloads planted in every user-controlled string (module
  class names made with ``type()``, module and parameter names, config
  values and sub-config keys, dict keys of namespace containers, exception
  messages from a user's module) never survive unescaped in
  ``report.to_html()``, the ``text/html`` of the mimebundle, or any HTML
  value of the widget (before and after its buttons are clicked).
- Secrets: with HF_TOKEN, WANDB_API_KEY, OPENAI_API_KEY and
  AWS_SECRET_ACCESS_KEY set and token-like strings in config attributes,
  a dict key and an exception message, no rendering or export (text, HTML,
  widget, JSON, markdown, DataFrame, repr, env_report, ``python -m mpdoctor
  env``) contains any of them.
- The magic evaluates nothing: ``%mpdoctor __import__('os').system(...)``,
  ``{...}`` and ``$(...)`` lines are a "no such variable" line and create no file.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch
from setups import tiny_llama, tiny_trainer

import mpdoctor

SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(1)>"
PAYLOADS = (SCRIPT, IMG)

SECRETS = {
    "HF_TOKEN": "hf_" + "Zq8rT2vLm4Xw9Yp3Kd7Nc1Bf",
    "WANDB_API_KEY": "3f9a1c7e5b2d8046af13c9e7b5d20184f6a3c9e1",
    "OPENAI_API_KEY": "sk-proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY",
}
CONFIG_TOKEN = "hf_" + "Cf4kQ9wE2rT7yU1iO8pA3sD6"


class _Tags(HTMLParser):
    """Collects start tags and their attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))


def assert_inert(markup: str, where: str) -> None:
    """No payload survives: no <script> / <img> element, no on* attribute, no raw payload text."""
    for payload in PAYLOADS:
        assert payload not in markup, f"{where}: raw {payload!r}"
    parser = _Tags()
    parser.feed(markup)
    for tag, attrs in parser.tags:
        assert tag not in ("script", "img", "iframe", "object", "embed"), f"{where}: a <{tag}> element"
        for name, value in attrs:
            assert not name.lower().startswith("on"), f"{where}: <{tag} {name}=...>"
            assert "javascript:" not in (value or "").lower(), f"{where}: javascript: URL"


def _hostile_strings_setup() -> tuple[dict, dict[str, object]]:
    """Payloads in class names, module / parameter names, config values and keys, dict keys, exceptions."""
    from transformers import LlamaConfig

    EvilLinear = type(SCRIPT, (torch.nn.Linear,), {})
    EvilSGD = type(IMG, (torch.optim.SGD,), {})
    EvilScaler = type(SCRIPT + "Scaler", (torch.amp.GradScaler,), {})

    model = tiny_llama(torch.bfloat16)
    model.add_module(SCRIPT, EvilLinear(4, 4))  # an fp32 module inside a bf16 model: named in findings
    model.register_parameter(IMG, torch.nn.Parameter(torch.ones(2)))
    model.config.model_type = SCRIPT
    model.config.custom_attribute = IMG
    model.config._attn_implementation_internal = IMG
    model.config.__dict__[IMG] = LlamaConfig(use_cache=True)  # a sub-config under a hostile key
    model.generation_config.use_cache = True

    class Raising(torch.nn.Module):
        def named_modules(self, *a, **k):
            raise RuntimeError(f"{SCRIPT} {IMG}")

    opt = EvilSGD(model.parameters(), lr=0.1)
    scaler = EvilScaler("cpu")
    ns = {
        "model": model,
        "opt": opt,
        "scaler": scaler,
        "box": {SCRIPT: EvilLinear(2, 2), IMG: [Raising()]},
        "mixed": torch.nn.Sequential(EvilLinear(4, 4).to(torch.bfloat16), EvilLinear(4, 4)),
    }
    planted = {"class name": SCRIPT, "dict key": IMG}
    return ns, planted


def _widget_markup(report) -> list[tuple[str, str]]:
    """Every string a widget frontend may interpret as HTML."""
    from mpdoctor.render.widget import ReportWidget, iter_widgets

    rw = ReportWidget(report)
    out = []

    def collect(stage: str) -> None:
        for x in iter_widgets(rw.view):
            for trait, value in x.trait_values().items():
                if isinstance(value, str) and (trait == "value" and type(x).__name__ in ("HTML", "HTMLMath")):
                    out.append((f"widget {stage} {type(x).__name__}.{trait}", value))
                elif isinstance(value, str) and trait in ("description", "tooltip", "placeholder"):
                    if getattr(x, "description_allow_html", False):
                        out.append((f"widget {stage} {type(x).__name__}.{trait} (allow_html)", value))
            titles = getattr(x, "titles", None)
            if titles:
                out.extend((f"widget {stage} tab title", t) for t in titles if isinstance(t, str))

    collect("initial")
    for button in rw.buttons("Apply all"):
        button.click()
    collect("after apply-all")
    rw.close()
    return out


def test_script_payloads_in_user_strings_never_survive_unescaped_in_html():
    ns, planted = _hostile_strings_setup()
    report = mpdoctor.diagnose(namespace=ns, scan=True)
    page = report.to_html()
    assert_inert(page, "report.to_html()")
    assert_inert(report._repr_mimebundle_()["text/html"], "mimebundle text/html")
    # The payloads did reach the report (escaped): the test planted them where they are shown.
    for where, payload in planted.items():
        assert html.escape(payload, quote=True) in page or html.escape(payload, quote=False) in page, where
    for where, markup in _widget_markup(report):
        assert_inert(markup, where)


def test_the_widget_escapes_payloads_in_its_own_mimebundle():
    from mpdoctor.render.widget import ReportWidget

    ns, _ = _hostile_strings_setup()
    rw = ReportWidget(mpdoctor.diagnose(namespace=ns))
    try:
        assert_inert(rw.mimebundle()["text/html"], "widget mimebundle text/html")
    finally:
        rw.close()


# -- secrets ------------------------------------------------------------------------------------


@pytest.fixture()
def secrets(monkeypatch):
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # allowlisted: shown
    return [*SECRETS.values(), CONFIG_TOKEN]


def _secret_setup() -> dict:
    model = tiny_llama(torch.bfloat16)
    model.config.model_type = CONFIG_TOKEN
    model.config.hub_token = CONFIG_TOKEN
    model.config._name_or_path = f"org/model?token={CONFIG_TOKEN}"
    model.config.__dict__["use_cache"] = CONFIG_TOKEN  # a config value shown as it is (bypassing validation)
    model.config.__dict__[CONFIG_TOKEN] = type(model.config)(use_cache=True)  # a sub-config key

    class Leaky(torch.nn.Module):
        def named_modules(self, *a, **k):
            raise RuntimeError(f"cannot reach the hub with {CONFIG_TOKEN} / {SECRETS['HF_TOKEN']}")

    trainer = tiny_trainer(tiny_llama(seed=1), hub_token=CONFIG_TOKEN)
    return {
        "model": model,
        "opt": torch.optim.AdamW(model.parameters()),
        "scaler": torch.amp.GradScaler("cpu"),
        "trainer": trainer,
        "leaky": Leaky(),
        "box": {CONFIG_TOKEN: torch.nn.Linear(2, 2)},
    }


def _assert_no_secret(text: str, secrets: list[str], where: str) -> None:
    for secret in secrets:
        assert secret not in text, f"{where} shows a secret ({secret[:6]}...)"
        assert secret[3:] not in text, f"{where} shows most of a secret ({secret[:6]}...)"


def test_no_rendering_or_export_shows_a_secret(secrets):
    ns = _secret_setup()
    report = mpdoctor.diagnose(namespace=ns, scan=True)
    assert report.findings_for("internal-error")  # the leaky exception message is in the report
    outputs = {
        "text": report.to_text(),
        "str": str(report),
        "repr": repr(report),
        "html": report.to_html(),
        "json": report.to_json(),
        "dict": json.dumps(report.to_dict()),
        "markdown": report.to_markdown(),
        "frame": report.to_frame().to_string(),
        "histogram": report.histogram.to_string(),
        "mimebundle": json.dumps(report._repr_mimebundle_()),
        "env_report": str(mpdoctor.env_report()) + json.dumps(mpdoctor.env_report(), default=str),
        "refresh": report.refresh().to_json(),
        "findings": repr([(f.subject, f.message, f.evidence, [(x.title, x.code, x.error) for x in f.fixes]) for f in report.findings]),
    }
    from mpdoctor.render.widget import ReportWidget, iter_widgets

    rw = ReportWidget(report)
    try:
        strings = [
            str(v) for x in iter_widgets(rw.view) for v in x.trait_values().values() if isinstance(v, (str, tuple, list))
        ]
        outputs["widget"] = "\n".join(strings) + json.dumps(rw.mimebundle(), default=str)
    finally:
        rw.close()
    for where, text in outputs.items():
        _assert_no_secret(text, secrets, where)
    assert "ACCELERATE_MIXED_PRECISION" in outputs["markdown"]  # the allowlist still works


def test_python_m_mpdoctor_env_shows_no_secret(secrets):
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-m", "mpdoctor", "env"], capture_output=True, text=True, check=True, env=env
    )
    _assert_no_secret(out.stdout + out.stderr, secrets, "python -m mpdoctor env")
    assert "bf16 native" in out.stdout


# -- the magic evaluates nothing ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        "__import__('os').system('touch {path}')",
        "{{__import__('os').system('touch {path}')}}",  # IPython would expand {expr} in a line magic
        "$(touch {path})",
        "model; __import__('os').system('touch {path}')",
        "model.__class__.__init__.__globals__['os'].system('touch {path}')",
    ],
)
def test_the_magic_evaluates_nothing(shell, capsys, tmp_path, template):
    path = tmp_path / "pwned"
    shell.user_ns["model"] = torch.nn.Linear(2, 2)
    try:
        result = shell.run_cell(f"%mpdoctor {template.format(path=path)}", store_history=False)
    finally:
        shell.user_ns.pop("model", None)
    out = capsys.readouterr().out
    assert not path.exists(), "the magic line ran code"
    assert result.error_in_exec is None and result.result is None
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpdoctor: no such variable"), out


def test_probe_reports_show_no_secret(secrets):
    class Leaky(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            raise RuntimeError(f"the hub refused {CONFIG_TOKEN}")

    report = mpdoctor.probe(Leaky(), torch.ones(1, 2))
    for where, text in {
        "text": report.to_text(),
        "html": report.to_html(),
        "json": report.to_json(),
        "markdown": report.to_markdown(),
        "frame": report.to_frame().to_string(),
        "probe_table": str(report.probe_table),
    }.items():
        _assert_no_secret(text, secrets, f"probe {where}")
