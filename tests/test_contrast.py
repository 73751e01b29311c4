"""Every text colour the report emits reads, WCAG contrast 4.5:1 or more, in JupyterLab's light and dark themes
and where no ``--jp-*`` variable exists (the fallbacks).

The theme values are JupyterLab 4.6.6's, read from ``jupyterlab/themes/@jupyterlab/theme-light-extension/index.css``
and ``theme-dark-extension/index.css`` (the ``--md-*`` palette values they name). The pairs are read from what the
renderers emit: every inline style that sets a text colour, with the background set beside it or the report's panel
under it, every SVG text fill, and every rule of the widget's stylesheet.
"""

from __future__ import annotations

import re

import pytest
import torch
from setups import bf16_model, tiny_gemma3

import mpdoctor
from mpdoctor.render import html as h
from mpdoctor.render.comparison import curves_svg
from mpdoctor.render.svg import scale_history_svg
from mpdoctor.render.widget import STYLE, ReportWidget

pytestmark = pytest.mark.colab

LIGHT = {
    "--jp-layout-color0": "white",
    "--jp-layout-color2": "#eeeeee",
    "--jp-content-font-color1": "rgba(0,0,0,.87)",
    "--jp-ui-font-color0": "#000",
    "--jp-ui-font-color1": "rgba(0,0,0,.87)",
    "--jp-content-link-color": "#0d47a1",
    "--jp-border-color1": "#bdbdbd",
    "--jp-error-color1": "#d32f2f",
    "--jp-warn-color1": "#f57c00",
    "--jp-info-color1": "#0097a7",
    "--jp-success-color1": "#388e3c",
}
DARK = {
    "--jp-layout-color0": "#111",
    "--jp-layout-color2": "#424242",
    "--jp-content-font-color1": "#fff",
    "--jp-ui-font-color0": "#fff",
    "--jp-ui-font-color1": "rgba(255,255,255,.87)",
    "--jp-content-link-color": "#64b5f6",
    "--jp-border-color1": "#616161",
    "--jp-error-color1": "#f44336",
    "--jp-warn-color1": "#ff9800",
    "--jp-info-color1": "#00bcd4",
    "--jp-success-color1": "#4caf50",
}
#: None: a frontend without JupyterLab's variables (classic Notebook, Colab): every var() takes its fallback.
THEMES = {"light": LIGHT, "dark": DARK, "fallbacks": None}

RGBA = tuple[float, float, float, float]


# -- CSS colours, resolved as a browser does ---------------------------------------------------------------------


