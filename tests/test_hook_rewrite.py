"""The clip that runs before Lightning's plugin unscales, moved into ``on_before_optimizer_step`` (read, never run)."""

from __future__ import annotations

import ast
import linecache

from mpdoctor.attach.runtime.hook_rewrite import clip_moved_to_hook, corrected_class

CELL = """\
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = batch.sum()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5,
                            gradient_clip_algorithm="norm")
        opt.step()
        return loss
{hook}
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
"""


def _methods(code: str) -> dict[str, str]:
    (cls,) = [n for n in ast.parse(code).body if isinstance(n, ast.ClassDef)]
    return {m.name: ast.unparse(m) for m in cls.body if isinstance(m, ast.FunctionDef)}


def test_the_clip_leaves_training_step_for_a_new_hook_with_the_optimizer_mapped():
    code = clip_moved_to_hook(CELL.format(hook=""), 13)  # a line inside the two-line call
    methods = _methods(code)
    assert "clip_gradients" not in methods["training_step"]
    hook = methods["on_before_optimizer_step"]
    assert hook.startswith("def on_before_optimizer_step(self, optimizer):")
    assert "super().on_before_optimizer_step(optimizer)" in hook  # an inherited hook still runs
    assert "self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm='norm')" in hook
    assert methods["configure_optimizers"] == _methods(CELL.format(hook=""))["configure_optimizers"]


def test_an_existing_hook_keeps_its_body_and_its_own_argument_name():
    hook = "\n    def on_before_optimizer_step(self, opt_):\n        self.seen = True\n"
    code = clip_moved_to_hook(CELL.format(hook=hook), 12)
    methods = _methods(code)
    assert "self.seen = True" in methods["on_before_optimizer_step"]
    assert methods["on_before_optimizer_step"].rstrip().endswith(
        "self.clip_gradients(opt_, gradient_clip_val=0.5, gradient_clip_algorithm='norm')")
    assert list(methods).count("on_before_optimizer_step") == 1 and "super()" not in methods["on_before_optimizer_step"]


def test_a_clip_reading_another_local_or_a_tuple_of_optimizers_keeps_the_advice():
    cell = CELL.format(hook="")
    assert clip_moved_to_hook(cell.replace("opt = self.optimizers()", "opt, other = self.optimizers()"), 12) is None
    assert clip_moved_to_hook(cell.replace("gradient_clip_val=0.5", "gradient_clip_val=loss"), 12) is None
    assert clip_moved_to_hook(cell.replace("        opt.step()", "        opt = None\n        opt.step()"), 12) is None
    assert clip_moved_to_hook(cell, 10) is None  # not a clip statement: an assignment
    assert clip_moved_to_hook("def f():\n    clip()\n    step()\n", 2) is None  # no class
    assert clip_moved_to_hook("x = (", 1) is None


def test_a_clip_under_a_condition_or_sharing_its_line_keeps_the_advice():
    cell = CELL.format(hook="")
    guarded = cell.replace("        self.clip_gradients(", "        if batch_idx:\n            self.clip_gradients(")
    guarded = guarded.replace('                            gradient_clip_algorithm="norm")',
                              '                                gradient_clip_algorithm="norm")')
    assert clip_moved_to_hook(guarded, 13) is None
    shared = cell.replace("        self.manual_backward(loss)\n", "").replace(
        "        self.clip_gradients(", "        self.manual_backward(loss); self.clip_gradients(")
    assert clip_moved_to_hook(shared, 11) is None


def test_a_script_gives_its_top_level_class_and_a_nested_one_nothing():
    script = "/tmp/mpdoctor_hook_rewrite_script.py"
    source = "import torch\n\n\n" + CELL.format(hook="").replace("import torch\n\n", "")
    linecache.cache[script] = (len(source), None, source.splitlines(True), script)
    try:
        code, cell = corrected_class(script, 14)
        assert not cell and code.startswith("class Net(") and "def on_before_optimizer_step" in code
        nested = "def build():\n" + "".join(f"    {x}" for x in CELL.format(hook="").splitlines(True))
        linecache.cache[script] = (len(nested), None, nested.splitlines(True), script)
        assert corrected_class(script, 14) is None
    finally:
        linecache.cache.pop(script, None)
