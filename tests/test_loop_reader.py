"""The loop, read: AMP loop mistakes found in the cells a real kernel ran, and in scripts before ``mpdoctor run``.

Each mistake is first run for real on this CPU (``torch.amp.GradScaler("cpu")`` is an enabled scaler here):
the real GradScaler error, or the measured harm. Then ``%mpdoctor`` names it from the history, with the cell
and line, and its fix holds the user's own loop with the corrected lines; running those lines trains (finite
loss, parameters changed). The correct recipes (PyTorch's AMP examples, accelerate's loop, Lightning's manual
optimization) draw no error and no warning.
"""

from __future__ import annotations

import inspect
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from mpdoctor.attach.runtime.history import cell_sources, read_script
from mpdoctor.attach.runtime.loop_findings import read_code
from mpdoctor.attach.runtime.protocol_rules import RULES

pytestmark = pytest.mark.colab

SETUP = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu")
loss_fn = torch.nn.MSELoss()
data = [(torch.randn(16, 8), 3 * torch.randn(16, 1)) for _ in range(8)]
accum = 2
before = [p.detach().clone() for p in model.parameters()]
losses = []
norms = []
"""


@pytest.fixture()
def ip():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.reset(new_session=True)  # a fresh history: In [1] is this test's first cell
    shell.run_cell("%load_ext mpdoctor", store_history=False)
    yield shell
    shell.run_cell("%unload_ext mpdoctor", store_history=False)
    shell.reset(new_session=True)


def run(ip, code: str, history: bool = True):
    return ip.run_cell(textwrap.dedent(code), store_history=history)


def diagnose_history(ip):
    result = run(ip, "r = %mpdoctor --text", history=False)
    assert result.error_in_exec is None
    return ip.user_ns["r"]


def loop_findings(report):
    return [f for f in report.findings if f.check in RULES]


def trained(ip) -> bool:
    """The last run trained: every loss finite, and the parameters moved."""
    ns = ip.user_ns
    moved = any(not torch.equal(a, b) for a, b in zip(ns["before"], ns["model"].parameters()))
    return bool(ns["losses"]) and all(math.isfinite(x) for x in ns["losses"]) and moved


def run_fix(ip, finding, *then: str):
    """Fresh objects, then the corrected lines the finding shows (and the cells that call them)."""
    assert run(ip, SETUP, history=False).success
    result = run(ip, finding.fixes[0].code, history=False)
    assert result.success, result.error_in_exec
    for cell in then:
        result = run(ip, cell, history=False)
        assert result.success, result.error_in_exec
    return result


# -- each mistake: the real failure, the finding naming the cell and line, the corrected lines training --------


CLIP_SCALED = """\
for x, y in data:
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    losses.append(loss.item())
    scaler.scale(loss).backward()
    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)))
    scaler.step(optimizer)
    scaler.update()
