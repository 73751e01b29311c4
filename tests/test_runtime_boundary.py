"""The batch at the model's boundary: a floating input in another dtype than the layer receiving it.

Each failure is real first (the RuntimeError a bf16 model raises on an fp32 batch), then mpdoctor names
the input by its key and the layer by its path, then the in-place fix, then a training step that works.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

import mpdoctor


def _step(model, batch, opt) -> tuple[float, bool]:
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    return float(loss.detach()), any(not torch.equal(a, b) for a, b in zip(before, after))


def _whisper() -> T.WhisperForConditionalGeneration:
    torch.manual_seed(0)
    config = T.WhisperConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                             decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8,
                             max_source_positions=16, max_target_positions=16, pad_token_id=0,
                             decoder_start_token_id=1, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return T.WhisperForConditionalGeneration(config).to(torch.bfloat16)


def _features() -> T.BatchFeature:
    return T.BatchFeature(
        {"input_features": torch.randn(2, 8, 32), "labels": torch.tensor([[1, 2, 3], [1, 2, 3]])}
    )


def _llama() -> T.LlamaForCausalLM:
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    return T.LlamaForCausalLM(config).to(torch.bfloat16)


def test_fp32_input_features_into_a_bf16_whisper_are_named_and_fixed_by_an_undoable_pre_hook():
    model, batch = _whisper(), _features()
    with pytest.raises(
        RuntimeError, match=r"Input type \(float\) and bias type \(c10::BFloat16\) should be the same"
    ):
        model(**batch)

    report = mpdoctor.probe(model, batch)
    finding = next(f for f in report.findings if f.check == "batch-dtype-mismatch")
    assert finding.severity == "error"
    assert finding.evidence["inputs"] == {"input_features": "float32"}
    assert finding.evidence["layer"] == "model.encoder.conv1" and finding.evidence["layer_class"] == "Conv1d"
    assert "v.to(model.dtype) if v.is_floating_point() else v" in finding.evidence["keep"]
    assert not [f for f in report.findings if f.check == "probe-dtype-error"]  # one finding, the specific one
    assert (
        not model._forward_pre_hooks and not model.model.encoder.conv1._forward_pre_hooks
    )  # probe left nothing

    fix = finding.fixes[0]
    fix.apply()
    fix.apply()  # idempotent: one hook
    assert len(model._forward_pre_hooks) == 1
    loss, moved = _step(model, batch, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert torch.isfinite(torch.tensor(loss)) and moved
    assert (
        batch["input_features"].dtype == torch.float32 and batch["labels"].dtype == torch.int64
    )  # batch untouched
    fix.undo()
    assert not model._forward_pre_hooks
    with pytest.raises(RuntimeError, match="should be the same"):
        model(**batch)


def test_the_dict_batch_cast_in_place_casts_only_floating_entries_and_undoes_exactly():
    model, batch = _whisper(), _features()
    labels = batch["labels"]
    report = mpdoctor.probe(model, batch)
    finding = next(f for f in report.findings if f.check == "batch-dtype-mismatch")
    cast = next(fx for fx in finding.fixes if fx.recipe == "cast-batch")
    cast.bind(report.live)
    original = batch["input_features"]
    cast.apply()
    assert batch["input_features"].dtype == torch.bfloat16 and batch["labels"] is labels
    loss, moved = _step(model, batch, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert torch.isfinite(torch.tensor(loss)) and moved
    cast.undo()
    assert batch["input_features"] is original


def test_fp32_inputs_embeds_into_a_bf16_llama_inside_watch_names_the_input_at_the_crash():
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"inputs_embeds": torch.randn(2, 5, 32), "labels": torch.randint(0, 100, (2, 5))}
    with pytest.raises(
        RuntimeError, match=r"expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"
    ):
        with mpdoctor.watch(model, opt) as w:
            model(**batch)
    cause = w.crash_report.cause
    assert cause.check == "batch-dtype-mismatch"
    assert (
        cause.evidence["inputs"] == {"inputs_embeds": "float32"}
        and cause.evidence["layer_dtype"] == "bfloat16"
    )
    assert cause.evidence["layer"].startswith("model.layers.0.")
    assert not model._forward_pre_hooks and not model._forward_hooks  # the watch left nothing
    fix = cause.fixes[0]
    fix.apply()
    loss, moved = _step(model, batch, opt)
    assert torch.isfinite(torch.tensor(loss)) and moved
    fix.undo()
    assert not model._forward_pre_hooks


def test_the_probe_of_a_probe_that_raises_leaves_no_hook_anywhere():
    model, batch = _whisper(), _features()
    mpdoctor.probe(model, batch)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_no_alarm_with_a_matching_batch_under_autocast_or_when_the_model_casts_itself():
    model = _whisper()
    batch = _features()
    matching = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in batch.items()}
    assert not [f for f in mpdoctor.probe(model, matching).findings if f.check == "batch-dtype-mismatch"]
    fp32 = _whisper().float()
    report = mpdoctor.probe(fp32, batch, autocast=torch.bfloat16)
    assert not [f for f in report.findings if f.check == "batch-dtype-mismatch"]
    clip = T.CLIPVisionModel(T.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=64)).to(torch.bfloat16)  # fmt: skip
    report = mpdoctor.probe(
        clip, {"pixel_values": torch.randn(2, 3, 32, 32)}
    )  # CLIP casts pixel_values itself
    assert report.facts.probes[0].error is None
    assert not [f for f in report.findings if f.check == "batch-dtype-mismatch"]


def test_a_plain_tensor_batch_is_named_input_and_the_hook_never_casts_ids_or_bool_masks():
    from mpdoctor.rules.engine.changes import cast_inputs_hook

    net = torch.nn.Sequential(torch.nn.Linear(4, 2)).to(torch.bfloat16)
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="same dtype"):
        net(x)
    report = mpdoctor.probe(net, x)
    finding = next(f for f in report.findings if f.check == "batch-dtype-mismatch")
    assert finding.evidence["inputs"] == {"input": "float32"} and finding.evidence["layer"] == "0"
    hook = cast_inputs_hook(torch.bfloat16)
    args, kwargs = hook(net, (x,), {"ids": torch.tensor([1, 2]), "mask": torch.tensor([True, False])})
    assert (
        args[0].dtype == torch.bfloat16
        and kwargs["ids"].dtype == torch.int64
        and kwargs["mask"].dtype == torch.bool
    )


def test_a_model_mixing_dtypes_is_not_blamed_on_the_batch_at_the_crash():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    x = torch.randn(2, 4)  # fp32, as the first layer wants: the bf16 second layer is the fault
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        with mpdoctor.watch(model) as w:
            model(x)
    assert w.crash_report.cause.check != "batch-dtype-mismatch"
    assert w.crash_report.findings_for("mixed-param-dtypes")


def test_the_ipython_crash_hook_names_the_batch_entry(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext mpdoctor", store_history=False)
    try:
        shell.user_ns["model"] = torch.nn.Sequential(torch.nn.Conv1d(8, 4, 3)).to(torch.bfloat16)
        shell.user_ns["batch"] = {"input_features": torch.randn(2, 8, 16)}
        result = shell.run_cell("model(batch['input_features'])", store_history=False)
        out = capsys.readouterr()
        text = out.out + out.err
        assert type(result.error_in_exec).__name__ == "RuntimeError"
        assert "batch-dtype-mismatch" in text and "`input_features` (float32)" in text and "model.0" in text
    finally:
        shell.run_cell("%unload_ext mpdoctor", store_history=False)
        shell.user_ns.pop("model", None)
        shell.user_ns.pop("batch", None)
