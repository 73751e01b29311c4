"""Nerogar/OneTrainer#442: DoRA on a UNet whose weights are stored in float8 never starts training.

diffusers' ``enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)`` upcasts a
stored weight only inside its layer's forward. DoRA reads the base weight outside it (its weight norm, when the
adapter is created): on CUDA "Promotion for Float8 Types is not supported", on this CPU
``"mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'`` (measured, at ``add_adapter``). The diagnosis reads
the ``LoraConfig`` the user holds before the adapter exists, so the report comes before the crash.

The fix, in place: DoRA's target layers taken out of float8 storage on the live UNet (their float8 weights cast to
bf16, exactly; their ``LayerwiseCastingHook`` removed), the rest left float8. The user's cell then creates the adapter
and trains; undo gives the UNet back bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch
from fingerprint import assert_unchanged, fingerprint
from notebook_shell import loaded_shell

pytest.importorskip("diffusers")
from peft import LoraConfig  # noqa: E402
from test_field_diffusers import tiny_unet  # noqa: E402

import mpdoctor  # noqa: E402
from mpdoctor.rules.engine.fixes import Applicability, FixFailed  # noqa: E402

TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


def dora_on_float8(skip_targets: bool = False, dora: bool = True) -> dict:
    unet = tiny_unet()
    unet.requires_grad_(False)
    unet.to(torch.bfloat16)
    skip = (*TARGETS, "norm") if skip_targets else ("norm",)
    unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16,
                                  skip_modules_pattern=skip)
    torch.manual_seed(13)
    return {
        "unet": unet,
        "lora_config": LoraConfig(r=4, lora_alpha=4, use_dora=dora, target_modules=TARGETS),
        "latents": torch.randn(1, 4, 8, 8, dtype=torch.bfloat16),
        "states": torch.randn(1, 4, 16, dtype=torch.bfloat16),
        "target": torch.randn(1, 4, 8, 8),
    }


def adapter_step(ns: dict) -> torch.Tensor:
    """The user's cell: add the adapter, build the optimizer over what trains, one step."""
    ns["unet"].add_adapter(ns["lora_config"])
    return train_adapter(ns)


def train_adapter(ns: dict) -> torch.Tensor:
    """The rest of the user's cell: the optimizer over what trains (the adapter), one step that moves it."""
    unet = ns["unet"]
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    before = [p.detach().clone() for p in params]
    pred = unet(ns["latents"], torch.tensor([10]), ns["states"]).sample
    loss = torch.nn.functional.mse_loss(pred.float(), ns["target"])
    loss.backward()
    optimizer.step()
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, params)), "no adapter parameter moved"
    return loss


def test_dora_on_float8_stored_targets_raises_and_is_named_before_the_adapter_exists():
    with pytest.raises(Exception, match=r"not implemented for 'Float8_e4m3fn'|Promotion for Float8"):
        adapter_step(dora_on_float8())  # the harm: the adapter cannot be created
    ns = dora_on_float8()
    report = mpdoctor.diagnose(namespace=ns)
    (f,) = report.findings_for("dora-on-float8-storage")
    assert f.severity == "error" and f.subject == "lora_config"
    assert re.search(r"not implemented for 'Float8_e4m3fn'|Promotion for Float8", f.evidence["refused"])  # measured here
    targeted = [n for n, _ in ns["unet"].named_modules() if n.endswith((".to_q", ".to_k", ".to_v", ".to_out.0"))]
    assert sorted(f.evidence["layers"]) == sorted(targeted) and len(targeted) == 32
    live, keep = f.fixes
    assert live.applicability is Applicability.SAFE and live.recipe == "dora-targets-unstored-live"
    assert [x.key for x in report.fixes if x.slug == f.check] == [live.key]  # the plan takes the in-place fix
    assert keep.applicability.name == "DISPLAY_ONLY" and "skip_modules_pattern" in keep.code
    assert f"skip_modules_pattern={(*sorted(TARGETS), 'norm')!r}" in keep.code  # the advised setup, run below


def test_the_advised_setup_that_keeps_dora_runs_and_draws_nothing():
    """The display-only alternative, run: DoRA's targets kept out of float8 storage, the rest stays float8."""
    ns = dora_on_float8(skip_targets=True)
    report = mpdoctor.diagnose(namespace=ns)
    assert [x.check for x in report.findings if x.severity in ("error", "warning")] == [], report.to_text()
    assert ns["unet"].conv_in.weight.dtype == torch.float8_e4m3fn
    assert torch.isfinite(adapter_step(ns))