def _split_args(inner: str) -> list[str]:
    """Top-level comma-separated arguments (commas inside nested parentheses stay)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    return [*parts, inner[start:].strip()]


def _hsl(hue: float, sat: float, light: float) -> tuple[float, float, float]:
    import colorsys

    return colorsys.hls_to_rgb(hue / 360, light, sat)


def color(expr: str, theme: dict | None) -> RGBA:
    """The RGBA (0..1) a CSS colour expression of the report computes to under ``theme``."""
    expr = expr.strip().removesuffix("!important").strip()
    if expr.startswith("var("):
        name, fallback = _split_args(expr[4:-1])
        return color(theme[name] if theme is not None else fallback, theme)
    if expr.startswith("color-mix("):
        _space, a, b = _split_args(expr[len("color-mix(") : -1])
        first, pct = a.rsplit(" ", 1)
        return _mix(color(first, theme), color(b, theme), float(pct.rstrip("%")) / 100)
    if expr in ("white", "transparent"):
        return (1.0, 1.0, 1.0, 1.0) if expr == "white" else (0.0, 0.0, 0.0, 0.0)
    if expr.startswith("#"):
        digits = expr[1:] if len(expr) == 7 else "".join(c * 2 for c in expr[1:])
        return (*(int(digits[i : i + 2], 16) / 255 for i in (0, 2, 4)), 1.0)
    if expr.startswith("rgba("):
        r, g, b, a = (float(x) for x in _split_args(expr[5:-1]))
        return (r / 255, g / 255, b / 255, a)
    if expr.startswith("hsl("):
        hue, sat, light = (float(x.rstrip("%")) for x in _split_args(expr[4:-1]))
        return (*_hsl(hue, sat / 100, light / 100), 1.0)
    raise ValueError(f"a colour this test cannot read: {expr!r}")


def _mix(a: RGBA, b: RGBA, p: float) -> RGBA:
    """color-mix(in srgb, a p, b): premultiplied interpolation, as CSS Color 5 specifies."""
    alpha = a[3] * p + b[3] * (1 - p)
    if alpha == 0:
        return (0.0, 0.0, 0.0, 0.0)
    return (*((a[i] * a[3] * p + b[i] * b[3] * (1 - p)) / alpha for i in range(3)), alpha)


def _over(top: RGBA, under: RGBA) -> RGBA:
    a = top[3]
    return (*(top[i] * a + under[i] * (1 - a) for i in range(3)), 1.0)


def _luminance(c: RGBA) -> float:
    lin = [x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4 for x in c[:3]]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(text: str, background: str, theme: dict | None) -> float:
    """WCAG 2 contrast of ``text`` on ``background``, both laid over the report's panel (``BG``)."""
    panel = _over(color(h.BG, theme), (1.0, 1.0, 1.0, 1.0))
    bg = _over(color(background, theme), panel)
    fg = _over(color(text, theme), bg)
    hi, lo = sorted((_luminance(fg), _luminance(bg)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_the_contrast_arithmetic_gives_wcag_s_own_figures():
    assert contrast("#000", "white", None) == pytest.approx(21.0)
    assert contrast("#777", "#fff", None) == pytest.approx(4.48, abs=0.01)  # WCAG's well-known near miss
    assert contrast("rgba(0,0,0,.54)", "white", None) == pytest.approx(4.6, abs=0.05)


# -- what the renderers emit ---------------------------------------------------------------------------------------

_STYLE_ATTR = re.compile(r"style='([^']*)'")


def _declarations(style: str) -> dict[str, str]:
    out = {}
    for decl in re.split(r";(?![^(]*\))", style):
        if ":" in decl:
            key, value = decl.split(":", 1)
            out[key.strip()] = value.strip()
    return out


_SVG_TEXT = re.compile(r"<(?:text|tspan)\b([^>]*)>")


def emitted_pairs(markup: str) -> set[tuple[str, str]]:
    """(text colour, background) of every inline style that colours text; SVG text fills sit on the panel the
    picture paints (``BG``)."""
    pairs = set()
    for style in _STYLE_ATTR.findall(markup):
        d = _declarations(style)
        if "color" in d:
            pairs.add((d["color"], d.get("background", h.BG)))
    for attrs in _SVG_TEXT.findall(markup):
        fill = re.search(r"\bfill='([^']*)'", attrs)  # a presentation attribute: var() is not read there
        style = _declarations((_STYLE_ATTR.search(attrs) or re.match("()", "")).group(1))
        if fill or "fill" in style:
            pairs.add((fill.group(1) if fill else style["fill"], h.BG))
    return pairs


def stylesheet_pairs(css: str) -> set[tuple[str, str]]:
    """(colour, background) of every rule of a stylesheet that sets a text colour."""
    pairs = set()
    for body in re.findall(r"\{([^{}]*)\}", css):
        d = _declarations(body)
        if "color" in d:
            pairs.add((d["color"], d.get("background", h.BG)))
    return pairs


def _reports() -> list:
    torch.manual_seed(0)
    model = bf16_model()
    scaler = torch.amp.GradScaler("cpu")
    gemma = tiny_gemma3(text_use_cache=True)
    report = mpdoctor.diagnose(namespace={"model": model, "scaler": scaler, "gemma": gemma}, target="T4")
    clean = mpdoctor.diagnose(torch.nn.Linear(2, 2))
    return [report, clean]


def _comparison_html() -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return mpdoctor.compare(model, torch.randn(4, 16) * 1e-6).to_html()  # tiny inputs: underflow marks


def _everything_rendered() -> str:
    rows = [{"scaler": "scaler", "step": i, "scale": 2.0 ** (16 - i), "skipped": i % 2 == 0, "loss": 1.0 / i} for i in range(1, 6)]
    data = {"scale_history": rows, "proof": {"verified": True, "summary": "Plan verified"}}
    parts = [h.proof_html(data), h.proof_html({"proof": {"verified": False, "summary": "not"}}), h.scale_history_html(data),
             scale_history_svg(rows), curves_svg({"bf16": [1.0, 0.5], "fp16": [1.1, 0.6]}),
             h.departed_html([{"why": w, "check": "c", "subject": "s"} for w in ("fixed", "superseded", "changed outside")]),
             h.cause_html("cause of RuntimeError: x"), _comparison_html()]  # fmt: skip
    for report in _reports():
        parts.append(report.to_html())
        widget = ReportWidget(report)
        parts += widget.html_values()
        widget.close()
    return "".join(parts)


def _all_pairs() -> set[tuple[str, str]]:
    pairs = emitted_pairs(_everything_rendered()) | stylesheet_pairs(STYLE)
    # Badges and buttons are tints of every hue, not only those the sample reports happen to hold.
    pairs |= {(h.FG, h.tint(hue)) for hue in (*h.COLORS.values(), h.OK_COLOR, h.NEUTRAL)}
    pairs |= {(text, bg) for text in (h.FG, h.MUTED, h.LINK) for bg in (h.BG, h.CODE_BG)}
    return pairs


@pytest.mark.parametrize("theme", sorted(THEMES))
def test_every_text_colour_the_report_emits_reads_at_4_5_to_1(theme):
    pairs = _all_pairs()
    assert (h.FG, h.tint(h.COLORS["error"])) in pairs and (h.ERROR_TEXT, h.BG) in pairs
    low = {
        (text, bg): round(contrast(text, bg, THEMES[theme]), 2)
        for text, bg in pairs
        if contrast(text, bg, THEMES[theme]) < 4.5
    }
    assert not low, f"below 4.5:1 in the {theme} theme: {low}"


def test_every_colour_outside_the_heatmap_is_a_theme_variable():
    """A hard-coded colour is the same in both themes: only the heatmap's data colours (light, under dark text)
    and the pictures' strokes and fills may be fixed."""
    themed = ("var(--jp-", "color-mix(in srgb,var(--jp-")
    heat = re.compile(r"hsl\(\d+,\d+%,80%\)")
    hard = {
        (text, bg)
        for text, bg in _all_pairs()
        if not heat.fullmatch(bg)
        and not (text.startswith(themed) and bg.startswith(themed))
    }
    assert not hard, hard


def test_the_heatmap_s_dark_text_reads_on_every_heat_colour():
    html = _comparison_html()
    assert "▼" in html  # the underflow mark is in the cell's own text colour
    cell_text = re.search(r"text-align:right;color:(#[0-9a-f]+)", html).group(1)
    for hue in range(0, 121, 5):
        assert contrast(cell_text, f"hsl({hue},65%,80%)", None) >= 4.5, hue
    assert contrast(cell_text, "hsl(0,0%,80%)", None) >= 4.5


def test_the_plan_line_reads_as_one_sentence_when_the_step_raised_a_message_ending_in_a_full_stop():
    from mpdoctor.diagnosis.proof import Proof, StepOutcome

    raised = StepOutcome(False, False, error="ValueError: Attempting to unscale FP16 gradients.")
    proof = Proof("cell [4]", raised, (("cast", StepOutcome(True, True, loss=0.5)),), (),
                  plan=StepOutcome(True, True, loss=0.5))  # fmt: skip
    summary = proof.summary()
    assert ".;" not in summary and "FP16 gradients; after it, it ran and trained (loss 0.5)." in summary
    line = h.proof_html({"proof": {"verified": True, "summary": summary}})
    assert f"color:{h.FG}" in line and "#1b5e20" not in line  # the theme's text, not a fixed dark green


def _theme_css(theme: str) -> dict[str, str]:
    """``--jp-name -> value`` of an installed JupyterLab theme (``--md-*`` palette names resolved to their hex)."""
    from pathlib import Path

    import jupyterlab

    css = (Path(jupyterlab.__file__).parent / "themes" / "@jupyterlab" / f"theme-{theme}-extension" / "index.css").read_text()
    values = {}
    for name, value in re.findall(r"(--jp-[a-z0-9-]+):([^;}]+)", css):
        values.setdefault(name, re.sub(r"var\(--md-[a-z0-9-]+,(#[0-9a-f]+)\)", r"\1", value.strip()))
    return values


@pytest.mark.parametrize(("theme", "table"), [("light", LIGHT), ("dark", DARK)])
def test_the_theme_values_measured_are_jupyterlab_s_own(theme, table):
    shipped = _theme_css(theme)
    for name, value in table.items():
        assert color(shipped[name], None) == pytest.approx(color(value, None)), (theme, name, shipped[name], value)
