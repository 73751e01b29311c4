"""Each known mixed-precision exception, raised for real from real objects, is explained with its cause.

The messages are the libraries' own (torch 2.13, transformers, accelerate on
the CPU); two that only a GPU or DeepSpeed raise are matched on the verbatim
source string and say so.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mpdoctor.attach.crash import explain
from mpdoctor.attach.crash.patterns import PATTERNS, match_exception

pytestmark = pytest.mark.colab


def raised(fn) -> BaseException:
    """The exception ``fn`` raises (the test fails if it raises none)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except BaseException as exc:  # noqa: BLE001 - whatever the library raises is what we match
        return exc
    raise AssertionError(f"{fn.__name__} raised nothing")


def mixed_mlp_forward():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    model(torch.randn(2, 4))


def bf16_linear_fed_fp32():
    layer = torch.nn.Linear(4, 4).to(torch.bfloat16)
    layer(torch.randn(2, 4))


def matmul_two_dtypes():
    torch.randn(2, 4) @ torch.randn(4, 4, dtype=torch.bfloat16)


def bmm_two_dtypes():
    torch.bmm(torch.randn(1, 2, 4), torch.randn(1, 4, 4, dtype=torch.bfloat16))


def addmm_bf16_bias():
    torch.addmm(torch.randn(4, dtype=torch.bfloat16), torch.randn(2, 4), torch.randn(4, 4))


def bf16_conv_fed_fp32():
    conv = torch.nn.Conv2d(3, 4, 3).to(torch.bfloat16)
    conv(torch.randn(1, 3, 8, 8))


def bf16_layernorm_fed_fp32():
    norm = torch.nn.LayerNorm(4).to(torch.bfloat16)
    norm(torch.randn(2, 4))


def bf16_lstm_fed_fp32():
    lstm = torch.nn.LSTM(4, 4).to(torch.bfloat16)
    lstm(torch.randn(2, 1, 4))


def sdpa_two_dtypes():
    q = torch.randn(1, 1, 2, 4)
    k = torch.randn(1, 1, 2, 4, dtype=torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(q, k, k)


def grad_in_other_dtype():
    model = torch.nn.Linear(4, 4)
    model.weight.grad = torch.zeros(4, 4, dtype=torch.bfloat16)


def scaler_with_fp16_params():
    model = torch.nn.Linear(4, 4).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 4).half()).float().sum()).backward()
    scaler.step(optimizer)


def bf16_optimizer_on_fp32():
    from adamw_bf16 import AdamWBF16

    model = torch.nn.Linear(4, 4)
    optimizer = AdamWBF16(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()


class HybridCache:
    """The shape of transformers < 4.51's cache: a ``.dtype`` attribute and no ``.float()``.

    A stand-in, not a mock of an installed class: the transformers pinned in both venvs (5.23) has no
    ``HybridCache`` (``transformers.cache_utils`` holds ``Cache``, ``DynamicCache``, ``StaticCache``,
    ``QuantizedCache``, ``EncoderDecoderCache``, ...), and none of those classes defines ``dtype``, so no
    installed class reaches accelerate's ``.float()`` call: the crash exists only with transformers < 4.51.
    """

    dtype = torch.bfloat16


def cache_through_accelerate_fp32_conversion():
    from accelerate.utils import convert_outputs_to_fp32
    from setups import tiny_llama

    model = tiny_llama(torch.bfloat16, train=True, use_cache=True)
    forward = convert_outputs_to_fp32(lambda: {"logits": torch.ones(1, dtype=torch.bfloat16), "past_key_values": HybridCache()})
    model.train()
    forward()


def anomaly_nan_in_backward():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    with torch.autograd.detect_anomaly():
        model(torch.ones(2, 4)).sum().backward()


def sampling_from_an_fp16_overflow():
    """Layer 1's up_proj passes 65504 in fp16 (one row of 40000): the logits are NaN, and sampling refuses them."""
    from setups import tiny_llama

    model = tiny_llama(torch.float16, train=False)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0] = 40000.0
    model.generate(torch.tensor([[3, 14, 15, 9]]), max_new_tokens=2, do_sample=True, pad_token_id=0)


