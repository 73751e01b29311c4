"""Field cases of the mixed-precision exception families: each real report rebuilt on this CPU.

Each test raises the reported error from real objects first, then reads mpdoctor's diagnosis of it (the
family, the two tensors named with their dtypes, the cast or the rule with the loop line), then applies that
cast (or the corrected loop) and runs a forward and a training step that work: finite loss and parameters
that changed. Rows: ``docs/field-cases/exceptions.md``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from mpdoctor.attach.crash import explain
from mpdoctor.attach.runtime.loop_findings import in_the_users_loop
from mpdoctor.attach.runtime.twins import TRIAL_STEPS, try_on_twins
from mpdoctor.objects.readers.loop_source import source_of


def raised(fn, *args) -> BaseException:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(*args)
    except BaseException as exc:  # noqa: BLE001 - whatever torch raises is what the report describes
        return exc
    raise AssertionError(f"{fn.__name__} raised nothing")


def trains(model: torch.nn.Module, loss_of) -> bool:
    """One SGD step: the loss is finite and every trainable parameter changed."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    loss = loss_of()
    loss.backward()
    opt.step()
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    return bool(torch.isfinite(loss)) and all(not torch.equal(a, b) for a, b in zip(before, after))


# -- continue-revolution/sd-webui-animatediff#168: index_put, fp16 values into an fp32 buffer -------------------


class Router(torch.nn.Module):
    """Scores written by index into a buffer made in fp32, from a projection that autocast runs in fp16."""

    def __init__(self, cast_values: bool = False) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 1)
        self.cast_values = cast_values

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        scores = torch.zeros(x.shape[0])
        if self.cast_values:  # the cast mpdoctor gives
            scores[rows] = (self.proj(x[rows]).squeeze(-1)).to(scores.dtype)
        else:
            scores[rows] = self.proj(x[rows]).squeeze(-1)
        return scores


def test_index_put_of_autocast_fp16_values_into_an_fp32_buffer():
    x, rows = torch.randn(4, 4), torch.tensor([0, 2])

    def forward(model):
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x, rows)

    exc = raised(forward, Router())
    assert str(exc).startswith("Index put requires the source and destination dtypes match, got Float for the "
                               "destination and Half for the source.")  # fmt: skip
    cause = explain(exc).cause
    assert cause.check == "crash-index-put-dtype"
    assert cause.evidence["operands"] == (
        "In Router.forward: self.proj(x[rows]).squeeze(-1) (fp16) met scores (fp32, [4])."
    )
    assert cause.evidence["cast"] == "scores[rows] = (self.proj(x[rows]).squeeze(-1)).to(scores.dtype)"
    fixed = Router(cast_values=True)
    assert trains(fixed, lambda: forward(fixed).square().sum())


# -- Comfy-Org/ComfyUI#4474, logtd/ComfyUI-LTXTricks#25: fp8 storage meets fp32 / bf16 math --------------------


class Guided(torch.nn.Module):
    """A guide tensor kept in float8 storage (``--fp8_e4m3fn-unet``) added outside the layer that upcasts."""

    def __init__(self, upcast: bool = False) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("guide", torch.randn(4).to(torch.float8_e4m3fn))
        self.upcast = upcast

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        guide = self.guide
        hidden = self.proj(latent)
        if self.upcast:  # the cast mpdoctor gives
            guide = guide.to(torch.float32)
        return hidden + guide


def test_fp8_stored_tensor_promoted_with_fp32_activations():
    latent = torch.randn(2, 4)
    exc = raised(Guided(), latent)
    assert str(exc) == "Promotion for Float8 Types is not supported, attempted to promote Float and Float8_e4m3fn"
    cause = explain(exc).cause
    assert cause.check == "crash-fp8-promotion"
    assert cause.evidence["operands"] == "In Guided.forward: guide (float8_e4m3fn, [4]) met hidden (fp32, [2, 4])."
    assert cause.evidence["cast"].startswith("guide = guide.to(torch.float32)")
    fixed = Guided(upcast=True)
    assert trains(fixed, lambda: fixed(latent).square().sum())


# -- seal-rg/recurrent-pretraining#23: the tokenizer's int64 attention_mask passed to SDPA ---------------------


