"""Where the report is shown: all environment sniffing lives here."""

from __future__ import annotations

from typing import Any

from .bundles import static_bundle, widget_bundle, widget_frontend


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

            widget = ReportWidget(report)
            bundle = widget_bundle(widget)
        except Exception:
            pass  # fall back to static HTML: a report must always show
        else:
            display(bundle, raw=True)
            display(static_bundle(report), raw=True)
            return
    display(report._repr_mimebundle_(), raw=True)
