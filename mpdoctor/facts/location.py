"""A line of the user's code: :class:`Location`, the one place a notebook cell's number is read.

The GradScaler protocol observer, the loop reader (cell history and scripts) and the crash explainer all name
the line a mistake is on. They name it the same way, as the user reads it: ``cell [5], line 3`` in a
notebook, ``train.py:42`` in a script, never the filename IPython compiled the cell under
(``<ipython-input-5-2481cb3b5a08>``, ipykernel's ``/tmp/ipykernel_123/456.py``).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

#: The filenames a notebook cell is compiled under: IPython's ``<ipython-input-5-2481cb3b5a08>``, the
#: ``In[5]`` / ``In [5]`` labels of IPython's history and tracebacks, and ipykernel's ``ipykernel_<pid>/<hash>.py``
#: cell files (their number is not in the name: IPython's ``compile._filename_map`` holds it).
_NUMBERED_CELL = (re.compile(r"<ipython-input-(\d+)-[0-9a-f]*>"), re.compile(r"In ?\[(\d+)\]"))
_KERNEL_CELL = re.compile(r".*[/\\]ipykernel_\d+[/\\]\d+\.py")


def _compiled_cell_numbers() -> dict | None:
    """IPython's filename -> execution count map, when an IPython shell runs in this process (never imported)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        shell = ipython.get_ipython()
        mapping = getattr(getattr(shell, "compile", None), "_filename_map", None)
    except Exception:  # a half-initialised shell: the file is named as a file
        return None
    return mapping if type(mapping) is dict else None


def cell_number(filename: str) -> int | None:
    """The execution count of the notebook cell compiled under ``filename``; None for a file or an unknown cell.

    Parameters
    ----------
    filename : str
        A code object's ``co_filename``, a traceback frame's filename, or a history label (``In[5]``).

    Returns
    -------
    int or None
        ``5`` for ``<ipython-input-5-2481cb3b5a08>`` and ``In[5]``; for ipykernel's cell files and IPython 8+'s
        names, the number the running shell recorded for that file.
    """
    for pattern in _NUMBERED_CELL:
        m = pattern.fullmatch(filename)
        if m:
            return int(m.group(1))
    mapping = _compiled_cell_numbers()
    number = mapping.get(filename) if mapping is not None else None
    return number if type(number) is int else None


def is_cell(filename: str) -> bool:
    """``filename`` is a notebook cell's (a numbered one, or ipykernel's cell file whose number is not known)."""
    return cell_number(filename) is not None or bool(_KERNEL_CELL.fullmatch(filename))


#: The filenames IPython's timing magics compile their code under (no linecache entry, no cell number).
_TIMED_FILES = frozenset({"<timed exec>", "<timed eval>"})


def _in_running_cell(line: int) -> Location | None:
    """Line ``line`` of a ``%%time`` cell's body (or a ``%time`` line) as a line of the running cell."""
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
        history = shell.history_manager.input_hist_raw if shell is not None else None
        raw = history[-1] if history else None
        count = len(history) - 1 if history else None  # In[0] is empty: the running cell is the last entry
    except Exception:  # no shell, or no history: the code stays where IPython compiled it
        return None
    if type(raw) is not str or type(count) is not int:
        return None
    lines = raw.splitlines()
    if lines and lines[0].lstrip().startswith("%%time"):
        user_line = line + 1  # the body starts below the cell magic
    else:
        user_line = next((i for i, text in enumerate(lines, 1) if text.lstrip().startswith("%time")), 0)
    if not 0 < user_line <= len(lines):
        return None
    code = re.sub(r"^\s*%{1,2}time\s*", "", lines[user_line - 1]).strip()
    return Location(f"In[{count}]", user_line, code, count)


def _script_name(filename: str) -> str:
    # Relative to the working directory when the script is below it (``sub/train.py``), else its basename: a
    # full path says where the clone lives, not where the loop is, and a long path can look like a token.
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        relative = ".."
    return relative if not relative.startswith("..") else (os.path.basename(filename) or filename)


@dataclass(frozen=True)
class Location:
    """A line of the user's code: a script's or a notebook cell's.

    Attributes
    ----------
    file : str
        The script's path, or the name the cell was compiled under (``<ipython-input-5-...>``, ``In[5]``).
    line : int
        The line as the user sees it (1-based; in a ``%%time`` cell, counted from the magic's line).
    code : str
        The line's code, stripped (``""`` when it could not be read).
    cell : int or None
        The cell's execution count; None for a script (or a cell whose number is unknown).
    """

    file: str
    line: int
    code: str = ""
    cell: int | None = None

    @classmethod
    def at(cls, file: str, line: int, code: str = "") -> Location:
        """The location of ``line`` in ``file``, with the cell number read from the filename.

        Code that IPython's ``%%time`` / ``%time`` compiled (``<timed exec>``) is placed in the running cell, at the
        line the user sees (below the cell magic, or the ``%time`` line), with that line's code.
        """
        if file in _TIMED_FILES:
            placed = _in_running_cell(line)
            if placed is not None:
                return placed
        return cls(file, line, code.strip(), cell_number(file))

    @property
    def place(self) -> str:
        """The cell or the script, as the user names it: ``cell [5]``, ``a notebook cell`` or ``train.py``."""
        if self.cell is not None:
            return f"cell [{self.cell}]"
        if _KERNEL_CELL.fullmatch(self.file):
            return "a notebook cell"
        return _script_name(self.file)

    @property
    def label(self) -> str:
        """``cell [5], line 3`` in a notebook, ``train.py:42`` in a script."""
        if self.cell is not None or _KERNEL_CELL.fullmatch(self.file):
            return f"{self.place}, line {self.line}"
        return f"{self.place}:{self.line}"

    def __str__(self) -> str:
        return self.label


def python_path(path: str) -> str:
    """``model.layers.0.mlp`` -> ``model.layers[0].mlp``: a module path as Python that reaches it."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", path)