def test_plain_lora_on_float8_stored_targets_fails_too_so_it_is_not_offered():
    """Why "use plain LoRA" is not the fix through PEFT: its adapter layers on float8-stored targets raise at the
    first forward (measured). The finding is about DoRA's config, so plain LoRA draws no DoRA finding."""
    ns = dora_on_float8(dora=False)
    assert mpdoctor.diagnose(namespace=ns).findings_for("dora-on-float8-storage") == []
    with pytest.raises(Exception, match=r"not implemented for 'Float8_e4m3fn'|Promotion for Float8"):
        adapter_step(ns)


# -- the fix in place: DoRA's targets taken out of float8 storage on the live UNet ----------------------------------


def _targets(unet: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for n, m in unet.named_modules() if n.endswith((".to_q", ".to_k", ".to_v", ".to_out.0"))]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def storage_state(unet: torch.nn.Module) -> dict:
    """Per module object (PEFT moves a targeted layer under its adapter layer; the object stays): its own
    parameters (object, dtype, bytes), its diffusers hook registry's containers and their contents, its own forward."""
    out = {}
    for m in unet.modules():
        own = m.__dict__
        reg = own.get("_diffusers_hook")
        out[m] = (
            [(n, p, p.dtype, _bytes(p)) for n, p in own["_parameters"].items() if p is not None],
            None if reg is None else (reg.hooks, dict(reg.hooks), reg._hook_order, list(reg._hook_order),
                                      reg._fn_refs, list(reg._fn_refs), [r.forward for r in reg._fn_refs]),
            own.get("forward"),
        )
    return out


def assert_same_storage(before: dict, after: dict) -> None:
    """Every module of ``before`` holds the same parameter objects, dtypes and bytes, the same registry containers
    holding the same hooks and function references, and the same own forward."""
    assert all(m in after for m in before), "a module of the UNet was lost"
    for m, (params, reg, forward) in before.items():
        now_params, now_reg, now_forward = after[m]
        assert [(n, p, d) for n, p, d, _ in params] == [(n, p, d) for n, p, d, _ in now_params], m
        assert all(torch.equal(b, nb) for (*_, b), (*_, nb) in zip(params, now_params, strict=True)), m
        assert now_forward is forward, m
        if reg is not None:
            assert now_reg[0] is reg[0] and now_reg[1] == reg[1] and now_reg[2] is reg[2] and now_reg[3] == reg[3]
            assert now_reg[4] is reg[4] and now_reg[5] == reg[5]
            assert all(a is b for a, b in zip(now_reg[6], reg[6], strict=True))


def _sample(ns: dict) -> torch.Tensor:
    with torch.no_grad():
        return ns["unet"](ns["latents"], torch.tensor([10]), ns["states"]).sample


def planned_fix(ns: dict) -> object:
    """The plan's fix for the finding, from a diagnosis of the namespace."""
    report = mpdoctor.diagnose(namespace=ns)
    (fix,) = [x for x in report.fixes if x.slug == "dora-on-float8-storage"]
    assert fix.applicability is Applicability.SAFE and not fix.in_place
    return fix


