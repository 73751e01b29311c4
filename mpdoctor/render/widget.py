"""The interactive report: core ipywidgets only, so it runs unchanged on ipywidgets 7.7.1 (Colab) and 8.

No custom frontend code: every piece is a ``VBox`` / ``HBox`` / ``HTML`` /
``Button`` / ``Tab`` / ``Textarea``, and the HTML inside comes from
:mod:`mpdoctor.render.html`, which escapes every string taken from a user
object. Button labels are plain text in both ipywidgets versions; no user
string ever goes into a ``description`` of another widget (ipywidgets 7
renders those as HTML).

Before a button acts, the live objects are diagnosed again: when what the
click would do differs from what the widget shows (a later cell cast the model
again, the finding is gone), nothing is applied, the widget shows the fresh
report and says "the objects changed since this report: ...", and the next
click acts on the new text. A click applies a fix to the live objects, then the
report is re-diagnosed from those same objects (which also says why each finding
left), never patched from a cached state. Every action goes through the
controller the widget is given (``Report.controller()``: re-diagnose, apply,
undo, the safe plan); the widget only draws its current report. Applied fixes belong to the report they came from; the widget keeps
them in :attr:`ReportWidget.applied` so Undo works after any number of
refreshes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .formatting import (
    also_found_label,
    cause_layout,
    fix_button_label,
    fix_kind,
    fix_label,
    plural,
    singular_counts,
)
from .html import (
    BG,
    BORDER,
    CODE_BG,
    COLORS,
    FG,
    FONT,
    LINK,
    MUTED,
    OK_COLOR,
    PRE,
    UI_FG,
    UI_FG_STRONG,
    WATCHER_ONLY,
    caches_html,
    cause_html,
    code,
    e,
    finding_body_html,
    histogram_html,
    layers_html,
    numerics_html,
    pill,
    precision_html,
    proof_html,
    scale_history_html,
    scalers_html,
    subjects_html,
    tint,
    verdict_html,
    watcher_only,
)
from .text import departures_sentence

WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
#: Tab titles of the panels, in order (short: seven of them fit on two rows at 600 px).
PANELS = ("dtypes", "layers", "numerics", "caches", "scaler", "precision", "issue report")

#: The widget's stylesheet, scoped to the report. Colours come from JupyterLab's CSS variables (which
#: ipywidgets 7 also defines for classic Notebook) with light-theme fallbacks; buttons and tab labels
#: wrap instead of being cut with an ellipsis; the header's buttons drop under the verdict when narrow.
STYLE = f"""<style>
.mpdoctor-widget {{ color: {FG}; background: {BG}; {FONT}; }}
.mpdoctor-widget .jupyter-button, .mpdoctor-widget .widget-button {{
  white-space: normal; overflow: visible; text-overflow: clip; height: auto; min-height: 28px;
  max-width: 100%; line-height: 1.3; padding: 3px 10px; text-align: left; overflow-wrap: anywhere;
  color: {UI_FG}; background: {CODE_BG};
  border: 1px solid {BORDER}; }}
.mpdoctor-widget .jupyter-button.mpd-safe {{ background: {tint(OK_COLOR)}; color: {FG}; border: 2px solid {OK_COLOR}; }}
.mpdoctor-widget .jupyter-button.mpd-unsafe {{ background: {tint(COLORS["warning"])}; color: {FG}; border: 2px solid {COLORS["warning"]}; }}
.mpdoctor-widget .jupyter-button.mpd-armed {{ background: {tint(COLORS["error"])}; color: {FG}; border: 2px solid {COLORS["error"]}; }}
.mpdoctor-widget .jupyter-button:disabled {{ opacity: 1; }}
.mpdoctor-widget .lm-TabBar-content, .mpdoctor-widget .p-TabBar-content {{ flex-wrap: wrap; }}
.mpdoctor-widget .lm-TabBar, .mpdoctor-widget .p-TabBar {{ min-height: var(--jp-widgets-horizontal-tab-height, 24px); max-height: none; height: auto; overflow: visible; }}
.mpdoctor-widget .lm-TabBar-tab, .mpdoctor-widget .p-TabBar-tab {{
  flex: 0 0 auto; min-width: 0; max-width: none; color: {UI_FG} !important;
  background: {CODE_BG} !important; }}
