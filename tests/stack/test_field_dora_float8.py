"""Nerogar/OneTrainer#442: DoRA on a UNet whose weights are stored in float8 never starts training.

diffusers' ``enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)`` upcasts a
stored weight only inside its layer's forward. DoRA reads the base weight outside it (its weight norm, when the
adapter is created): on CUDA "Promotion for Float8 Types is not supported", on this CPU
``"mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'`` (measured, at ``add_adapter``). The diagnosis reads
the ``LoraConfig`` the user holds before the adapter exists, so the report comes before the crash.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("diffusers")
from peft import LoraConfig  # noqa: E402
from test_field_diffusers import tiny_unet  # noqa: E402

import mpdoctor  # noqa: E402

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
    unet = ns["unet"]
    unet.add_adapter(ns["lora_config"])
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
    (keep,) = f.fixes
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