class TinyAttention(torch.nn.Module):
    def __init__(self, bool_mask: bool = False) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(4, 12)
        self.bool_mask = bool_mask

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(hidden).chunk(3, dim=-1)
        if self.bool_mask:  # the cast mpdoctor gives
            attention_mask = attention_mask.bool()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)


def test_sdpa_with_the_tokenizers_int64_attention_mask():
    hidden = torch.randn(1, 3, 4)
    attention_mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]])  # 1 = attend, as tokenizers return it
    exc = raised(TinyAttention(), hidden, attention_mask)
    assert str(exc).startswith("Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                               "attn_mask.dtype: long int and  query.dtype: float instead.")  # fmt: skip
    cause = explain(exc).cause
    assert cause.check == "crash-attention-mask-dtype"
    assert cause.evidence["operands"].startswith("In TinyAttention.forward: attention_mask (int64, [3, 3]) met q (fp32")
    assert cause.evidence["cast"].startswith("attention_mask = attention_mask.bool()")
    fixed = TinyAttention(bool_mask=True)
    assert trains(fixed, lambda: fixed(hidden, attention_mask).square().sum())


# -- flairNLP/flair PR #3651: scatter_add of a mask cast to float32 into bf16 embeddings ------------------------


class Pooler(torch.nn.Module):
    """Token embeddings pooled per sentence with scatter_add; the token weights were made with ``mask.float()``."""

    def __init__(self, cast_weights: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4).to(torch.bfloat16)
        self.cast_weights = cast_weights

    def forward(self, ids: torch.Tensor, sentence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(ids)
        counts = torch.zeros(2, dtype=tokens.dtype)
        weights = mask.float()
        if self.cast_weights:  # the cast mpdoctor gives
            weights = weights.to(counts.dtype)
        counts.scatter_add_(0, sentence, weights)
        return tokens.sum(-1) / counts[sentence]


def test_scatter_add_of_a_float32_mask_into_bf16_counts():
    ids, sentence, mask = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 0, 1, 1]), torch.tensor([1, 1, 1, 0])
    exc = raised(Pooler(), ids, sentence, mask)
    assert str(exc) == "scatter(): Expected self.dtype to be equal to src.dtype"
    cause = explain(exc).cause
    assert cause.check == "crash-scatter-dtype"
    assert cause.evidence["operands"] == "In Pooler.forward: weights (fp32, [4]) met counts (bf16, [2])."
    assert cause.evidence["cast"] == "weights = weights.to(counts.dtype)"
    fixed = Pooler(cast_weights=True)
    assert trains(fixed, lambda: fixed(ids, sentence, mask).float().square().sum())


# -- microsoft/Swin-Transformer#311: AMP + gradient accumulation, unscale_ on every micro-batch -----------------


def accumulate(model, optimizer, scaler, batches, accumulation_steps):
    for i, batch in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(batch).square().mean() / accumulation_steps
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if (i + 1) % accumulation_steps == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return loss


def accumulation_objects() -> dict:
    """The objects the loop runs on, as they are before it: a model, SGD, a CPU GradScaler, 8 micro-batches."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return {"torch": torch, "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "scaler": torch.amp.GradScaler("cpu"), "batches": torch.randn(8, 2, 4), "accumulation_steps": 2}  # fmt: skip


def test_unscale_on_every_micro_batch_under_gradient_accumulation():
    ns = accumulation_objects()
    exc = raised(accumulate, *(ns[k] for k in ("model", "optimizer", "scaler", "batches", "accumulation_steps")))
    assert str(exc) == "unscale_() has already been called on this optimizer since the last update()."
    cause = explain(exc).cause
    assert cause.check == "amp-unscale-twice"
    assert re.fullmatch(r".*test_exception_cases\.py:\d+: scaler\.unscale_\(optimizer\)", cause.evidence["loop line"])
    assert "unscale_(optimizer) at most once per real step" in cause.evidence["rule"]
    # The corrected loop the crash hook and %mpdoctor show: the user's own loop (read from the code that ran), with
    # unscale_ and the clip under the accumulation guard; not the rule's template (which names max_norm).
    (mine,) = in_the_users_loop([cause], [source_of(__file__, Path(__file__).read_text(encoding="utf-8"))])
    code = mine.fixes[0].code
    assert code.startswith("for i, batch in enumerate(batches):") and "max_norm" not in code
    assert "if (i + 1) % accumulation_steps == 0:\n        scaler.unscale_(optimizer)" in code
    # Run on copies of the objects as they were before the loop, as %mpdoctor does before showing it ...
    ns = accumulation_objects()
    before = ns["model"].weight.detach().clone()
    trial = try_on_twins(code, ns)
    assert torch.equal(before, ns["model"].weight) and ns["model"].weight.grad is None
    assert ns["scaler"].get_scale() == 65536.0
    assert trial.trains and trial.steps == TRIAL_STEPS, trial.sentence()
    # ... then for real: it trains.
    exec(compile(code, "corrected.py", "exec"), ns)  # noqa: S102 - the corrected loop, run for real
    assert torch.isfinite(ns["loss"]) and not torch.equal(before, ns["model"].weight)


# -- Comfy-Org/ComfyUI#4474: a float8 buffer read on the forward's line meets fp32 activations ------------------


class Positional(torch.nn.Module):
    """A temporal block whose positional table is a buffer sliced on the failing line, never a local."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(1, 6, 8) * 0.1)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.table[:, : x.size(1)]
        return self.proj(x)