def test_the_targets_leave_float8_storage_in_place_the_forward_is_unchanged_and_undo_is_bit_for_bit():
    ns = dora_on_float8()
    unet, before = ns["unet"], storage_state(ns["unet"])
    stored = {m for m in unet.modules() if any(p.dtype == torch.float8_e4m3fn for p in m.parameters(recurse=False))}
    sample = _sample(ns)
    fix = planned_fix(ns)
    fix.apply()
    assert fix.applied, fix.error
    targets = _targets(unet)
    for layer in targets:  # as skip_modules_pattern leaves a layer: bf16, the values it stored, its own forward
        assert layer.weight.dtype == torch.bfloat16 and "forward" not in layer.__dict__
        assert layer._diffusers_hook.get_hook("layerwise_casting") is None
        stored_bytes = before[layer][0][0][3]
        assert torch.equal(_bytes(layer.weight.to(torch.float8_e4m3fn)), stored_bytes)
    rest = stored - set(targets)
    assert rest and all(p.dtype == torch.float8_e4m3fn for m in rest for p in m.parameters(recurse=False))
    assert all(m._diffusers_hook.get_hook("layerwise_casting") is not None for m in rest)
    assert torch.equal(_sample(ns), sample)  # the same values cast to the same dtype: the same forward, bit for bit
    assert mpdoctor.diagnose(namespace=ns).findings_for("dora-on-float8-storage") == []
    fix.undo()
    assert_same_storage(before, storage_state(unet))
    layer = targets[0]  # its forward upcasts again for the call and stores float8 after it
    out = layer(torch.randn(1, 4, layer.in_features, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(_sample(ns), sample)


def test_the_users_cell_creates_the_adapter_and_trains_after_the_fix_and_undo_restores_the_base_layers():
    ns = dora_on_float8()
    unet, before = ns["unet"], storage_state(ns["unet"])
    fix = planned_fix(ns)
    fix.apply()
    assert fix.applied, fix.error
    assert torch.isfinite(adapter_step(ns))  # the user's failing cell: the adapter is created, and one step moves it
    assert len([n for n, _ in unet.named_parameters() if "lora_magnitude_vector" in n]) == 32  # DoRA on every target
    stored = [n for n, p in unet.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert stored and not any(".to_" in n for n in stored)  # every layer DoRA does not target stays float8
    assert unet.conv_in.weight.dtype == torch.float8_e4m3fn
    fix.undo()  # the adapter the user made stays; the layers under it are given back as they were
    after = storage_state(unet)
    for m, (params, reg, forward) in before.items():
        assert [(p, d) for _, p, d, _ in params] == [(p, d) for _, p, d, _ in after[m][0]]
        assert all(torch.equal(b, nb) for (*_, b), (*_, nb) in zip(params, after[m][0], strict=True))
        assert after[m][2] is forward and (reg is None or list(after[m][1][1]) == list(reg[1]))


def test_after_the_cell_raised_the_fix_lets_the_same_cell_run_again():
    """The cell already raised once: diffusers set ``_hf_peft_config_loaded`` before the injection that failed, so the
    same ``add_adapter`` would now raise AttributeError (no ``peft_config``). The fix resets that flag too."""
    ns = dora_on_float8()
    with pytest.raises(Exception, match=r"not implemented for 'Float8_e4m3fn'|Promotion for Float8"):
        adapter_step(ns)
    assert ns["unet"].__dict__.get("_hf_peft_config_loaded") is True and "peft_config" not in ns["unet"].__dict__
    fix = planned_fix(ns)
    fix.apply()
    assert fix.applied, fix.error
    assert torch.isfinite(adapter_step(ns))
    fix.undo()
    assert ns["unet"].__dict__.get("_hf_peft_config_loaded") is True  # undo gives back the flag as it was too


def test_the_fix_code_shown_does_what_the_fix_does():
    """The code under the fix, run as the user would run it on the same setup: the adapter is created and trains,
    and the layers it does not target keep their float8 storage and hooks."""
    ns = dora_on_float8()
    fix = planned_fix(ns)
    exec(fix.code, {"torch": torch, **ns})  # noqa: S102 - the fix's own code, on the test's own objects
    assert all(layer.base_layer.weight.dtype == torch.bfloat16 for layer in _targets(ns["unet"]))
    assert ns["unet"].conv_in.weight.dtype == torch.float8_e4m3fn
    assert ns["unet"].conv_in._diffusers_hook.get_hook("layerwise_casting") is not None
    assert torch.isfinite(train_adapter(ns))


def test_a_hook_registry_laid_out_otherwise_is_refused_and_nothing_changes():
    """The hook's removal reads diffusers' registry internals: a layout it does not know is refused at bind, before
    any weight is cast (the fix is atomic); diffusers' own ``remove_hook`` is no way out: it raises for this hook."""
    throwaway = tiny_unet().to(torch.bfloat16)
    throwaway.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="does not support deinitialization"):
        _targets(throwaway)[0]._diffusers_hook.remove_hook("layerwise_casting", recurse=False)
    ns = dora_on_float8()
    unet = ns["unet"]
    fix = planned_fix(ns)
    layer = _targets(unet)[-1]
    layer._diffusers_hook._fn_refs = tuple(layer._diffusers_hook._fn_refs)  # not the list diffusers keeps
    before = storage_state(unet)
    with pytest.raises(FixFailed, match="not laid out as mpdoctor knows it"):
        fix.apply()
    assert not fix.applied
    assert_same_storage(before, storage_state(unet))


def test_the_fix_applies_once_and_its_twin_from_an_older_report_changes_nothing():
    """Idempotent: the same fix from a report taken before (a card still on screen) sees the change in place and
    adds nothing; undoing both restores the UNet's storage (the test's fingerprint does not walk diffusers' objects:
    :func:`storage_state` does) and the rest of the namespace exactly."""
    ns = dora_on_float8()
    first, second = (planned_fix(ns) for _ in range(2))
    before, rest = storage_state(ns["unet"]), fingerprint({k: v for k, v in ns.items() if k != "unet"})
    first.apply()
    assert first.applied and second.in_place
    applied = storage_state(ns["unet"])
    second.apply()
    assert_same_storage(applied, storage_state(ns["unet"]))
    second.undo()
    first.undo()
    assert_same_storage(before, storage_state(ns["unet"]))
    assert_unchanged(rest, fingerprint({k: v for k, v in ns.items() if k != "unet"}), "the fix and its undo")


def test_the_fix_is_verified_on_the_users_step_and_the_proof_leaves_the_unet_as_it_was():
    """``diagnose(..., step=)``: the user's cell run as it is (it raises), then after the fix (the adapter is created and
    moves), each run rolled back. The step injects an adapter: the proof puts the UNet's module tree back (children,
    attributes such as ``peft_config`` and the flag the failed run set), so the diagnosis leaves the UNet as it was."""
    ns = dora_on_float8()
    unet, before = ns["unet"], storage_state(ns["unet"])
    children = {m: dict(m._modules) for m in unet.modules()}
    attrs = set(unet.__dict__)
    report = mpdoctor.diagnose(namespace=ns, step=lambda: adapter_step(ns))
    (fix,) = [x for x in report.fixes if x.slug == "dora-on-float8-storage"]
    assert report.proof.label(fix).startswith("verified on your step: applied alone, it ran and trained"), report.proof.label(fix)
    assert report.proof.summary().startswith("Plan verified on your step"), report.proof.summary()
    assert list(unet.modules()) == list(children) and all(dict(m._modules) == c for m, c in children.items())
    assert set(unet.__dict__) == attrs and not any(p.requires_grad for p in unet.parameters())
    assert_same_storage(before, storage_state(unet))
    fix.apply()  # then for real: the user's cell creates the adapter and trains
    assert torch.isfinite(adapter_step(ns))


def test_in_a_notebook_the_cell_that_raised_is_proven_with_mpdoctor_step_then_runs_after_the_fix():
    """A real IPython shell: the user's cell raised at ``add_adapter``; on this CPU the refusal is no crash family, so
    no cell is held for a replay: ``%mpdoctor --step`` names the user's function instead. The fix is verified on it,
    the UNet is left as it was, and after the fix the same call creates the adapter and trains."""
    setup = ("import torch\nfrom test_field_dora_float8 import dora_on_float8, adapter_step\nns = dora_on_float8()\n"
             "unet, lora_config = ns['unet'], ns['lora_config']\n"
             "def add_and_train():\n    return adapter_step(ns)\n")  # fmt: skip
    with loaded_shell(("torch", "dora_on_float8", "adapter_step", "ns", "unet", "lora_config", "add_and_train",
                       "r", "loss")) as sh:  # fmt: skip
        sh.run_cell(setup, store_history=True)
        assert not sh.run_cell("loss = add_and_train()", store_history=True).success
        sh.run_cell("r = %mpdoctor unet lora_config --step add_and_train --text", store_history=True)
        report, unet = sh.user_ns["r"], sh.user_ns["unet"]
        (fix,) = [x for x in report.fixes if x.slug == "dora-on-float8-storage"]
        assert report.proof.label(fix).startswith("verified on your step"), report.proof.label(fix)
        assert not any("lora" in n for n, _ in unet.named_modules())  # the proof's runs left no adapter behind
        fix.apply()
        assert sh.run_cell("loss = add_and_train()", store_history=True).success
        assert torch.isfinite(sh.user_ns["loss"]) and unet.conv_in.weight.dtype == torch.float8_e4m3fn
