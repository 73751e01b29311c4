"""Whole-chain fixes: a fix covers every entry point the user calls and the inputs its casts meet.

Each failure is reproduced first on real objects (the fix as it was offered before, and the user's next call
raising again), then the fix mpdoctor offers now is applied in place and the user's own call runs and trains.
The planner's simulation is held to the real call: what it predicts after a plan is what the call does.
"""

from __future__ import annotations

import pytest
import torch
from setups import tiny_llama
from steps import assert_step_trains, snapshot

import mpdoctor
from mpdoctor.attach.crash import explain
from mpdoctor.attach.crash.frames import entry_points, traceback_frames
from mpdoctor.objects.edits.steps import MethodInputCast
from mpdoctor.rules.checks import run_checks
from mpdoctor.rules.engine.changes import CAST_INPUTS_MARKER, CastInputsHook, CastParamsTo, cast_arguments
from mpdoctor.rules.engine.plan import plan, score


def raised(call) -> BaseException:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the error torch raises is the subject of the test
        return exc
    raise AssertionError("the call raised nothing")


def dtype_errors(findings) -> list[str]:
    return [f.check for f in findings if f.severity == "error" and f.check in ("batch-dtype-mismatch", "probe-dtype-error")]


class Codec(torch.nn.Module):
    """A user's autoencoder: called through ``encode`` and ``decode``, never through ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.down = torch.nn.Linear(8, 4)
        self.up = torch.nn.Linear(4, 8)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.up(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))


def half_codec() -> Codec:
    torch.manual_seed(0)
    return Codec().to(torch.bfloat16)


def decode_crash(codec: Codec, z: torch.Tensor):
    exc = raised(lambda: codec.decode(z))
    return exc, explain(exc, namespace={"codec": codec, "z": z})


# -- entry points: the call the user made, read from the traceback --------------------------------------------


def test_the_entry_point_is_the_outermost_method_of_the_model_on_the_failing_stack():
    codec, z = half_codec(), torch.randn(2, 4)
    exc = raised(lambda: codec.decode(z))
    assert entry_points(traceback_frames(exc.__traceback__), codec) == (("", "decode"),)
    exc = raised(lambda: codec(torch.randn(2, 8)))
    assert entry_points(traceback_frames(exc.__traceback__), codec) == (("", "forward"),)
    exc = raised(lambda: codec.up(z))  # a submodule called directly
    assert entry_points(traceback_frames(exc.__traceback__), codec) == (("up", "forward"),)


def test_a_forward_hook_alone_never_runs_for_decode_which_is_why_the_fix_covers_decode():
    codec, z = half_codec(), torch.randn(2, 4)
    exc, report = decode_crash(codec, z)
    assert str(exc).startswith("mat1 and mat2 must have the same dtype")
    # A forward pre-hook alone (what was offered before) leaves the user's call failing: decode never runs it.
    handle = codec.register_forward_pre_hook(lambda module, args: tuple(a.to(torch.bfloat16) for a in args))
    assert str(raised(lambda: codec.decode(z))).startswith("mat1 and mat2 must have the same dtype")
    handle.remove()
    # The input cast covers the model's own entry methods even when no traceback named them.
    own_entries = CastInputsHook(report.live.add(codec), "bfloat16", "codec")
    steps = own_entries.bind(report.live)
    for s in steps:
        s.apply()
    assert codec.decode(z).dtype == torch.bfloat16
    for s in reversed(steps):
        s.revert()
    assert str(raised(lambda: codec.decode(z))).startswith("mat1 and mat2 must have the same dtype")

    cause = report.cause
    assert cause.check == "batch-dtype-mismatch"
    fix = cause.fixes[0]
    assert fix.title.startswith("Cast codec's floating inputs to bfloat16 at codec.decode and its forward")
    assert fix.changes[0].entries == (("", "decode"),)
    fix.apply()
    params = list(codec.parameters())
    before = snapshot(params)
    opt = torch.optim.SGD(params, lr=0.1)
    loss = codec.decode(z).float().square().mean()  # the user's own failing call
    loss.backward()
    opt.step()
    assert_step_trains(loss, before, params)


def test_undoing_the_entry_point_cast_restores_the_instance_exactly():
    codec, z = half_codec(), torch.randn(2, 4)
    _exc, report = decode_crash(codec, z)
    own_before, hooks_before = dict(vars(codec)), dict(codec._forward_pre_hooks)
    fix = report.cause.fixes[0]
    fix.apply()
    assert "decode" in vars(codec) and len(codec._forward_pre_hooks) == len(hooks_before) + 1
    fix.apply()  # idempotent: no second wrapper
    assert MethodInputCast.registered(codec, "decode", CAST_INPUTS_MARKER)
    fix.undo()
    assert "decode" not in vars(codec)
    assert dict(codec._forward_pre_hooks) == hooks_before
    assert vars(codec).keys() == own_before.keys()
    assert str(raised(lambda: codec.decode(z))).startswith("mat1 and mat2 must have the same dtype")


def test_a_user_wrapper_already_on_the_instance_comes_back_after_undo():
    codec = half_codec()
    calls = []
    original = codec.decode

    def traced(z):
        calls.append(z.dtype)
        return original(z)

    codec.decode = traced
    step = MethodInputCast(codec, "decode", cast_arguments(torch.bfloat16), CAST_INPUTS_MARKER, "codec.decode")
    step.apply()
    codec.decode(torch.randn(2, 4))
    assert calls == [torch.bfloat16], "the cast runs before the user's own wrapper"
    step.revert()
    assert vars(codec)["decode"] is traced


def test_the_widget_button_applies_the_entry_point_cast_and_the_users_call_trains():
    codec, z = half_codec(), torch.randn(2, 4)
    _exc, report = decode_crash(codec, z)
    rw = report.widget()
    rw.confirm_delay = 0.0
    buttons = rw.buttons("Cast codec's floating inputs")
    assert len(buttons) == 1
    buttons[0].click()
    assert MethodInputCast.registered(codec, "decode", CAST_INPUTS_MARKER)
    params = list(codec.parameters())
    before = snapshot(params)
    loss = codec.decode(z).float().square().mean()
    loss.backward()
    torch.optim.SGD(params, lr=0.1).step()
    assert_step_trains(loss, before, params)


def test_generate_gets_the_input_cast_a_forward_hook_cannot_give_it():
    model = tiny_llama(torch.bfloat16, train=False)
    embeds = torch.randn(1, 5, model.config.hidden_size)  # fp32 embeddings built by the user

    def call():
        return model.generate(inputs_embeds=embeds, max_new_tokens=2, do_sample=False)

    exc = raised(call)
    assert "same dtype" in str(exc)
    report = explain(exc, namespace={"model": model, "embeds": embeds})
    fix = report.cause.fixes[0]
    assert fix.changes[0].entries == (("", "generate"),)
    assert "at model.generate and its forward" in fix.title
    fix.apply()
    assert call().shape == (1, 2)
    # the user's training step through the same embeddings trains with the fix in place
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    before = snapshot(params)
    loss = model(inputs_embeds=embeds, labels=torch.zeros(1, 5, dtype=torch.long)).loss
    loss.backward()
    torch.optim.SGD(params, lr=0.1).step()
    assert_step_trains(loss, before, params)
    fix.undo()
    assert "generate" not in vars(model)
    assert "same dtype" in str(raised(call))


# -- the planner: a model cast leaves its inputs' dtype -----------------------------------------------------


def mostly_half() -> torch.nn.Sequential:
    """A model loaded in fp16 whose first layer was left in fp32; the user's batch is fp32."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 256), torch.nn.Linear(256, 4))
    model[2].half()
    model[3].half()
    return model