"""


def test_clipping_scaled_gradients_stalls_training_then_the_finding_names_the_line_and_unscale_fixes_it(ip):
    run(ip, SETUP)
    assert run(ip, CLIP_SCALED).success
    ns = ip.user_ns
    # Measured harm: clip_grad_norm_ read the norm x 65536 and clipped every step to 0.1; scaler.step then
    # divided the clipped gradient by 65536 again: eight steps moved the weights by almost nothing.
    broken_moved = movement(ns)
    assert min(ns["norms"]) > 1000 * 0.1
    assert broken_moved < 1e-5

    report = diagnose_history(ip)
    (finding,) = report.findings_for("amp-clip-before-unscale")
    assert finding.severity == "error" and finding.subject == "cell [2], line 6"
    assert finding.evidence["cell"] == "cell [2]" and finding.evidence["line"] == 6
    assert finding.evidence["scaled_backward"] == "cell [2], line 5"
    assert finding.evidence["optimizer"] == "optimizer"  # the step after the clip names it, as the fix does
    fix = finding.fixes[0]
    assert fix.applicability.value == "display-only" and fix.title.startswith("Call scaler.unscale_(optimizer)")
    assert "    scaler.unscale_(optimizer)" in fix.code and fix.code.index("unscale_") < fix.code.index(
        "clip_grad_norm_"
    )
    assert fix.code.startswith("for x, y in data:")

    run_fix(ip, finding)
    assert trained(ip) and max(ip.user_ns["norms"]) < 1000  # the true norms now
    moved = movement(ip.user_ns)
    assert (
        1000 * broken_moved < moved <= len(ip.user_ns["data"]) * 0.05 * 0.1 + 1e-6
    )  # clipped at 0.1, per step


def movement(ns) -> float:
    """How far the parameters moved since ``before``."""
    return (
        torch.cat([(b - a).flatten() for a, b in zip(ns["before"], ns["model"].parameters())]).norm().item()
    )


def test_optimizer_step_on_scaled_gradients_destroys_the_weights_then_scaler_step_trains(ip):
    run(ip, SETUP)
    broken = """\
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        optimizer.step()
    """
    assert run(ip, broken).success
    losses = ip.user_ns["losses"]
    assert (
        not all(math.isfinite(x) for x in losses) or max(losses) > 1e6 * losses[0]
    )  # measured: the weights blow up

    (finding,) = diagnose_history(ip).findings_for("amp-step-bypasses-scaler")
    assert finding.severity == "error" and finding.subject == "cell [2], line 6"
    code = finding.fixes[0].code
    assert "scaler.step(optimizer)" in code and "scaler.update()" in code and "optimizer.step()" not in code
    run_fix(ip, finding)
    assert trained(ip) and ip.user_ns["losses"][-1] < ip.user_ns["losses"][0] * 10


UNSCALE_PER_MICROBATCH = """\
for i, (x, y) in enumerate(data):
    loss = loss_fn(model(x), y) / accum
    losses.append(loss.item())
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    if (i + 1) % accum == 0:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
"""


def test_unscale_per_micro_batch_raises_for_real_then_the_finding_moves_it_under_the_guard(ip):
    run(ip, SETUP)
    result = run(ip, UNSCALE_PER_MICROBATCH)
    assert isinstance(result.error_in_exec, RuntimeError)
    assert "unscale_() has already been called on this optimizer since the last update()" in str(
        result.error_in_exec
    )

    (finding,) = diagnose_history(ip).findings_for("amp-unscale-twice")
    assert finding.severity == "error" and finding.subject == "cell [2], line 5"
    code = finding.fixes[0].code
    guard = code.index("if (i + 1) % accum == 0:")
    assert (
        guard
        < code.index("        scaler.unscale_(optimizer)")
        < code.index("        torch.nn.utils.clip_grad_norm_")
    )
    assert code.index("        torch.nn.utils.clip_grad_norm_") < code.index("scaler.step(optimizer)")
    run_fix(ip, finding)
    assert trained(ip)


def test_the_same_mistake_with_a_disabled_scaler_runs_and_is_info_only(ip):
    run(ip, SETUP)
    run(ip, "scaler = torch.cuda.amp.GradScaler(enabled=False)")
    assert run(ip, UNSCALE_PER_MICROBATCH).success  # a disabled scaler's unscale_ does nothing: no error yet
    assert trained(ip)
    (finding,) = diagnose_history(ip).findings_for("amp-unscale-twice")
    assert finding.severity == "info" and "enabled=False" in finding.message


def test_a_train_step_function_without_update_raises_on_the_second_step_across_cells(ip):
    run(ip, SETUP)
    run(
        ip,
        """\
        def train_step(x, y):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(optimizer)
        """,
    )
    loop = "for x, y in data:\n    train_step(x, y)\n"
    result = run(ip, loop)
    assert "step() has already been called since the last update()" in str(result.error_in_exec)

    (finding,) = diagnose_history(ip).findings_for("amp-update-missing")
    assert finding.subject == "cell [2], line 6" and finding.severity == "error"
    assert (
        finding.fixes[0].code.startswith("def train_step(x, y):")
        and "    scaler.update()" in finding.fixes[0].code
    )
    run_fix(ip, finding, loop)
    assert trained(ip)


def test_update_per_micro_batch_asserts_for_real_then_update_moves_beside_the_step(ip):
    run(ip, SETUP)
    broken = """\
    for i, (x, y) in enumerate(data):
        loss = loss_fn(model(x), y) / accum
        losses.append(loss.item())
        scaler.scale(loss).backward()
        if (i + 1) % accum == 0:
            scaler.step(optimizer)
            optimizer.zero_grad()
        scaler.update()
    """
    result = run(ip, broken)
    assert isinstance(result.error_in_exec, AssertionError)
    assert "No inf checks were recorded prior to update." in str(result.error_in_exec)

    (finding,) = diagnose_history(ip).findings_for("amp-update-per-microbatch")
    assert finding.subject == "cell [2], line 8" and finding.evidence["guarded_step"] == "cell [2], line 6"
    code = finding.fixes[0].code
    assert (
        code.index("scaler.step(optimizer)")
        < code.index("        scaler.update()")
        < code.index("optimizer.zero_grad()")
    )
    run_fix(ip, finding)
    assert trained(ip)


def test_a_scheduler_stepped_after_every_scaler_step_is_info_only_and_its_fix_steps_only_real_steps(ip):
    run(ip, SETUP)
    run(ip, "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9 ** s)")
    recipe = """\
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
    """
    assert run(ip, recipe).success
    report = diagnose_history(ip)
    (finding,) = report.findings_for("amp-scheduler-on-skipped-steps")
    assert finding.severity == "info" and finding.subject == "cell [3], line 8"
    assert report.ok  # PyTorch's own recipe: no error, no warning
    run(ip, SETUP, history=False)
    run(ip, "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9 ** s)", history=False)
    fixed = finding.fixes[0].code
    assert "if scaler.get_scale() >= scale_before:" in fixed
    assert run(ip, fixed).success and trained(ip)
    assert read_code(fixed) == []  # the corrected lines read clean


# -- history reading ----------------------------------------------------------------------------------------


def test_cells_that_do_not_parse_are_skipped_and_magics_are_transformed_away(ip):
    run(ip, SETUP)
    run(ip, "for x in data:\n    oops(")  # a SyntaxError, kept in history
    run(ip, "%time s = scaler.get_scale()")
    run(ip, "x = 1")  # nothing of the protocol in it: not even parsed
    run(ip, "%%time\n" + CLIP_SCALED)
    files = [s.file for s in cell_sources(ip)]
    assert files == ["In[1]", "In[3]", "In[5]"]
    (finding,) = diagnose_history(ip).findings_for("amp-clip-before-unscale")
    assert finding.subject == "cell [5], line 7"  # the line as the user sees it, below %%time


def test_no_history_option_and_ignore_leave_the_loop_findings_out(ip, capsys):
    run(ip, SETUP)
    run(ip, CLIP_SCALED)
    run(ip, "r = %mpdoctor --text --no-history", history=False)
    assert not loop_findings(ip.user_ns["r"])
    run(ip, "r = %mpdoctor --text --ignore amp-clip-before-unscale", history=False)
    assert not loop_findings(ip.user_ns["r"])
    assert "amp-clip-before-unscale 1" in capsys.readouterr().out


def test_a_rerun_cell_is_reported_once_at_its_latest_run(ip):
    run(ip, SETUP)
    run(ip, CLIP_SCALED)
    run(ip, CLIP_SCALED)
    (finding,) = diagnose_history(ip).findings_for("amp-clip-before-unscale")
    assert finding.subject == "cell [3], line 6"


# -- the correct recipes draw nothing -----------------------------------------------------------------------


PYTORCH_TYPICAL = """
scaler = torch.amp.GradScaler("cuda")
for epoch in range(epochs):
    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
