"""The support matrix's corners: what each runs and what it leaves out, with the reason. The one place that says so.

``make test`` runs the whole suite in ``.venv`` (the *pinned* corner) and then each corner here in its own venv
with ``MPDOCTOR_CORNER=<name>``: ``tests/conftest.py`` reads this table, collects only the corner's ``runs``
and deselects its ``excluded`` tests, naming each with its reason in the summary. ``docs/support-matrix.md``
shows the same table to users.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Corner:
    """One corner of the support matrix.

    Attributes
    ----------
    name : str
        The value of ``MPDOCTOR_CORNER``, and the venv's suffix (``.venv-<name>``).
    versions : str
        What the corner installs, for the summary and the docs.
    runs : tuple of str
        Test paths (files or folders, relative to the repository) the corner collects; empty for all.
    excluded : dict
        Test path or node id prefix -> why this corner cannot hold it.
    """

    name: str
    versions: str
    runs: tuple[str, ...] = ()
    excluded: dict[str, str] = field(default_factory=dict)


#: What a version corner must prove: core diagnosis, the fixes, the loop watcher, the crash hook, the exception
#: catalogue, the magic, and the compatibility module. The rest of the suite (renderers, widgets, notebooks,
#: benchmarks, the training stack) does not depend on these versions beyond what these tests reach.
CORE = (
    "tests/test_compat.py",
    "tests/test_core_api.py",
    "tests/test_checks_dtypes.py",
    "tests/test_checks_precision.py",
    "tests/test_checks_scaler_cache.py",
    "tests/test_integrations.py",
    "tests/field/test_torch_core.py",
    "tests/field/test_transformers_core.py",
    "tests/field/test_peft_accelerate_core.py",
    "tests/test_treatment.py",
    "tests/test_fix_safety.py",
    "tests/test_runtime_protocol.py",
    "tests/field/test_runtime_protocol_cases.py",
    "tests/test_crash_watch.py",
    "tests/test_crash_hook.py",
    "tests/test_crash_patterns.py",
    "tests/test_exception_families.py",
    "tests/field/test_exception_cases.py",
    "tests/test_magic.py",
)

CORNERS: dict[str, Corner] = {
    c.name: c
    for c in (
        Corner(
            "oldest",
            "Python 3.10, torch 2.4.0, transformers 4.50.0, accelerate 0.30.0, peft 0.10.0, IPython 7.34.0, "
            "ipywidgets 7.6.0 (constraints-oldest.txt)",
            runs=CORE,
            excluded={},
        ),
        Corner(
            "newest",
            "Python 3.13, torch 2.14.1, transformers 5.24.0, accelerate 1.15.0, peft 0.21.2, IPython 9.18.1, "
            "ipywidgets 8.1.9 (constraints-newest.txt)",
            runs=(*CORE, "tests/test_notebooks.py::test_notebook_runs_top_to_bottom_and_its_claims_hold[04_cache_in_training]"),
            excluded={},
        ),
        Corner(
            "colab",
            "Python 3.11, torch 2.13.0, transformers 5.23.0, IPython 7.34.0, ipywidgets 7.7.1, ipykernel 6.17.1 "
            "(constraints-colab.txt)",
            runs=(),
            excluded={
                "tests/stack": "the training stack beyond transformers (Lightning, DeepSpeed, torchao, ...) is "
                "installed in .venv only",
                "tests/distributed": "multi-process jobs of the training stack, installed in .venv only",
                "tests/test_browser.py": "needs JupyterLab and Playwright, installed in .venv only",
                "tests/test_binder.py": "builds Binder's environment with .venv's JupyterLab",
                "tests/test_bench_smoke.py": "the benchmarks measure the pinned stack, in .venv",
            },
        ),
    )
}


def current() -> Corner | None:
    """The corner this test run is, from ``MPDOCTOR_CORNER``; None for the pinned corner (the whole suite)."""
    name = os.environ.get("MPDOCTOR_CORNER", "")
    if not name:
        return None
    if name not in CORNERS:
        raise ValueError(f"MPDOCTOR_CORNER={name!r}: the corners are {', '.join(CORNERS)}")
    return CORNERS[name]
