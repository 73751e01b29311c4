"""Where the report is shown: all environment sniffing lives here."""

from __future__ import annotations

import sys
from typing import Any


def in_colab() -> bool:
    """True inside Google Colab."""
    return "google.colab" in sys.modules


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


def show(report: Any) -> None:
    """Display a report: the widget where a widget frontend exists, else text and HTML.

    ``%mpdoctor`` displays the report and also returns it; the display hook
    would show the returned value a second time, so the magic marks the
    report and the next display in the same cell is skipped.
    """
    from IPython import get_ipython
    from IPython.display import display

    shell = get_ipython()
    count = getattr(shell, "execution_count", None)
    if report._skip_display_in is not None and report._skip_display_in == count:
        report._skip_display_in = None
        return
    if widget_frontend():
        try:
            from .widget import ReportWidget

            display(ReportWidget(report).mimebundle(), raw=True)
            return
        except Exception:
            pass  # fall back to static HTML: a report must always show
    display(report._repr_mimebundle_(), raw=True)