"""
PYTORCH_CLIPPING = """
scaler = GradScaler()
for epoch in epochs:
    for input, target in data:
        optimizer.zero_grad()
        with autocast(device_type="cuda", dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
"""
PYTORCH_ACCUMULATION = """
scaler = GradScaler()
for epoch in epochs:
    for i, (input, target) in enumerate(data):
        with autocast(device_type="cuda", dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)
            loss = loss / iters_to_accumulate
        scaler.scale(loss).backward()
        if (i + 1) % iters_to_accumulate == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
"""
PYTORCH_GRADIENT_PENALTY = """
scaler = GradScaler()
for epoch in epochs:
    for input, target in data:
        optimizer.zero_grad()
        with autocast(device_type="cuda", dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)
        scaled_grad_params = torch.autograd.grad(outputs=scaler.scale(loss), inputs=model.parameters(), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        grad_params = [p * inv_scale for p in scaled_grad_params]
        with autocast(device_type="cuda", dtype=torch.float16):
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
"""
PYTORCH_MULTIPLE = """
scaler = torch.amp.GradScaler()
for epoch in epochs:
    for input, target in data:
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        with autocast(device_type="cuda", dtype=torch.float16):
            output0 = model0(input)
            output1 = model1(input)
            loss0 = loss_fn(2 * output0 + 3 * output1, target)
            loss1 = loss_fn(3 * output0 - 5 * output1, target)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        scaler.unscale_(optimizer0)
        scaler.step(optimizer0)
        scaler.step(optimizer1)
        scaler.update()
"""
ACCELERATE_LOOP = """
accelerator = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=2)
model, optimizer, training_dataloader, scheduler = accelerator.prepare(model, optimizer, training_dataloader, scheduler)
for batch in training_dataloader:
    with accelerator.accumulate(model):
        optimizer.zero_grad()
        inputs, targets = batch
        outputs = model(inputs)
        loss = loss_function(outputs, targets)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
"""
LIGHTNING_MANUAL = """
class MyModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.compute_loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()

class Accumulating(LightningModule):
    def training_step(self, batch, batch_idx, N=4):
        opt = self.optimizers()
        loss = self.compute_loss(batch) / N
        self.manual_backward(loss)
        if (batch_idx + 1) % N == 0:
            opt.step()
            opt.zero_grad()

class GAN(LightningModule):
    def training_step(self, batch):
        g_opt, d_opt = self.optimizers()
        self.toggle_optimizer(g_opt)
        g_loss = self.generator_loss(batch)
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.toggle_optimizer(d_opt)
        d_loss = self.discriminator_loss(batch)
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
"""
USE_AMP_BRANCHES = """
scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
for x, y in loader:
    with torch.autocast("cuda", enabled=use_amp):
        loss = loss_fn(model(x), y)
    if use_amp:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    if use_amp:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if use_amp:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad()
"""
TRAIN_STEP_FUNCTION = """
scaler = GradScaler()
def train_step(batch):
    optimizer.zero_grad(set_to_none=True)
    with autocast(device_type="cuda", dtype=torch.float16):
        loss = model(**batch).loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    lr_scheduler.step()
    return loss

for epoch in range(3):
    for batch in loader:
        train_step(batch)
"""
HEALTHY = {
    "pytorch-typical": PYTORCH_TYPICAL,
    "pytorch-clipping": PYTORCH_CLIPPING,
    "pytorch-accumulation": PYTORCH_ACCUMULATION,
    "pytorch-gradient-penalty": PYTORCH_GRADIENT_PENALTY,
    "pytorch-multiple-models-losses-optimizers": PYTORCH_MULTIPLE,
    "accelerate-loop": ACCELERATE_LOOP,
    "lightning-manual-optimization": LIGHTNING_MANUAL,
    "use-amp-branches": USE_AMP_BRANCHES,
    "train-step-function": TRAIN_STEP_FUNCTION,
}


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_correct_recipes_draw_no_error_and_no_warning(name):
    found = read_code(HEALTHY[name], "recipe.py")
    assert [(f.check, f.severity, f.subject) for f in found if f.severity != "info"] == []


def test_the_typical_recipe_draws_nothing_at_all_and_each_mistake_draws_its_rule():
    assert read_code(PYTORCH_TYPICAL) == []
    broken = PYTORCH_CLIPPING.replace("        scaler.unscale_(optimizer)\n", "")
    assert [f.check for f in read_code(broken)] == ["amp-clip-before-unscale"]
    broken = PYTORCH_MULTIPLE.replace("scaler.step(optimizer1)", "optimizer1.step()")
    assert [f.check for f in read_code(broken)] == ["amp-step-bypasses-scaler"]
    broken = PYTORCH_TYPICAL.replace("        scaler.update()\n", "")
    assert [f.check for f in read_code(broken)] == ["amp-update-missing"]
    broken = PYTORCH_ACCUMULATION.replace("            scaler.update()\n", "")  # unscale_ raises first
    assert {f.check for f in read_code(broken)} == {"amp-unscale-twice", "amp-update-missing"}
    broken = USE_AMP_BRANCHES.replace("    if use_amp:\n        scaler.unscale_(optimizer)\n", "")
    assert [f.check for f in read_code(broken)] == ["amp-clip-before-unscale"]


def test_the_correct_recipes_train_in_a_real_kernel_and_the_report_is_clean(ip):
    run(ip, SETUP)
    run(
        ip,
        """\
        for i, (x, y) in enumerate(data):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(x), y) / accum
            losses.append(loss.item())
            scaler.scale(loss).backward()
            if (i + 1) % accum == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        """,
    )
    run(
        ip,
        """\
        for x, y in data:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        """,
    )
    assert trained(ip)
    report = diagnose_history(ip)
    assert loop_findings(report) == [] and report.counts()["error"] == 0 and report.counts()["warning"] == 0


# -- mpdoctor run reads the script before running it ---------------------------------------------------------


def mpdoctor_run(tmp_path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    command = [sys.executable, "-m", "mpdoctor", "run", str(script)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)


SCRIPT = SETUP + UNSCALE_PER_MICROBATCH + "print('losses', len(losses))\n"


def test_mpdoctor_run_names_the_script_line_before_the_real_error(tmp_path):
    line = SCRIPT.splitlines().index("    scaler.unscale_(optimizer)") + 1
    assert read_script_finding(tmp_path, line)
    done = mpdoctor_run(tmp_path, SCRIPT)
    assert done.returncode == 1
    err = done.stderr
    named = err.index(f"ERROR   amp-unscale-twice  train.py:{line}")
    assert named < err.index("Traceback (most recent call last):")
    assert named < err.index(
        "RuntimeError: unscale_() has already been called on this optimizer since the last update()"
    )
    assert "        scaler.unscale_(optimizer)  # once per real step" in err


def read_script_finding(tmp_path, line: int) -> bool:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    (finding,) = read_script(path)
    return finding.subject == f"train.py:{line}" and finding.check == "amp-unscale-twice"


def test_mpdoctor_run_of_the_corrected_script_prints_nothing_extra_and_trains(tmp_path):
    fixed = read_script_for_fix(tmp_path)
    check = "import math\nprint('trained', all(map(math.isfinite, losses)), any(not torch.equal(a, b) for a, b in zip(before, model.parameters())))\n"
    done = mpdoctor_run(tmp_path, SETUP + fixed + check)
    assert done.returncode == 0, done.stderr
    assert "trained True True" in done.stdout
    assert "mpdoctor read" not in done.stderr


def read_script_for_fix(tmp_path) -> str:
    path = tmp_path / "broken.py"
    path.write_text(SCRIPT)
    (finding,) = read_script(path)
    return finding.fixes[0].code


# -- names: which objects are scalers, optimizers, schedulers ----------------------------------------------


def test_two_scalers_and_two_optimizers_each_checked_on_its_own():
    code = """
    scaler_g = torch.amp.GradScaler("cuda")
    scaler_d = torch.amp.GradScaler("cuda")
    for real in loader:
        scaler_d.scale(d_loss(real)).backward()
        scaler_d.unscale_(opt_d)
        torch.nn.utils.clip_grad_norm_(disc.parameters(), 1.0)
        scaler_d.step(opt_d)
        scaler_d.update()
        scaler_g.scale(g_loss(real)).backward()
        torch.nn.utils.clip_grad_norm_(gen.parameters(), 1.0)
        scaler_g.step(opt_g)
        scaler_g.update()
    """
    (finding,) = read_code(textwrap.dedent(code), "gan.py")
    assert finding.check == "amp-clip-before-unscale" and finding.subject == "gan.py:11"
    assert finding.evidence["scaler"] == "scaler_g" and "scaler_g.unscale_(opt_g)" in finding.fixes[0].code


def test_accelerators_scaler_and_a_trainer_class_attribute_are_scalers():
    code = """
    scaler = accelerator.scaler
    for batch in loader:
        scaler.scale(model(batch).loss).backward()
        optimizer.step()
    """
    assert [f.check for f in read_code(textwrap.dedent(code))] == ["amp-step-bypasses-scaler"]
    code = """
    class Trainer:
        def __init__(self, model):
            self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters())
            self.scaler = torch.amp.GradScaler("cuda")

        def train_step(self, batch):
            self.optimizer.zero_grad()
            self.scaler.scale(self.model(batch)).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
    """
    (finding,) = read_code(textwrap.dedent(code), "trainer.py")
    assert finding.check == "amp-clip-before-unscale" and finding.subject == "trainer.py:11"
    assert finding.fixes[0].code.startswith("def train_step(self, batch):")
    assert "\n    self.scaler.unscale_(self.optimizer)" in finding.fixes[0].code


def test_a_while_loop_and_a_scaled_loss_bound_to_a_name():
    code = """
    step = 0
    while step < 100:
        scaled = scaler.scale(loss_fn(model(x), y))
        scaled.backward()
        clip_grad_value_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        step += 1
    """
    (finding,) = read_code(textwrap.dedent(code))
    assert finding.check == "amp-clip-before-unscale" and finding.evidence["line"] == 6
    # A loss rebound to a plain tensor is not scaled any more.
    plain = code.replace(
        "        scaled.backward()\n", "        scaled = loss_fn(model(x), y)\n        scaled.backward()\n"
    )
    assert (
        read_code(
            textwrap.dedent(plain)
            .replace("scaler.step(optimizer)", "optimizer.step()")
            .replace("        scaler.update()\n", "")
        )
        == []
    )


def test_a_pathological_cell_is_skipped_and_the_others_are_still_read():
    from mpdoctor.attach.runtime.loop_findings import read_sources
    from mpdoctor.objects.readers.loop_source import source_of

    deep = source_of("In[1]", "x = " + "f(" * 150 + "scaler.step(optimizer)" + ")" * 150 + "\n")
    assert deep is not None  # it parses
    clip = source_of("In[2]", SETUP + CLIP_SCALED)
    limit = sys.getrecursionlimit()
    depth = len(inspect.stack())
    sys.setrecursionlimit(
        depth + 120
    )  # the deep cell overflows the walk's recursion, as a huge expression would
    try:
        found = read_sources([deep, clip])
    finally:
        sys.setrecursionlimit(limit)
    line = next(i for i, t in enumerate(clip.lines, 1) if "clip_grad_norm_" in t)
    # The deep cell's scaler.step was not taken into account (else the loop's step would be a second one).
    assert [(f.check, f.subject) for f in found] == [("amp-clip-before-unscale", f"cell [2], line {line}")]


def test_mpdoctor_run_shows_the_fix_as_a_unified_diff_of_the_script_that_git_apply_takes_and_the_result_trains(tmp_path):
    """A script's corrected loop is shown as a unified diff of the file, flush left: ``git apply`` takes it as
    printed, and the patched script runs under ``mpdoctor run`` with nothing to say, and trains."""
    check = ("import math\nprint('trained', all(map(math.isfinite, losses)), "
             "any(not torch.equal(a, b) for a, b in zip(before, model.parameters())))\n")  # fmt: skip
    done = mpdoctor_run(tmp_path, SCRIPT + check)
    assert done.returncode == 1  # the real error, after the reading
    err = done.stderr
    start = err.index("--- a/train.py\n")
    diff = err[start : err.index("\n\n", start) + 1]
    assert "+++ b/train.py\n@@ " in diff and "\n+" in diff and "\n-" in diff
    patch = tmp_path / "fix.diff"
    patch.write_text(diff)
    applied = subprocess.run(["git", "apply", "-p1", "fix.diff"], capture_output=True, text=True, cwd=tmp_path)
    assert applied.returncode == 0, applied.stderr
    fixed = (tmp_path / "train.py").read_text()
    assert fixed != textwrap.dedent(SCRIPT + check)
    again = subprocess.run([sys.executable, "-m", "mpdoctor", "run", "train.py"], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "trained True True" in again.stdout and "mpdoctor read" not in again.stderr
