"""One Location for a line of user code: a notebook cell reads ``cell [5], line 3``, a script ``train.py:42``,
never the filename IPython compiled the cell under.

The filenames are real: produced by a real ``InteractiveShell`` running cells with ``store_history=True`` (as a
notebook runs them) and by a real script file run by the interpreter.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from mpdoctor.facts.location import Location, cell_number

#: A cell that records where it was compiled: its filename and the line of the frame it runs.
RECORD = "import sys\nhere = sys._getframe()\nwhere = (here.f_code.co_filename, here.f_lineno)\n"


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    before = set(sh.user_ns)
    yield sh
    for name in set(sh.user_ns) - before:
        del sh.user_ns[name]


def test_a_notebook_cell_is_named_by_its_execution_count_never_by_its_compiled_filename(shell):
    shell.run_cell("x = 1", store_history=True)
    result = shell.run_cell(RECORD, store_history=True)
    assert result.success
    filename, line = shell.user_ns["where"]
    count = result.execution_count
    assert filename != f"In[{count}]" and "ipython-input" in filename or filename.endswith(".py")  # a real name
    assert cell_number(filename) == count
    location = Location.at(filename, line, "here = sys._getframe()")
    assert location.cell == count and location.code == "here = sys._getframe()"
    assert location.label == f"cell [{count}], line 2" and str(location) == location.label
    assert location.place == f"cell [{count}]"
    assert filename not in location.label


def test_every_cell_of_a_session_keeps_its_own_number(shell):
    numbers = []
    for _ in range(3):
        result = shell.run_cell(RECORD, store_history=True)
        numbers.append((result.execution_count, cell_number(shell.user_ns["where"][0])))
    assert [count for count, _ in numbers] == [found for _, found in numbers]
    assert len({count for count, _ in numbers}) == 3


def test_ipykernels_cell_files_are_numbered_by_the_shells_own_record(shell):
    # ipykernel compiles a cell under /tmp/ipykernel_<pid>/<hash>.py and records its number in the same map
    # IPython keeps for its own names; the hash in the name is not the number.
    kernel_file = "/tmp/ipykernel_4242/2481233512.py"
    assert cell_number(kernel_file) is None
    assert Location.at(kernel_file, 3).label == "a notebook cell, line 3"  # a cell, even unnumbered
    fmap = getattr(shell.compile, "_filename_map", None)
    if fmap is None:  # IPython 7.34 (Colab) keeps no such map: the cell is named, unnumbered, as above
        assert not hasattr(type(shell.compile), "_filename_map")
        return
    fmap[kernel_file] = 12
    try:
        assert cell_number(kernel_file) == 12
        assert Location.at(kernel_file, 3).label == "cell [12], line 3"
    finally:
        del fmap[kernel_file]


def test_history_labels_and_old_ipython_names_carry_their_number():
    assert cell_number("In[5]") == 5 and cell_number("In [5]") == 5
    assert cell_number("<ipython-input-5-2481cb3b5a08>") == 5
    assert Location.at("<ipython-input-5-2481cb3b5a08>", 1).label == "cell [5], line 1"
    assert cell_number("In[5].py") is None and cell_number("train.py") is None


def test_a_script_line_reads_as_the_script_and_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys\nframe = sys._getframe()\nprint(frame.f_code.co_filename, frame.f_lineno)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    filename, line = done.stdout.split()
    assert filename == str(script) and line == "3"  # the frame's line is the print, where f_lineno is read
    location = Location.at(filename, int(line), "print(frame.f_code.co_filename, frame.f_lineno)\n")
    assert location.cell is None and location.code == "print(frame.f_code.co_filename, frame.f_lineno)"
    assert location.label == "train.py:3" and location.place == "train.py"  # not the full path of the clone


def test_a_script_below_the_working_directory_keeps_its_folder(tmp_path, monkeypatch):
    (tmp_path / "jobs").mkdir()
    monkeypatch.chdir(tmp_path)
    assert Location.at(str(tmp_path / "jobs" / "train.py"), 42).label == "jobs/train.py:42"
