"""Where the report is shown: all environment sniffing lives here."""

from __future__ import annotations

import weakref
from typing import Any

from .bundles import static_bundle, widget_bundle, widget_frontend

#: Reports ``%mpdoctor`` already displayed, with the execution count of that cell (display state, kept out of
#: the report value).
_SHOWN_IN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def skip_next_display(report: Any, execution_count: Any) -> None:
    """The display hook must not show ``report`` again in cell ``execution_count`` (the magic showed it)."""
    _SHOWN_IN[report] = execution_count


def _shown_already(report: Any, execution_count: Any) -> bool:
    if execution_count is not None and _SHOWN_IN.get(report) == execution_count:
        del _SHOWN_IN[report]
        return True
    return False


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
    if _shown_already(report, count):
        return
    if widget_frontend():
        try:
            from .widget import ReportWidget

            widget = ReportWidget(report)
            bundle = widget_bundle(widget)
        except Exception:
            pass  # fall back to static HTML: a report must always show
        else:
            display(bundle, raw=True)
            display(static_bundle(report), raw=True)
            return
    display(report._repr_mimebundle_(), raw=True)
