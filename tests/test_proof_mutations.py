"""The proof's own mutations: each one a defect the proof once had or could have, each killed by the suite.

Every mutation below changes one piece of mpdoctor's proof, replay, intent or loop-rewrite code in a copy of the
package, then runs the tests named beside it against that copy (in a fresh interpreter that imports the copy, not
the installed package). The mutation must be killed: those tests fail. A mutation whose text is no longer in the
code fails here too, so the list follows the code.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # under mpdoctor/
    old: str
    new: str
    killers: tuple[str, ...]  # test node ids (or files) that must fail on it


MUTATIONS = (
    Mutation("trials are not restored between fixes", "diagnosis/proof.py",
             "            revert_steps(steps)  # reverts every step it can; the snapshot restores the rest\n        snapshot.restore()",
             "            revert_steps(steps)  # reverts every step it can; the snapshot restores the rest",
             ("tests/test_proof_honesty.py::test_a_safe_plan_that_alone_does_not_cure_says_so_and_names_what_else_it_takes",
              "tests/test_proof_honesty.py::test_two_cures_of_one_failure_that_undo_each_other_are_not_planned_together")),
    Mutation("a fix after which training stops is kept", "diagnosis/proof.py",
             "return (before.ran and not outcome.ran) or (before.trained and not outcome.trained)",
             "return False",
             ("tests/test_proof.py::test_a_fix_that_breaks_a_step_that_trained_is_tried_not_planned",)),
    Mutation("Proof.verified ignores .trained", "diagnosis/proof.py",
             "return not self.stand_in and self.plan is not None and self.plan.trained",
             "return not self.stand_in and self.plan is not None",
             ("tests/test_proof_honesty.py::test_a_plan_after_which_the_step_runs_without_training_is_not_verified",)),
    Mutation("NaN parameters count as trained", "diagnosis/proof.py",
             '        return "a parameter became inf/NaN"\n',
             "        pass\n",
             ("tests/test_proof_honesty.py::test_a_step_with_no_optimizer_step_or_nan_parameters_did_not_train",)),
    Mutation("all-zero gradients count as trained", "diagnosis/proof.py",
             '        return "no gradient reached the parameters" if not seen.reached else "every gradient was zero or inf/NaN"\n',
             "        pass\n",
             ("tests/test_proof_honesty.py::test_a_step_whose_gradients_are_all_zero_ran_but_did_not_train_even_when_weight_decay_moves_the_weights",)),
    Mutation("namespace tensors are not restored", "diagnosis/replay.py",
             '        for tensor, saved in self.tensors:\n            _put(tensor, "data", saved)',
             "        pass",
             ("tests/test_proof_honesty.py::test_a_cell_replay_puts_back_a_tensor_the_cell_changes_in_place",)),
    Mutation("modes and requires_grad are not restored", "diagnosis/proof.py",
             "        for sub, training in self.modes:\n            if sub.training != training:\n                sub.train(training)",
             "        pass",
             ("tests/test_proof_honesty.py::test_diagnose_step_leaves_the_scheduler_modes_and_requires_grad_as_they_were",)),
    Mutation("LR schedulers are not restored", "diagnosis/proof.py",
             "            scheduler.load_state_dict(copy.deepcopy(saved))",
             "            pass",
             ("tests/test_proof_honesty.py::test_diagnose_step_leaves_the_scheduler_modes_and_requires_grad_as_they_were",)),
    Mutation("the cell replay stops at the first optimizer step", "diagnosis/replay.py",
             "        namespace[_MARKER] = _Round()\n",
             "        namespace[_MARKER] = _Round()\n        __import__('torch.optim.optimizer').optim.optimizer"
             ".register_optimizer_step_post_hook(lambda *a: (_ for _ in ()).throw(FailingLineAgain()))\n",
             ("tests/test_proof_honesty.py::test_a_cell_whose_failing_line_comes_after_its_optimizer_step_is_replayed_through_that_line",)),
    Mutation("a step reading an iterator is not refused", "diagnosis/proof.py",
             "    reader = iterator_reader(step)\n",
             '    reader = ""\n',
             ("tests/test_proof_honesty.py::test_diagnose_step_refuses_a_step_that_reads_an_iterator_and_moves_nothing",)),
    Mutation("the frozen check ignores requires_grad", "objects/readers/intent.py",
             "            if p is not None:\n                if p.requires_grad:\n                    return False\n                found = True",
             "            if p is not None:\n                found = True",
             ("tests/test_intent_islands.py::test_a_frozen_copy_reached_through_a_helper_and_a_trainable_twin_are_both_on_the_compute_path",)),
    Mutation("_keep_in_fp32 islands are dropped", "objects/readers/intent.py",
             "    islands.extend(_kept_in_fp32(model))\n",
             "",
             ("tests/stack/test_between_steps_averaging.py",)),
    Mutation("a fix is labelled verified whatever the outcome", "diagnosis/proof.py",
             '    return f"{unverified}: applied alone, {alone.describe()}"',
             '    return f"verified {where}: applied alone, {alone.describe()}"',
             ("tests/test_proof.py::test_a_fix_that_leaves_the_failure_as_it_was_is_not_called_verified",)),
    Mutation("the summary always says verified", "diagnosis/proof.py",
             'verdict = "verified on your step" if self.plan.trained else "not verified on your step"',
             'verdict = "verified on your step"',
             ("tests/test_proof.py::test_a_fix_that_leaves_the_failure_as_it_was_is_not_called_verified",)),
    Mutation("a stand-in step is labelled verified", "diagnosis/proof.py",
             '    verdict = "checked" if stand_in else "verified"\n',
             '    verdict = "verified"\n',
             ("tests/test_proof_honesty.py::test_a_step_mpdoctor_builds_itself_is_checked_and_never_labelled_verified",)),
    Mutation("a proof survives a change of plan", "diagnosis/report.py",
             '        if evolved.proof is not None and "proof" not in changes and not _same_plans(self, evolved):',
             "        if False:",
             ("tests/test_assembly.py::test_a_report_whose_plan_changes_after_its_proof_holds_no_proof_and_shows_no_label",)),
    Mutation("a fix verified with others is applied alone", "diagnosis/treatment.py",
             "        if group and any(fx is not fix for fx in group):",
             "        if False:",
             ("tests/test_assembly.py::test_a_fix_verified_only_with_another_names_it_and_applying_it_applies_both_as_one_undoable_action",)),
    Mutation("the same error in another module fails as before", "diagnosis/proof.py",
             "        return not self.ran and not other.ran and self.error == other.error and self.at == other.at",
             "        return not self.ran and not other.ran and self.error == other.error",
             ("tests/test_assembly.py::test_a_fix_verified_only_with_another_names_it_and_applying_it_applies_both_as_one_undoable_action",)),
    Mutation("the module tree a step changes is not put back", "diagnosis/proof.py",
             "        for tree in self.trees:\n            tree.restore()",
             "        pass",
             ("tests/test_proof_module_tree.py::test_a_step_that_injects_an_adapter_is_judged_by_what_it_made_and_leaves_the_tree_as_it_was",)),
    Mutation("a step is not judged by the parameters it made", "diagnosis/proof.py",
             '        return made if made is not None else "no parameter of the diagnosed models is trainable"',
             '        return "no parameter of the diagnosed models is trainable"',
             ("tests/test_proof_module_tree.py::test_a_step_that_injects_an_adapter_is_judged_by_what_it_made_and_leaves_the_tree_as_it_was",)),
    Mutation("new parameters that never move count as trained", "diagnosis/proof.py",
             '        return "" if moved else "no optimizer step moved the parameters the step made trainable"',
             '        return ""',
             ("tests/test_proof_module_tree.py::test_a_step_whose_new_parameters_never_move_did_not_train",)),
    # (the same line in _step_through_scaler is covered twice: the corrected loop read again adds the update)
    Mutation("scaler.update() is not inserted in a corrected loop", "attach/runtime/loop_rewrite.py",
             '    return [Edit("after", stmt, f"{_indent(source, stmt)}{mistake.scaler}.update()  # once per real step")]',
             "    return []",
             ("tests/test_corrected_loops.py::test_every_corrected_loop_the_reader_shows_runs_and_trains_and_keeps_no_mistake",)),
    Mutation("IPython's output variables name a patient", "attach/crash/frames.py",
             "    return name.startswith(\"_\") or name in _SHELL_BINDINGS",
             "    return False",
             ("tests/test_proof_honesty.py::test_ipythons_output_variables_never_name_a_patient",)),
)

#: One interpreter that has imported pytest, its plugins and the heavy libraries the killers import (never
#: mpdoctor), and forks a child per mutation: the child puts the mutated copy first on the path, runs pytest on
#: the killers, then says which mpdoctor it imported. Each mutation thus runs in a process of its own that
#: imports the copy, not the installed package (an editable install whose finder would import the repository's
#: own code: its finder is taken out first), without paying for torch's import 23 times. Requests and answers
#: are JSON lines on stdin and stdout; a child that outlives its timeout is killed and the answer says so.
_SERVER = r"""
import importlib, json, os, sys, time, signal
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
import pytest
from importlib.metadata import entry_points
for ep in entry_points(group="pytest11"):
    try:
        ep.load()
    except Exception:
        pass