def test_a_float8_buffer_read_on_the_failing_line_is_upcast_in_place_with_its_twins_and_trains():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Positional(), Positional())
    for block in model:
        block.table = block.table.to(torch.float8_e5m2)  # stored with the model's fp8 weights
    x = torch.randn(2, 4, 8)
    exc = raised(model, x)
    assert "attempted to promote Float and Float8_e5m2" in str(exc)
    report = explain(exc, exc.__traceback__, namespace={"model": model, "x": x})
    assert report.cause.check == "crash-fp8-promotion"
    assert "model.0.table (float8_e5m2, [1, 6, 8], held by model.0 (Positional))" in report.cause.evidence["operands"]
    fix = report.cause.fixes[0]
    assert fix.title.startswith("Cast table of every Positional (2 tensors") and fix.safe  # an exact upcast
    fix.apply()
    assert [b.table.dtype for b in model] == [torch.float32] * 2 and "table" in dict(model[1].named_buffers())
    assert trains(model, lambda: model(x).square().sum())  # both blocks run: the twin would have raised next
    fix.undo()
    assert [b.table.dtype for b in model] == [torch.float8_e5m2] * 2


# -- Sygil-Dev/sygil-webui#72: a learned embedding in a ParameterDict written into a half encoder -----------------


class Placeholder(torch.nn.Module):
    """A learned vector per placeholder token, held in a ParameterDict entry the failing line reads."""

    def __init__(self) -> None:
        super().__init__()
        self.vectors = torch.nn.ParameterDict({"*": torch.nn.Parameter(torch.randn(1, 8) * 0.02)})

    def forward(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        embedded = embedded.clone()
        embedded[torch.where(ids == 5)] = self.vectors["*"]
        return embedded


def test_a_parameter_dict_entry_written_into_half_embeddings_is_cast_in_place_and_trains():
    torch.manual_seed(0)
    encoder = torch.nn.Embedding(8, 8).half()
    manager = Placeholder()
    ids = torch.tensor([[1, 5, 2]])
    exc = raised(manager, ids, encoder(ids))
    assert "got Half for the destination and Float for the source" in str(exc)
    report = explain(exc, exc.__traceback__, namespace={"manager": manager, "encoder": encoder, "ids": ids})
    assert report.cause.check == "crash-index-put-dtype"
    assert "manager.vectors['*'] (fp32" in report.cause.evidence["operands"]
    fix = report.cause.fixes[0]
    assert fix.changes and "manager.vectors['*']" in fix.title and "fp16" in fix.title
    vector = manager.vectors["*"]
    fix.apply()
    assert manager.vectors["*"] is vector and vector.dtype == torch.float16  # the same Parameter
    out = manager(ids, encoder(ids))
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    opt = torch.optim.SGD([vector], lr=0.1)
    before = vector.detach().clone()
    out.float().square().sum().backward()
    opt.step()
    assert not torch.equal(before, vector.detach())  # the learned vector trains
    fix.undo()
    assert manager.vectors["*"] is vector and vector.dtype == torch.float32