def sampling_from_nan_weights():
    from setups import tiny_llama

    model = tiny_llama(torch.float32, train=False)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    model.generate(torch.tensor([[3, 14, 15, 9]]), max_new_tokens=2, do_sample=True, pad_token_id=0)


def fsdp_flattens_two_dtypes():
    import torch.distributed as dist
    from torch.distributed.fsdp._flat_param import FlatParamHandle, HandleShardingStrategy

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # What FullyShardedDataParallel(model) builds for each unit (FSDP itself needs an accelerator).
        FlatParamHandle(list(model.parameters()), model, torch.device("cpu"), HandleShardingStrategy.FULL_SHARD,
                        False, None, None, False, dist.group.WORLD, False)  # fmt: skip
    finally:
        dist.destroy_process_group()


def training_args_bf16_without_gpu():
    from transformers import TrainingArguments

    TrainingArguments(output_dir="/tmp/mpdoctor-test", bf16=True, report_to=[])


def training_args_fp16_and_bf16():
    from transformers import TrainingArguments

    TrainingArguments(output_dir="/tmp/mpdoctor-test", bf16=True, fp16=True, use_cpu=True, report_to=[])


# (raiser, pattern slug, the finding marked as the cause)
REAL_FAILURES = [
    (mixed_mlp_forward, "crash-matmul-dtype", "mixed-param-dtypes"),
    (bf16_linear_fed_fp32, "crash-matmul-dtype", "crash-matmul-dtype"),
    (matmul_two_dtypes, "crash-matmul-dtype", "crash-matmul-dtype"),
    (bmm_two_dtypes, "crash-scalar-type-dtype", "crash-scalar-type-dtype"),  # bmm raises the generic ScalarType check
    (addmm_bf16_bias, "crash-matmul-dtype", "crash-matmul-dtype"),
    (bf16_conv_fed_fp32, "crash-conv-dtype", "crash-conv-dtype"),
    (bf16_layernorm_fed_fp32, "crash-norm-dtype", "crash-norm-dtype"),
    (bf16_lstm_fed_fp32, "crash-rnn-dtype", "crash-rnn-dtype"),
    (sdpa_two_dtypes, "crash-attention-dtype", "crash-attention-dtype"),
    (grad_in_other_dtype, "crash-grad-dtype", "crash-grad-dtype"),
    (scaler_with_fp16_params, "crash-unscale-fp16", "fp16-trainable-params-with-scaler"),
    (bf16_optimizer_on_fp32, "crash-bf16-only-optimizer", "optimizer-dtype-requirement"),
    (cache_through_accelerate_fp32_conversion, "crash-cache-float", "cache-in-training"),
    (anomaly_nan_in_backward, "crash-anomaly-nonfinite", "nonfinite-values"),
    # No check sees an overflow in flight at rest: the note (what to probe) is the cause; NaN weights are scanned.
    (sampling_from_an_fp16_overflow, "crash-sampling-nonfinite", "crash-sampling-nonfinite"),
    (sampling_from_nan_weights, "crash-sampling-nonfinite", "nonfinite-values"),
    (fsdp_flattens_two_dtypes, "crash-fsdp-uniform-dtype", "mixed-param-dtypes"),
    (training_args_bf16_without_gpu, "crash-bf16-unsupported", "crash-bf16-unsupported"),
    (training_args_fp16_and_bf16, "crash-fp16-and-bf16", "crash-fp16-and-bf16"),
]