def planned(report):
    findings = run_checks(report.facts)
    chosen = plan(report.facts, findings, run_checks)
    for fx in chosen:
        fx.bind(report.live)
    return findings, chosen


def simulated(report, chosen):
    facts = report.facts
    for fx in chosen:
        for spec in fx.changes:
            facts = spec.simulate(facts)
    return run_checks(facts)


def test_a_cast_that_leaves_the_inputs_behind_is_predicted_to_raise_and_the_plan_casts_the_inputs_too():
    model, x = mostly_half(), torch.randn(4, 8)
    report = mpdoctor.probe(model, x)
    cast = next(fx for f in report.findings if f.check == "mixed-param-dtypes" for fx in f.fixes)
    # The cast alone (what the plan held before): the simulation now sees the next dtype error coming ...
    alone = run_checks(next(s for s in cast.changes).simulate(report.facts))
    assert "batch-dtype-mismatch" in dtype_errors(alone)
    # ... and the real call agrees.
    steps = cast.changes[0].bind(report.live)
    for s in steps:
        s.apply()
    assert "same dtype" in str(raised(lambda: model(x)))
    for s in reversed(steps):
        s.revert()

    _findings, chosen = planned(report)
    assert len(chosen) == 1
    fix = chosen[0]
    assert [type(c) for c in fix.changes] == [CastParamsTo, CastInputsHook]
    assert fix.title.endswith("and cast the floating inputs it meets to float16")
    assert score(simulated(report, chosen))[0] == 0
    fix.apply()
    params = list(model.parameters())
    before = snapshot(params)
    loss = model(x).float().square().mean()
    loss.backward()
    torch.optim.SGD(params, lr=0.1).step()
    assert_step_trains(loss, before, params)