.mpdoctor-widget .lm-TabBar-tab.lm-mod-current, .mpdoctor-widget .p-TabBar-tab.p-mod-current {{
  color: {UI_FG_STRONG} !important; background: {BG} !important; }}
.mpdoctor-widget .lm-TabBar-tabLabel, .mpdoctor-widget .p-TabBar-tabLabel {{ overflow: visible; text-overflow: clip; }}
.mpdoctor-widget .widget-textarea textarea {{ color: {FG}; background: {BG}; }}
.mpdoctor-widget .widget-html-content {{ overflow-wrap: anywhere; }}
</style>"""

#: Copies the issue-report text of the widget it is shown in; run in the browser by the Copy button.
_COPY_JS = (
    "(function(){var t=document.querySelectorAll('.mpdoctor-widget .mpd-issue textarea');"
    "var v=t.length?t[t.length-1].value:'';"
    "if(navigator.clipboard){navigator.clipboard.writeText(v);}})();"
)


def _major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


def _exc_named(exc: BaseException, name: str) -> bool:
    # The fix exceptions are matched by name: renderers never import the fix machinery (it imports torch).
    return any(cls.__name__ == name for cls in type(exc).__mro__)


@dataclass(eq=False)
class AppliedFix:
    """A fix applied from the widget, kept across refreshes for Undo.

    ``finding`` and ``fix`` are the report-dict views as they were when the
    fix was applied (the finding is usually gone from the refreshed report).
    """

    fix: Any
    finding: dict
    fix_view: dict
    key: tuple[str, str]


def iter_widgets(root: Any) -> Iterator[Any]:
    """Every widget under ``root`` (included), depth first."""
    stack = [root]
    while stack:
        widget = stack.pop()
        yield widget
        stack.extend(reversed(tuple(getattr(widget, "children", ()) or ())))


def _close_tree(root: Any) -> None:
    for widget in list(iter_widgets(root)):
        try:
            widget.close()
        except Exception:  # a widget already closed, or a comm gone with its kernel
            pass


def _button_layout(w: Any) -> Any:
    # Sized to the label, never stretched by a VBox, never wider than the report (long labels wrap).
    return w.Layout(width="auto", max_width="100%", flex="0 1 auto", align_self="flex-start", margin="2px 6px 2px 0")


def shown_panels(view: Any) -> list[str]:
    """The tabs with something to show: a tab whose panel would only say "none here" is left out."""
    data = view.data
    has = {
        "dtypes": bool(data["histogram"]),
        "layers": bool(view.layer_strips),
        "numerics": bool(data.get("scan") or data.get("probe")),
        "caches": bool(data["caches"]),
        "scaler": bool(data["scalers"] or data.get("scale_history")),
    }
    return [name for name in PANELS if has.get(name, True)]


@dataclass(eq=False)
class SameChange:
    """Fixes of several findings that make one change (the same cast offered "of model" and "of opt"): one
    button, on the first card offering any of them, acting through ``fix`` (the planned one when one is)."""

    owner: Any
    finding: Any
    fix: Any
    view: dict
    finding_view: dict
    siblings: list
    fixes: tuple


def change_key(fix: Any) -> tuple | None:
    """What a fix sets (each change's targets), comparable across findings; None when it does not say."""
    try:
        targets = [(repr(k), repr(v)) for change in fix.changes for k, v in change.targets().items()]
    except Exception:  # a change spec that cannot say: its fix keeps its own button
        return None
    return tuple(sorted(targets)) or None


def same_change_groups(findings: list, views: list[dict]) -> dict[int, SameChange]:
    """``id(fix) -> SameChange`` for every in-place fix that makes the same change as a fix of another finding."""
    by_key: dict[tuple, list] = {}
    for finding, view in zip(findings, views):
        for fix, fv in zip(finding.fixes, view["fixes"]):
            key = change_key(fix) if fv.get("applicability") != "display-only" else None
            if key is not None:
                by_key.setdefault(key, []).append((finding, fix, fv, view))
    groups: dict[int, SameChange] = {}
    for members in by_key.values():
        if len({id(m[0]) for m in members}) < 2:
            continue
        finding, fix, fv, view = next((m for m in members if m[2].get("planned")), members[0])
        group = SameChange(members[0][0], finding, fix, fv, view, view["fixes"], tuple(m[1] for m in members))
        groups.update({id(m[1]): group for m in members})
    return groups


def _planned(pair: tuple, groups: dict) -> Any:
    """Whether the button of a (fix, view) pair acts on a planned fix (its group's, when it has one)."""
    group = groups.get(id(pair[0]))
    return (group.view if group is not None else pair[1]).get("planned")


def _finding_key(finding: Any) -> tuple[str, str]:
    return (finding.check, finding.subject)


def _pending_titles(report: Any) -> list[str]:
    """The safe fixes "Apply all" would re-plan on the live objects; a crash's fix, applied as it was seen, is not."""
    return [singular_counts(fx.title) for fx in report.safe_fixes if not fx.applied and not getattr(fx, "bound_where_seen", False)]


def _plan_change(shown: list[str], now: list[str]) -> str:
    """What differs between the safe fixes a widget shows and those a diagnosis made now would apply."""
    gone = [t for t in shown if t not in now]
    new = [t for t in now if t not in shown]
    parts = ([f"no longer needed: {'; '.join(gone)}"] if gone else []) + ([f"now needed: {'; '.join(new)}"] if new else [])
    return ", ".join(parts) or "the safe fixes changed order"


def _fix_key(finding: Any, fix: Any) -> tuple[str, str, str]:
    return (finding.check, finding.subject, fix.title)


def _style(button: Any, kind: str) -> Any:
    """Mark a button as ``safe``, ``unsafe``, ``armed`` or plain; the stylesheet colours it."""
    for cls in ("mpd-safe", "mpd-unsafe", "mpd-armed"):
        if cls in button._dom_classes:
            button.remove_class(cls)
    if kind:
        button.add_class(f"mpd-{kind}")
    return button


class ReportWidget:
    """The report as ipywidgets, with one button per fix.

    Parameters
    ----------
    source : ReportController or Report
        What the widget acts through: a controller (:meth:`Report.controller`: the report shown, re-diagnosis,
        apply, undo, the safe plan), or a report, whose own controller is then used. The widget draws the
        controller's report and never calls a report's actions itself.

    Attributes
    ----------
    view : ipywidgets.VBox
        The root widget (display it, or use :meth:`mimebundle`).
    controller : ReportController
        The actions, and the current (latest) diagnosis of the live objects (``controller.report``).
    report : Report
        That current diagnosis.
    applied : list of AppliedFix
        Fixes applied from this widget and not undone, oldest first.
    confirm_delay : float
        Seconds a confirming click must come after the first one, so a
        double-click never applies an unsafe fix.
    """

    confirm_delay = 0.4

    def __init__(self, source: Any) -> None:
        import ipywidgets as w

        self._w = w
        # A Report hands out its controller; a controller is one already (duck-typed: renderers import no diagnosis).
        self.controller = source.controller() if hasattr(source, "findings") else source
        self.applied: list[AppliedFix] = []
        self.status = ""
        self._notes: dict[tuple[str, str], str] = {}
        self._armed: dict[tuple[str, str, str], tuple[float, str]] = {}

        self.style = w.HTML(STYLE, layout=w.Layout(height="0px", margin="0", overflow="hidden"))
        self.header = w.HTML(layout=w.Layout(flex="1 1 320px", min_width="0"))
        self.rediagnose_button = w.Button(
            description="Re-diagnose",
            tooltip="Diagnose the same live objects again",
            layout=_button_layout(w),
        )
        self.rediagnose_button.on_click(lambda _b: self._refresh("Re-diagnosed the live objects"))
        self.apply_all_button = w.Button(layout=_button_layout(w))
        _style(self.apply_all_button, "safe")
        self.apply_all_button.on_click(self._on_apply_all)
        self.status_line = w.HTML()
        self.findings_box = w.VBox()
        self.dtypes_panel = w.HTML()
        self.layers_panel = w.HTML()
        self.numerics_panel = w.HTML()
        self.caches_panel = w.HTML()
        self.scaler_panel = w.HTML()
        self.precision_panel = w.HTML()
        self.issue_text = w.Textarea(layout=w.Layout(width="98%", height="260px"))
        # The Copy button runs one line of script through an Output widget. classic Notebook's
        # widgetsnbextension 3.6 (ipywidgets 7) cannot create Output models, so there the box and
        # the select-all hint stay and the button is left out.
        self._clipboard = w.Output(layout=w.Layout(height="0px", overflow="hidden")) if _major(w.__version__) >= 8 else None
        issue_help = w.HTML(
            f"<div style='{FONT};color:{MUTED}'>The report as markdown, with versions and device, "
            "to paste into a bug report"
            + ("." if self._clipboard is not None else ": click in the box, select all (Ctrl/Cmd+A) and copy.")
            + "</div>"
        )
        copy_row = []
        if self._clipboard is not None:
            self.copy_button = w.Button(
                description="Copy to clipboard",
                icon="copy",
                tooltip="Copy the report as markdown (with versions and device) for a bug report",
                layout=_button_layout(w),
            )
            self.copy_button.on_click(self._on_copy)
            copy_row = [w.HBox([self.copy_button, self._clipboard])]
        issue_box = w.VBox([issue_help, *copy_row, self.issue_text])
        issue_box.add_class("mpd-issue")
        self._panel_widgets = dict(zip(PANELS, (
            self.dtypes_panel, self.layers_panel, self.numerics_panel, self.caches_panel, self.scaler_panel,
            self.precision_panel, issue_box)))  # fmt: skip
        self.panels = w.Tab()
        self.watcher_note = w.HTML()
        top = w.HBox(
            [
                self.header,
                w.HBox(
                    [self.rediagnose_button, self.apply_all_button],
                    layout=w.Layout(flex="0 1 auto", flex_flow="row wrap", max_width="100%"),
                ),
            ],
            layout=w.Layout(flex_flow="row wrap", justify_content="space-between", align_items="flex-start", width="100%"),
        )
        self.view = w.VBox(
            [self.style, top, self.status_line, self.findings_box, self.watcher_note, self.panels],
            layout=w.Layout(border=f"1px solid {BORDER}", padding="6px 10px", margin="2px 0"),
        )
        self.view.add_class("mpdoctor-widget")
        self._render()

    # -- display ---------------------------------------------------------------------
    @property
    def report(self) -> Any:
        """The current diagnosis: the controller's report."""
        return self.controller.report

    def mimebundle(self) -> dict:
        """The widget view plus ``text/plain`` and ``text/html`` for static exports.

        Built from ``view.model_id`` (ipywidgets 7.7.1 has no ``_repr_mimebundle_``);
        protocol version 2.0 is read by both ipywidgets 7 and 8 frontends.
        """
        return {
            "text/plain": self.report.to_text(),
            "text/html": self.report.to_html(),
            WIDGET_VIEW_MIME: {"version_major": 2, "version_minor": 0, "model_id": self.view.model_id},
        }

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kwargs: Any) -> dict:
        bundle = self.mimebundle()
        if include:
            bundle = {k: v for k, v in bundle.items() if k in include}
        if exclude:
            bundle = {k: v for k, v in bundle.items() if k not in exclude}
        return bundle

    def _ipython_display_(self) -> None:
        from .bundles import display_widget

        display_widget(self)

    def close(self) -> None:
        """Close every widget of the report (the kernel side forgets them)."""
        _close_tree(self.view)

    # -- queries (for tests and scripting) ---------------------------------------------
    def buttons(self, containing: str = "") -> list:
        """Buttons whose label contains ``containing``, in display order."""
        return [
            x
            for x in iter_widgets(self.view)
            if isinstance(x, self._w.Button) and containing in (x.description or "")
        ]

    def html_values(self) -> list[str]:
        """The markup of every HTML widget in the report."""
        return [x.value for x in iter_widgets(self.view) if isinstance(x, (self._w.HTML, self._w.HTMLMath))]

    # -- rendering -------------------------------------------------------------------
    def _render(self) -> None:
        rv = self.report.view
        data = rv.data
        self.header.value = f"<div style='{FONT}'>{verdict_html(data)}{subjects_html(data)}{proof_html(data)}</div>"
        pending_safe = rv.pending_safe_fixes
        self.apply_all_button.description = f"Apply all safe fixes ({pending_safe})"
        self.apply_all_button.disabled = not pending_safe
        # Nothing to apply: no button at all rather than a disabled "(0)".
        self.apply_all_button.layout.display = None if pending_safe else "none"
        self.apply_all_button.tooltip = (
            "Apply every safe fix: they keep the meaning of the run (unsafe ones need their own click)"
        )
        self.status_line.value = (
            f"<div style='{FONT};color:{FG};border-left:3px solid {COLORS['info']};padding:2px 6px;margin:2px 0'>{e(self.status)}</div>"
            if self.status
            else ""
        )
        open_keys = {_finding_key(f) for f in self.report.findings}
        # Open findings first: they are what needs doing; applied fixes (with Undo) follow.
        cards = []
        label = rv.cause_label
        if label:  # the finding that explains an exception comes first, under this heading
            cards.append(self._w.HTML(cause_html(label)))
        self.fix_buttons = []
        shown, folded = cause_layout(data["findings"]) if label else (list(range(len(data["findings"]))), [])
        findings = [(self.report.findings[i], data["findings"][i]) for i in [*shown, *folded]]
        groups = same_change_groups([f for f, _ in findings], [fd for _, fd in findings])
        finding_cards = [self._finding_card(f, fd, groups) for f, fd in findings]
        if folded:  # the cause (and its planned fix) first; the other findings folded under it
            also = self._w.Accordion(children=(self._w.VBox(finding_cards[len(shown):]),), selected_index=None)
            also.set_title(0, also_found_label(len(folded)))
            finding_cards = [*finding_cards[: len(shown)], also]
        cards += finding_cards
        cards += [self._applied_card(a, a.key in open_keys) for a in self.applied]
        old = self.findings_box.children
        self.findings_box.children = tuple(cards)
        for widget in old:
            _close_tree(widget)
        self.dtypes_panel.value = histogram_html(data["histogram"], watcher_only=watcher_only(data))
        self.layers_panel.value = layers_html(rv)
        self.numerics_panel.value = numerics_html(data)
        self.caches_panel.value = caches_html(data["caches"])
        self.scaler_panel.value = scalers_html(
            data["scalers"], watched=bool(data.get("scale_history")), watcher_only=watcher_only(data)
        ) + scale_history_html(data)
        self.precision_panel.value = precision_html(data)
        self._show_panels(shown_panels(rv))
        self.watcher_note.value = (
            f"<div style='{FONT};color:{MUTED}'>{e(WATCHER_ONLY)} Run %mpdoctor for the live objects' dtypes, "
            "caches and scaler state.</div>" if watcher_only(data) else ""
        )
        self.issue_text.value = self.report.to_markdown()
        if self._clipboard is not None:
            self._clipboard.outputs = ()

    def _show_panels(self, names: list[str]) -> None:
        """Show the tabs named ``names`` (in :data:`PANELS` order), keeping the selected one when it stays."""
        children = tuple(self._panel_widgets[n] for n in names)
        if children == tuple(self.panels.children):
            return
        index = self.panels.selected_index
        current = self.panels.children[index] if index is not None and index < len(self.panels.children) else None
        self.panels.children = children
        for i, name in enumerate(names):
            self.panels.set_title(i, name)
        self.panels.selected_index = children.index(current) if current in children else 0

    def panel_titles(self) -> list[str]:
        """The titles of the tabs shown, in order."""
        return [self.panels.get_title(i) for i in range(len(self.panels.children))]

    def _finding_card(self, finding: Any, view: dict, groups: dict) -> Any:
        w = self._w
        parts = [finding_body_html(view)]
        if view["fixes"]:
            snippets = "".join(
                f"<div style='font-size:12px;color:{MUTED}'>fix ({e(fix_kind(fx, view['fixes']))}): "
                f"{e(singular_counts(fx['title']))}:</div>"
                + (f"<div style='font-size:12px;color:{MUTED}'>cost: {e(fx['cost'])}</div>" if fx.get("cost") else "")
                + (f"<div style='font-size:12px;color:{MUTED}'>{e(fx['note'])}</div>" if fx.get("note") else "")
                + (f"<div style='font-size:12px;color:{MUTED}'>{e(fx['proof'])}</div>" if fx.get("proof") else "")
                + (f"<div style='font-size:12px;color:{MUTED}'>{e(fx['trial'])}</div>" if fx.get("trial") else "")
                + f"<pre style='{PRE}'>{e(fx['code'])}</pre>"
                for fx in view["fixes"]
            )
            parts.append(
                f"<details style='{FONT}'><summary style='cursor:pointer;color:{LINK}'>"
                f"the same fix as code</summary>{snippets}</details>"
            )
        else:
            parts.append(f"<div style='{FONT};font-size:12px;color:{MUTED}'>No automatic fix for this one.</div>")
        note = self._notes.get(_finding_key(finding))
        if note:
            parts.append(f"<div style='{FONT};margin-top:2px'>{pill('! note', COLORS['error'])} {e(note)}</div>")
        buttons: list[Any] = []
        drawn: list = []
        for fix, fv in sorted(zip(finding.fixes, view["fixes"]), key=lambda p: _planned(p, groups) is False):
            if fv.get("applicability") == "display-only":
                continue  # nothing to do in place: its code is in "the same fix as code"
            if fv.get("in_place"):  # a button that would change nothing is not drawn: the card says why
                parts.append(f"<div style='{FONT};font-size:12px;color:{MUTED}'>{pill('already in place', OK_COLOR)} "
                             f"{e(singular_counts(fv['title']))}: {e(fv['note'])}</div>")  # fmt: skip
                continue
            group = groups.get(id(fix))
            if group is not None and group.owner is not finding:  # one button, on the first card offering it
                parts.append(f"<div style='{FONT};font-size:12px;color:{MUTED}'>{e(singular_counts(fv['title']))}: "
                             f"the same change as “{e(singular_counts(group.view['title']))}” above, one button for "
                             "both</div>")  # fmt: skip
                continue
            target = (finding, fix, fv, view, view["fixes"], (fix,))
            if group is not None:
                if group in drawn:
                    continue
                drawn.append(group)
                target = (group.finding, group.fix, group.view, group.finding_view, group.siblings, group.fixes)
            buttons += self._fix_buttons(*target)
        children = [w.HTML("".join(parts))]
        if buttons:
            children.append(w.HBox(buttons, layout=w.Layout(flex_flow="row wrap", max_width="100%")))
        return w.VBox(
            children,
            layout=w.Layout(border=f"1px solid {BORDER}", padding="4px 8px", margin="4px 0"),
        )

    def _fix_buttons(self, finding: Any, fix: Any, fix_view: dict, view: dict, siblings: list[dict],
                     fixes: tuple) -> list:  # fmt: skip
        """A fix's button (acting on ``fix`` for all ``fixes``), and Cancel beside it when it is armed."""
        w = self._w
        button = self._fix_button(finding, fix, fix_view, view, siblings)
        self.fix_buttons.append((button, fixes))
        if _fix_key(finding, fix) not in self._armed:
            return [button]
        cancel = w.Button(description="Cancel", tooltip="Do not apply this fix", layout=_button_layout(w))
        cancel.on_click(self._disarm_handler(_fix_key(finding, fix)))
        return [button, cancel]

    def _fix_button(self, finding: Any, fix: Any, fix_view: dict, view: dict, siblings: list[dict]) -> Any:
        w = self._w
        _short, full = fix_label(fix_view["title"])
        armed = self._armed.get(_fix_key(finding, fix))
        proof = f" Proof on your step: {fix_view['proof']}." if fix_view.get("proof") else ""
        if armed is not None:
            description, kind = armed[1], "armed"
            tooltip = f"{full}. {armed[1]}"
        elif fix.safe:
            description, kind = fix_button_label(fix_view, siblings), "safe"
            tooltip = f"{full}. Safe fix: keeps the meaning of the run you intended. Undo is available after.{proof}"
        else:
            description, kind = fix_button_label(fix_view, siblings), "unsafe"
            tooltip = (f"{full}. Unsafe fix: changes numerics or state; asks for a confirming second click. Undo is "
                       f"available after.{proof}")  # fmt: skip
        if fix_view.get("planned") is False and armed is None:
            tooltip = f"{tooltip} Not in the planned treatment: {fix_view.get('note', '')}"
        button = w.Button(description=description, tooltip=tooltip, layout=_button_layout(w))
        _style(button, kind)
        button.on_click(lambda _b: self._on_fix(finding, fix, fix_view, view))
        return button

    def _applied_card(self, entry: AppliedFix, still_reported: bool) -> Any:
        w = self._w
        f = entry.finding
        outcome = (
            f"{pill('still reported', COLORS['error'])} after re-diagnosis: the fix did not take"
            if still_reported
            else "gone after re-diagnosis of the live objects"
        )
        html = (
            f"<div style='{FONT}'><div>{pill('applied', OK_COLOR)} {e(singular_counts(entry.fix_view['title']))}</div>"
            f"<div style='font-size:12px'>{code(f['check'])} on {code(f['subject'])}: {outcome}</div>"
            f"<div style='font-size:12px;color:{MUTED};margin-top:2px'>changed in place, in this kernel only: running "
            "the cell that builds the object again builds it as it was, undoing this fix. To make it stick, paste this "
            "where the object is created:</div>"
            f"<pre style='{PRE}'>{e(entry.fix_view['code'])}</pre></div>"
        )
        undo = w.Button(
            description="Undo",
            icon="undo",
            tooltip="Restore exactly what this fix changed",
            layout=_button_layout(w),
        )
        undo.on_click(lambda _b: self._on_undo(entry))
        return w.VBox(
            [w.HTML(html), undo],
            layout=w.Layout(border=f"1px solid {OK_COLOR}", padding="4px 8px", margin="4px 0"),
        )

    # -- actions ---------------------------------------------------------------------
    def _refresh(self, action: str, watch: tuple[str, str] | None = None) -> None:
        """Diagnose the live objects again and redraw; ``action`` heads the status line.

        ``watch`` is the finding a fix was just applied to: the status says
        whether the fresh diagnosis still reports it.
        """
        try:
            fresh = self.controller.refresh()  # says why each finding left, and keeps those only code can fix
        except Exception as exc:  # the widget must stay usable whatever the objects do
            self.status = f"{action}; re-diagnosis failed: {type(exc).__name__}: {exc}"
        else:
            departures = departures_sentence(list(fresh.departed))
            self.status = action + (f". {departures}" if departures else "")
            if watch is not None and any(_finding_key(f) == watch for f in fresh.findings):
                self.status += ": the finding is still reported, so the fix did not take"
        self._armed.clear()  # a confirmation belongs to the report it was given on
        self._render()

    def _arm(self, finding: Any, fix: Any, reason: str) -> None:
        self._armed[_fix_key(finding, fix)] = (time.monotonic(), f"Click again to confirm: {reason}")
        self._render()

    def _disarm_handler(self, key: tuple[str, str, str]) -> Any:
        return lambda _b: self._disarm(key)

    def _disarm(self, key: tuple[str, str, str]) -> None:
        self._armed.pop(key, None)
        self._notes.pop(key[:2], None)
        self._render()

    def _unsafe_reason(self, fix: Any) -> str:
        try:
            steps = "; ".join(fix.preview())
        except Exception:
            steps = ""
        reason = f"{steps} (unsafe)" if steps else "this unsafe fix changes numerics or state"
        if getattr(fix, "needs_confirmation", False):
            reason += f", keeps a {fix.backup_bytes / 2**30:.1f} GiB undo backup"
        return reason

    def _stale(self, what: str, fresh: Any) -> None:
        """Show ``fresh`` (the objects as they are now) instead of acting on a report they no longer match."""
        self.controller.adopt(fresh)
        self.status = f"Nothing applied: the objects changed since this report: {what}. The report is re-diagnosed; click again to act on it"
        self._armed.clear()  # a confirmation given on the old text confirms nothing
        self._render()

    def _changed_fix(self, finding: Any, fix: Any, fix_view: dict) -> tuple[Any, str]:
        """A diagnosis made now, and what differs from what this widget shows of ``fix`` ("" when nothing does).

        Run before a button acts: after "Run All" the objects behind an old report may have been cast again.
        """
        if getattr(fix, "bound_where_seen", False):  # a crash's fix, bound to the batch it saw: applied as seen
            return self.report, ""
        fresh = self.controller.diagnose_now()
        if fresh is self.report:  # nothing live to re-read: the report is the state
            return fresh, ""
        where = f"{finding.check} on {finding.subject}"
        now = next((f for f in fresh.findings if _finding_key(f) == _finding_key(finding)), None)
        if now is None:
            return fresh, f"{where} is no longer found"
        match = next((fx for fx in now.fixes if fx.key == fix.key), None)
        shown = singular_counts(fix_view["title"])
        if match is None:
            return fresh, f"“{shown}” is no longer offered for {where}"
        if singular_counts(match.title) != shown:
            return fresh, f"“{shown}” would now be “{singular_counts(match.title)}”"
        return fresh, ""

    def _on_fix(self, finding: Any, fix: Any, fix_view: dict, view: dict) -> None:
        if not self.controller.offers(fix):
            return  # a stale button from a report already replaced
        try:
            fresh, changed = self._changed_fix(finding, fix, fix_view)
        except Exception as exc:  # the widget must stay usable whatever the objects do
            self.status = f"Nothing applied: re-reading the live objects failed: {type(exc).__name__}: {exc}"
            self._render()
            return
        if changed:
            self._stale(changed, fresh)
            return
        key = _finding_key(finding)
        armed = self._armed.get(_fix_key(finding, fix))
        if armed is None and not fix.safe:
            self._arm(finding, fix, self._unsafe_reason(fix))
            return
        if armed is not None and time.monotonic() - armed[0] < self.confirm_delay:
            return  # the second half of a double-click is not a confirmation
        title = singular_counts(fix_view["title"])
        try:
            self.controller.apply(fix, confirm=armed is not None)
        except Exception as exc:  # Fix.apply wraps errors in FixFailed; anything else is the last line
            if _exc_named(exc, "FixNeedsConfirmation"):
                self._notes[key] = f"Not applied yet: {exc}. Click the button again to confirm."
                self._arm(finding, fix, f"keeps a {fix.backup_bytes / 2**30:.1f} GiB undo backup")
                return
            if _exc_named(exc, "FixFailed"):
                self._notes[key] = f"Not applied, nothing was changed: {exc}"
                self._refresh(f"“{title}” failed and was rolled back")
                return
            self._notes[key] = f"Not applied: {type(exc).__name__}: {exc}"
            self._refresh(f"“{title}” failed")
            return
        self._notes.pop(key, None)
        self.applied.append(AppliedFix(fix, view, fix_view, key))
        self._refresh(f"Applied “{title}” and re-diagnosed the live objects", watch=key)

    def _on_undo(self, entry: AppliedFix) -> None:
        title = singular_counts(entry.fix_view["title"])
        try:
            self.controller.undo(entry.fix)
        except Exception as exc:
            self.status = f"Undo of “{title}” failed: {type(exc).__name__}: {exc}"
            self._render()
            return
        if entry in self.applied:
            self.applied.remove(entry)
        self._refresh(f"Undid “{title}” and re-diagnosed the live objects")

    def _on_copy(self, _button: Any = None) -> None:
        """Put the issue-report markdown on the browser's clipboard (a one-line script run by the frontend)."""
        text = json.dumps(self.issue_text.value).replace("<", "\\u003c").replace(">", "\\u003e")
        script = f"navigator.clipboard && navigator.clipboard.writeText({text});"
        self._clipboard.outputs = (
            {"output_type": "display_data", "data": {"application/javascript": script, "text/plain": ""}, "metadata": {}},
        )
        self.status = "Copied the issue report to the clipboard (or select the text in the box and copy it)"
        self.status_line.value = (
            f"<div style='{FONT};color:{FG};border-left:3px solid {COLORS['info']};padding:2px 6px;margin:2px 0'>{e(self.status)}</div>"
        )

    def _on_apply_all(self, _button: Any = None) -> None:
        try:
            fresh = self.controller.diagnose_now()
        except Exception as exc:  # the widget must stay usable whatever the objects do
            self.status = f"Nothing applied: re-reading the live objects failed: {type(exc).__name__}: {exc}"
            self._render()
            return
        shown, now = _pending_titles(self.report), _pending_titles(fresh)
        if fresh is not self.report and now != shown:
            self._stale(_plan_change(shown, now), fresh)
            return
        data = self.report.view.data
        owners = {
            id(fx): (finding, view, fv)
            for finding, view in zip(self.report.findings, data["findings"])
            for fx, fv in zip(finding.fixes, view["fixes"])
        }
        done = self.controller.apply_safe()
        for fx in done:
            if id(fx) not in owners:  # a safe fix planned on a simulated state: the re-diagnosis shows it
                continue
            finding, view, fv = owners[id(fx)]
            self._notes.pop(_finding_key(finding), None)
            self.applied.append(AppliedFix(fx, view, fv, _finding_key(finding)))
        skipped = 0
        for fx in self.report.safe_fixes:
            if not fx.applied and fx.error and id(fx) in owners:
                finding = owners[id(fx)][0]
                hint = " Click its button to confirm." if fx.needs_confirmation else ""
                self._notes[_finding_key(finding)] = f"Not applied: {fx.error}.{hint}"
                skipped += 1
        action = f"Applied {plural(len(done), 'safe fix', 'safe fixes')}"
        if skipped:
            action += f" ({skipped} could not be applied)"
        self._refresh(action + " and re-diagnosed the live objects")