for name in ("torch", "transformers", "peft", "IPython.core.interactiveshell", "hypothesis"):
    try:
        importlib.import_module(name)
    except Exception:
        pass
assert "mpdoctor" not in sys.modules, "the server must not import mpdoctor: each child imports its own copy"
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            sys.path.insert(0, req["copy"])
            code = int(pytest.main(req["args"]))
            import mpdoctor
            with open(req["result"], "w") as out:
                json.dump({"exit": code, "mpdoctor": mpdoctor.__file__}, out)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline, status = time.monotonic() + req["timeout"], None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = "timeout"
        else:
            time.sleep(0.02)
    print(json.dumps({"status": status}), flush=True)
"""


@pytest.fixture(scope="module")
def mutant_runner():
    """The forking server above, started once for the module's mutations."""
    server = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    ready = server.stdout.readline()
    if ready.strip() != "ready":
        server.kill()
        pytest.fail(f"the mutation server did not start: {ready!r}\n{server.stderr.read()[-3000:]}")

    def run(copy: Path, killers: tuple[str, ...], tmp: Path) -> tuple[object, dict, str]:
        log, result = tmp / "pytest.log", tmp / "result.json"
        args = ["-x", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *killers]
        request = {"copy": str(copy), "args": args, "log": str(log), "result": str(result), "timeout": 600}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        if not answer:
            pytest.fail(f"the mutation server stopped:\n{server.stderr.read()[-3000:]}")
        found = json.loads(result.read_text()) if result.exists() else {}
        return json.loads(answer)["status"], found, log.read_text(errors="replace") if log.exists() else ""

    yield run
    server.stdin.close()
    server.wait(timeout=60)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_mutation_of_the_proof_is_killed_by_the_suite(mutation, mutant_runner, tmp_path):
    copy = tmp_path / "mutant"
    # the bytecode of the unchanged modules comes along (copy2 keeps the sources' times, so it stays valid);
    # the mutated module's is dropped below and compiled from its new text
    shutil.copytree(ROOT / "mpdoctor", copy / "mpdoctor")
    target = copy / "mpdoctor" / mutation.path
    for stale in (target.parent / "__pycache__").glob(f"{target.stem}.*.pyc"):
        stale.unlink()
    text = target.read_text(encoding="utf-8")
    assert text.count(mutation.old) == 1, f"the mutation's text is not (once) in mpdoctor/{mutation.path}"
    target.write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")
    status, found, output = mutant_runner(copy, mutation.killers, tmp_path)
    assert "mutant/mpdoctor" in found.get("mpdoctor", ""), f"the mutated copy was not the package imported\n{output[-3000:]}"
    assert status == 1 and found["exit"] == 1, f"{mutation.name}: survived (exit {status})\n{output[-3000:]}"
