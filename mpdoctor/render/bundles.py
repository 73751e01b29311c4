"""Display bundles of a report: the widget view with a one-line text, the static text + HTML for exports and
frontends without widgets, and which frontend this kernel serves."""

from __future__ import annotations

import sys
from typing import Any

WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"


def widget_frontend() -> bool:
    """True when the kernel talks to a frontend that can render ipywidgets.

    That is an ipykernel kernel (JupyterLab, Notebook 7, VS Code, Colab) with
    ipywidgets installed; terminal IPython and plain Python get text.
    """
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    try:
        import ipywidgets  # noqa: F401
    except Exception:
        return False
    return True


#: Hides the static copy of a report wherever a report widget rendered: in the live frontend and in an
#: exported page whose widgets load. Offline exports (nbconvert's HTML with saved widget state and no
#: network for the widget manager) render no widget, so the static report stays visible there.
FALLBACK_STYLE = (
    "<style>:root:has(.mpdoctor-widget) .mpdoctor-fallback,"
    ":root:has(.mpdoctor-widget) .jp-OutputArea-child:has(.mpdoctor-fallback),"
    ":root:has(.mpdoctor-widget) .output_area:has(.mpdoctor-fallback){display:none}</style>"
)


def static_bundle(report: Any) -> dict:
    """The report as text and static HTML, marked as the stand-in for a widget shown beside it."""
    return {
        "text/plain": report.to_text(),
        "text/html": f"{FALLBACK_STYLE}<div class='mpdoctor-fallback'>{report.to_html()}</div>",
    }


def widget_bundle(widget: Any) -> dict:
    """The widget view alone, with a one-line text for frontends that cannot draw it.

    The full text and HTML travel in the next output (:func:`static_bundle`): an
    exporter that picks the widget view for this output (nbconvert's HTML
    exporter does whenever widget state was saved) still shows the report.
    """
    from .text import header

    bundle = widget.mimebundle()
    return {
        "text/plain": f"{header(widget.report.view)} (interactive report: it needs a running kernel)",
        WIDGET_VIEW_MIME: bundle[WIDGET_VIEW_MIME],
    }


def display_widget(widget: Any) -> None:
    """Display a report widget, followed by its static rendering for exports (hidden where the widget shows)."""
    from IPython.display import display

    display(widget_bundle(widget), raw=True)
    display(static_bundle(widget.report), raw=True)