@pytest.mark.parametrize(("raise_it", "slug", "cause"), REAL_FAILURES, ids=[f[0].__name__ for f in REAL_FAILURES])
def test_a_real_mixed_precision_failure_is_explained_with_its_cause_first(raise_it, slug, cause):
    if raise_it is training_args_bf16_without_gpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        # On a bf16 GPU transformers accepts the arguments: nothing to explain, and that is asserted, not skipped
        # (the refusal itself is proven wherever the suite runs without such a GPU, as CI does).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raise_it()
        return
    exc = raised(raise_it)
    pattern, _ = match_exception(exc)
    assert pattern.slug == slug
    report = explain(exc)
    assert report.cause is report.findings[0]
    assert report.cause.check == cause
    assert report.exception.startswith(type(exc).__name__ + ": ")
    text = report.to_text()
    assert f">> cause of {type(exc).__name__}:" in text
    assert text.index(">> cause of") < text.index(cause)


def test_every_pattern_is_proven_by_a_real_failure_or_says_why_not():
    from mpdoctor.attach.crash.catalogue import family

    proven = {slug for _, slug, _ in REAL_FAILURES}
    # The catalogue's families are proven one by one in tests/test_exception_families.py.
    # Raised only on CUDA (the unscale kernel) and by DeepSpeed (not installed): see the tests below.
    # The DeepSpeed config patterns are raised for real in tests/stack/test_deepspeed_configs.py (.venv only).
    assert {p.slug for p in PATTERNS if family(p.slug) is None} - proven == {
        "crash-deepspeed-loss-scale",
        "crash-deepspeed-config-mismatch",
        "crash-deepspeed-precision-unsupported",
    }


def test_the_cuda_bf16_unscale_and_deepspeed_messages_match_their_verbatim_source_strings():
    # torch's CUDA kernel (pytorch #127176) and DeepSpeed's loss_scaler.py, quoted: no CUDA or DeepSpeed here.
    cuda = RuntimeError('"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for \'BFloat16\'')
    deepspeed = Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
    assert match_exception(cuda)[0].slug == "crash-scaler-bf16"
    assert match_exception(deepspeed)[0].slug == "crash-deepspeed-loss-scale"


def test_the_cause_note_names_the_dtypes_in_the_failing_frames():
    report = explain(raised(bf16_linear_fed_fp32))
    # The two tensors of the failing op: the activation (the op's local name: it has none in the user's code)
    # and the parameter, named by its module path in the user's function.
    assert "input (fp32, [2, 4]) met layer.weight (bf16, parameter of layer (Linear))" in report.cause.message
    assert "autocast" in report.cause.message


def test_the_objects_of_the_failing_function_are_inspected_under_their_local_names():
    report = explain(raised(scaler_with_fp16_params))
    assert {s.name for s in report.subjects} == {"model", "optimizer", "scaler"}


def test_unrelated_exceptions_are_not_explained():
    class Box:
        pass

    assert explain(raised(lambda: 1 / 0)) is None
    assert explain(raised(lambda: Box().float())) is None  # no attribute 'float', but no cache involved
    assert explain(raised(lambda: torch.ones(2) + torch.ones(3))) is None


def test_an_exception_is_matched_without_running_its_own_str():
    class Hostile(RuntimeError):
        def __str__(self):
            raise AssertionError("mpdoctor called __str__")

    assert match_exception(Hostile("mat1 and mat2 must have the same dtype")) is None  # not builtins.RuntimeError
    assert match_exception(RuntimeError(object())) is None


def test_a_known_failure_wrapped_by_another_exception_is_still_explained():
    def wrapped():
        try:
            bf16_layernorm_fed_fp32()
        except RuntimeError as exc:
            raise KeyError("step failed") from exc

    report = explain(raised(wrapped))
    assert report.cause.check == "crash-norm-dtype"
    assert report.exception.startswith("RuntimeError: mixed dtype")


def test_html_and_widget_show_the_cause_heading_first():
    report = explain(raised(mixed_mlp_forward))
    import re

    def text(html: str) -> str:  # the words a reader sees: the "cause of" pill and the exception beside it
        return " ".join(re.sub(r"<[^>]+>", " ", html).split())

    html = text(report.to_html())
    assert "cause of RuntimeError: mat1 and mat2 must have the same dtype" in html
    assert html.index("cause of RuntimeError") < html.index("mixed-param-dtypes")
    widget = report.widget()
    assert any("cause of RuntimeError" in text(value) for value in widget.html_values())