class Scaled(torch.nn.Module):
    """A bf16 projection scaled by a buffer, then a bf16 head (huggingface/transformers#30709: loading with
    ``torch_dtype=torch.bfloat16`` casts the parameters and leaves the buffers fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x) * self.scale)


def scaled() -> Scaled:
    """Loaded as ``from_pretrained(torch_dtype=torch.bfloat16)`` did in the report: parameters only."""
    torch.manual_seed(0)
    model = Scaled()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def bf16_linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(torch.bfloat16)


SETUPS = {
    "a bf16 model fed fp16 inputs": (bf16_linear, lambda: torch.randn(4, 8).half()),
    "an fp32 user tensor meeting a module cast to fp16": (mostly_half, lambda: torch.randn(4, 8)),
    "a bf16 model fed fp32 inputs": (bf16_linear, lambda: torch.randn(4, 8)),
    "an fp16 model fed fp32 inputs": (lambda: bf16_linear().half(), lambda: torch.randn(4, 8)),
    "a buffer left fp32 beside bf16 weights": (scaled, lambda: torch.randn(4, 8).to(torch.bfloat16)),
}


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_the_plans_simulated_outcome_agrees_with_the_real_call_after_applying_it(name):
    make_model, make_input = SETUPS[name]
    model, x = make_model(), make_input()
    assert "dtype" in str(raised(lambda: model(x))), "the setup must fail before any fix"
    report = mpdoctor.probe(model, x)
    _findings, chosen = planned(report)
    predicted_clean = not dtype_errors(simulated(report, chosen))
    for fx in chosen:
        fx.apply()
    try:
        model(x)
        really_clean = True
    except RuntimeError as exc:
        really_clean = "dtype" not in str(exc) and "type" not in str(exc)
    assert predicted_clean == really_clean, f"{name}: the plan {[fx.title for fx in chosen]} predicted " \
                                            f"{'no' if predicted_clean else 'a'} dtype error"
    if really_clean:
        params = [p for p in model.parameters() if p.requires_grad]
        before = snapshot(params)
        loss = model(x).float().square().mean()
        loss.backward()
        torch.optim.SGD(params, lr=0.1).step()
        assert_step_trains(loss, before, params)


# -- both operands: the odd operand's other owner ---------------------------------------------------------------


def test_the_failing_ops_operands_are_the_ones_its_own_frame_holds():
    model, x = scaled(), torch.randn(4, 8).to(torch.bfloat16)
    report = explain(raised(lambda: model(x)), namespace={"model": model, "x": x})
    # Not the user's x (bf16, read on the outer line): the head's input and the head's weight met.
    assert report.cause.evidence["operands"] == (
        "In Linear.forward: input (fp32, [4, 8]) met model.head.weight (bf16, parameter of model.head (Linear))."
    )


@pytest.mark.parametrize("via", ["api", "widget"])
def test_a_buffer_left_fp32_beside_bf16_weights_is_cast_where_it_is_held_and_the_users_call_trains(via):
    model, x = scaled(), torch.randn(4, 8).to(torch.bfloat16)
    exc = raised(lambda: model(x))
    assert str(exc) == "mat1 and mat2 must have the same dtype, but got Float and BFloat16"
    report = explain(exc, namespace={"model": model, "x": x})
    assert report.cause.check == "crash-matmul-dtype"
    # Casting the op's input alone (the display-only advice) leaves the buffer feeding the next call in fp32.
    fix = report.cause.fixes[0]
    assert fix.title.startswith("Cast model.scale to bf16")
    old_scale = model.scale
    if via == "api":
        fix.apply(confirm=True)
    else:
        rw = report.widget()
        rw.confirm_delay = 0.0
        button = rw.buttons("Cast model.scale")[0]
        button.click()
        button.click()  # an unsafe fix asks for a confirming second click
    assert model.scale.dtype == torch.bfloat16 and "scale" in model._buffers
    params = list(model.parameters())
    before = snapshot(params)
    loss = model(x).float().square().mean()  # the user's own failing call
    loss.backward()
    torch.optim.SGD(params, lr=0.1).step()
    assert_step_trains(loss, before, params)
    fix.undo()
    assert model._buffers["scale"] is old_scale


def test_the_held_tensor_is_not_blamed_when_the_module_mixes_its_own_weights():
    model, x = scaled(), torch.randn(4, 8).to(torch.bfloat16)
    model.head.float()  # the head itself is fp32 now: the buffer is no longer the odd one out
    model.proj.float()
    model.head.bfloat16()
    exc = raised(lambda: model(x))
    report = explain(exc, namespace={"model": model, "x": x})
    assert not [fx for fx in report.cause.fixes if fx.recipe == "cast-held-tensors"]


def test_healthy_twin_the_whole_model_cast_buffers_included_draws_nothing():
    torch.manual_seed(0)
    model, x = Scaled().to(torch.bfloat16), torch.randn(4, 8).to(torch.bfloat16)
    params = list(model.parameters())
    before = snapshot(params)
    loss = model(x).float().square().mean()
    loss.backward()
    torch.optim.SGD(params, lr=0.1).step()
    assert_step_trains(loss, before, params)
    report = mpdoctor.diagnose(namespace={"model": model, "x": x})
    assert not [(f.check, f.severity) for f in report.findings if f.severity in ("error", "warning")]


# -- an encoder-decoder: the encoder called alone, and generate ---------------------------------------------------


def tiny_bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_position_embeddings=32)  # fmt: skip
    return BartForConditionalGeneration(config).to(torch.bfloat16)


@pytest.mark.parametrize("entry", ["encoder", "generate"])
def test_an_encoder_decoder_gets_the_input_cast_where_it_was_called(entry):
    model, embeds = tiny_bart(), torch.randn(1, 5, 16)  # fp32 embeddings into a bf16 BART
    calls = {
        "encoder": lambda: model.get_encoder()(inputs_embeds=embeds).last_hidden_state,
        "generate": lambda: model.generate(inputs_embeds=embeds, max_new_tokens=2, do_sample=False),
    }
    exc = raised(calls[entry])
    assert "mixed dtype" in str(exc)
    report = explain(exc, namespace={"model": model, "embeds": embeds})
    fix = report.cause.fixes[0]
    assert fix.changes[0].entries == ((("model.encoder", "forward"),) if entry == "encoder" else (("", "generate"),))
    fix.apply()
    calls[entry]()  # the user's own failing call runs
    params = [p for p in model.parameters() if p.requires_grad]
    before = snapshot(params)
    if entry == "encoder":
        loss = calls["encoder"]().float().square().mean()
    else:
        loss = model(inputs_embeds=embeds, labels=torch.tensor([[3, 4, 5]])).loss
    loss.backward()
    torch.optim.SGD(params, lr=0.1).step()
    assert_step_trains(loss, before, params)


def test_the_input_cast_keeps_a_model_outputs_class():
    from transformers.modeling_outputs import BaseModelOutput

    from mpdoctor.rules.engine.changes import cast_floating

    out = BaseModelOutput(last_hidden_state=torch.randn(1, 2, 4))
    cast = cast_floating({"encoder_outputs": out}, torch.bfloat16)["encoder_outputs"]
    assert type(cast) is BaseModelOutput and cast[0].dtype == torch.bfloat16
    assert out.last_hidden_state.dtype == torch.float32, "the caller's object is not changed"


# -- the loop: watch() explains the crash of the call the loop makes -------------------------------------------------


def test_a_watched_loop_that_calls_decode_gets_the_cast_at_decode_and_the_loop_then_trains():
    codec = half_codec()
    optimizer = torch.optim.SGD(codec.parameters(), lr=0.1)
    latents = [torch.randn(2, 4) for _ in range(2)]  # the loader yields fp32 latents

    def loop():
        for z in latents:
            optimizer.zero_grad()
            loss = codec.decode(z).float().square().mean()
            loss.backward()
            optimizer.step()
        return loss

    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        with mpdoctor.watch(codec, optimizer, verbose=False) as w:
            loop()
    fix = w.crash_report.cause.fixes[0]
    assert fix.changes[0].entries == (("", "decode"),)
    fix.apply()
    params = list(codec.parameters())
    before = snapshot(params)
    assert_step_trains(loop(), before, params)
