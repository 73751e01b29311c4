"""Reading 200 cells of history for AMP loop mistakes: ``read_history`` on a real IPython shell.

A real ``InteractiveShell`` holds 200 cells in its history (setup cells, training loops of every shape the
reader knows: clipping, accumulation, a ``train_step`` function, a cell that does not parse, ``%%time``
cells), stored as IPython stores them; nothing is executed. The figure is the time of ``read_history(shell)``
(parse every cell, walk them in order, build the findings with their corrected lines), first with a cold
parse cache, then warm (what a second ``%mpdoctor`` costs). The baseline is ``ast.parse`` of the same 200
cells, measured in the same run. Target: <= 50 ms for 200 cells, cold.

Prints a table and ``RESULT {json}`` lines for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import statistics
import time

CELLS = [
    "import torch\nmodel = torch.nn.Linear(8, 1)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "scaler = torch.amp.GradScaler('cpu')\ndata = [(torch.randn(4, 8), torch.randn(4, 1))] * {n}\n",
    "for x, y in data:\n    optimizer.zero_grad()\n    loss = (model(x) - y).pow(2).mean() * {n}\n"
    "    scaler.scale(loss).backward()\n    scaler.unscale_(optimizer)\n"
    "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    scaler.step(optimizer)\n    scaler.update()\n",
    "for i, (x, y) in enumerate(data):\n    loss = (model(x) - y).pow(2).mean() / {n}\n"
    "    scaler.scale(loss).backward()\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    "    if (i + 1) % 2 == 0:\n        scaler.step(optimizer)\n        scaler.update()\n        optimizer.zero_grad()\n",
    "def train_step_{n}(x, y):\n    optimizer.zero_grad()\n    with torch.autocast('cpu', dtype=torch.bfloat16):\n"
    "        loss = (model(x) - y).pow(2).mean()\n    scaler.scale(loss).backward()\n    scaler.step(optimizer)\n"
    "    scaler.update()\n    return loss.item()\n",
    "losses_{n} = [train_step_{m}(x, y) for x, y in data]\nprint(sum(losses_{n}) / len(losses_{n}))\n",
    "get_ipython().run_cell_magic('time', '', 'for x, y in data:\\n    loss = model(x).sum() * {n}\\n"
    "    scaler.scale(loss).backward()\\n    scaler.step(optimizer)\\n    scaler.update()\\n')\n",
    "x = {n}\ny = x ** 2\nprint(x, y)\n",
    "for x in data:\n    oops({n}\n",  # does not parse: skipped
]


def history_cells(count: int) -> list[str]:
    """``count`` distinct cells in the shapes of a training notebook."""
    out = []
    for n in range(count):
        template = CELLS[n % len(CELLS)]
        out.append(template.replace("{n}", str(n)).replace("{m}", str(n - 1)))
    return out


def fill_history(shell, cells: list[str]) -> None:
    """Store cells in the shell's history as IPython does for each run cell (without running them)."""
    shell.reset(new_session=True)
    for code in cells:
        shell.history_manager.store_inputs(shell.execution_count, code, code)
        shell.execution_count += 1


def timed(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()  # not timed: emptying the caches frees the previous trees
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from IPython.core.interactiveshell import InteractiveShell

    from mpdoctor.attach.runtime import loop_rewrite
    from mpdoctor.attach.runtime.history import read_history
    from mpdoctor.objects.readers import loop_source

    shell = InteractiveShell.instance()
    cells = history_cells(200)
    fill_history(shell, cells)
    repeats = 5 if args.quick else 21
    found = read_history(shell)
    assert found and all(f.subject.startswith("cell [") for f in found), (
        "the bench history holds mistakes to find"
    )

    def empty_caches() -> None:
        loop_source.parse.cache_clear()
        loop_rewrite._parent_map.cache_clear()
        gc.collect()

    def parse_only() -> None:
        for code in cells:
            try:
                ast.parse(code)
            except SyntaxError:
                pass

    cold_s = timed(lambda: read_history(shell), repeats, before=empty_caches)
    warm_s = timed(lambda: read_history(shell), repeats, before=gc.collect)
    parse_s = timed(parse_only, repeats, before=gc.collect)
    print(
        f"200 cells: read_history cold {cold_s * 1e3:.1f} ms, warm {warm_s * 1e3:.1f} ms; ast.parse alone {parse_s * 1e3:.1f} ms"
    )
    print(f"findings: {len(found)} ({', '.join(sorted({f.check for f in found}))})")
    rows = [
        {
            "figure": "read 200 cells of history for AMP loop mistakes (cold) vs ast.parse of the same cells",
            "mpdoctor": round(cold_s * 1e3, 2), "baseline": round(parse_s * 1e3, 2),
            "ratio": round(cold_s / parse_s, 2), "target": "<= 50 ms", "met": cold_s <= 0.050, "unit": "ms (median)",
        },
        {
            "figure": "read 200 cells of history again (parse cache warm: a second %mpdoctor) vs ast.parse",
            "mpdoctor": round(warm_s * 1e3, 2), "baseline": round(parse_s * 1e3, 2),
            "ratio": round(warm_s / parse_s, 2), "target": "<= 50 ms", "met": warm_s <= 0.050, "unit": "ms (median)",
        },
    ]  # fmt: skip
    shell.reset(new_session=True)
    for row in rows:
        print("RESULT " + json.dumps(row))


if __name__ == "__main__":
    main()
