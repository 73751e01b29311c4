"""The mixed-precision exception families: the catalogue behind the crash patterns and ``docs/exception-families.md``.

One :class:`Family` per kind of dtype error that torch (2.1 to 2.13),
its GradScaler and torchao raise: the messages as the libraries write them,
where each was seen, what it means, and the cast (or rule) that fixes it.
:mod:`mpdoctor.attach.crash.patterns` builds its patterns from this table, and
``docs/exception-families.md`` is generated from it (:func:`catalogue_markdown`;
a test keeps the file in sync).

Every example message carries its provenance: ``raised`` means a test raises
exactly that error from real objects on this CPU (torch 2.13, torchao 0.18);
``source`` means the text is quoted from the library's source because only a
GPU path raises it, and its test matches the pattern on that quoted text.

This module imports nothing heavy: it is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...rules.engine.findings import Severity
from ...rules.engine.rules import REGISTRY, Applicability, Rule, RuleKind, register

#: How the cast of a dtype family is chosen (see :mod:`mpdoctor.attach.crash.operands`).
TO_PARAMETER = "to-parameter"  # the operand that is not a parameter takes the parameter's dtype
TO_DESTINATION = "to-destination"  # the source takes the destination's dtype (in-place writes)
TO_EXPECTED = "to-expected"  # the tensor of the "found" dtype takes the "expected" one
MASK = "mask"  # an attention mask becomes bool (or the query's dtype, when additive)
FP8_UPCAST = "fp8-upcast"  # the float8 tensor is upcast (dequantized) to the other operand's dtype
INDEX_LONG = "index-long"  # an index / class-target tensor goes back to int64
AMP_STATE = "amp-state"  # a loss-scaling state tensor goes back to fp32 (scales) or int32 (growth tracker)

#: Kinds of family.
DTYPE = "dtype"  # two tensors of different dtypes met in one op: a cast fixes it
PROTOCOL = "protocol"  # the GradScaler's call order was broken: a rule and the loop line
REFUSAL = "refusal"  # a library refused a shape or a device: a config fixes it

#: Findings that can explain a dtype mismatch between two tensors: mixed weights, a batch entry in another
#: dtype than the layer receiving it, a probe, a load, grads.
_DTYPE_CHECKS = (
    "mixed-param-dtypes", "batch-dtype-mismatch", "probe-dtype-error", "load-dtype-mismatch", "grad-dtype-mismatch",
)
_AUTOCAST = "or run the forward under torch.autocast, which casts per operation"


@dataclass(frozen=True)
class Example:
    """One real message of a family and where it comes from.

    Attributes
    ----------
    text : str
        The message exactly as the library writes it (first line).
    provenance : str
        ``"raised"`` (raised by a test on this CPU), ``"source"`` (quoted from the library's source) or
        ``"report"`` (quoted from a public report of an older version).
    where : str
        The op and library version (``"torch 2.13 CPU: torch.mm"``), or the source file quoted.
    """

    text: str
    provenance: str
    where: str


@dataclass(frozen=True)
class Family:
    """One family of mixed-precision exceptions.

    Attributes
    ----------
    slug : str
        Stable crash-pattern slug (``crash-index-put-dtype``); protocol families use the
        runtime watcher's rule slugs where one exists (``amp-unscale-twice``).
    title : str
        The ops or objects concerned.
    kind : str
        :data:`DTYPE`, :data:`PROTOCOL` or :data:`REFUSAL`.
    exception_types : tuple of str
        Exact class paths of the exceptions raised.
    messages : tuple of str
        Regular expressions searched in the message.
    examples : tuple of Example
        Real messages, each matched by one of ``messages`` (a test checks it).
    versions : str
        The versions the messages were seen in, as far as found.
    cause : str
        What the error means in mixed-precision terms.
    fix : str
        The fix in words (the cast, the rule, the config).
    cast : str
        How the cast is chosen for a dtype family (``TO_PARAMETER`` ...); empty otherwise.
    protocol_rule : str
        For a protocol family: the rule of the GradScaler protocol that was broken.
    code : str
        The fix as code, written with the names ``{src}``, ``{dst}`` (tensors) or
        ``{scaler}``, ``{optimizer}`` filled in from the failing frames when known.
    checks : tuple of str
        Check slugs whose findings explain the exception better than the family's own note.
    scan : bool
        Diagnose with a value scan.
    mistake : str
        Code that raises it (the rule's example).
    runtime_rule : bool
        The family is the crash of the runtime rule of the same slug (``amp-unscale-twice``): that rule
        documents it, and the family registers none of its own.
    """

    slug: str
    title: str
    kind: str
    exception_types: tuple[str, ...]
    messages: tuple[str, ...]
    examples: tuple[Example, ...]
    versions: str
    cause: str
    fix: str
    cast: str = ""
    protocol_rule: str = ""
    code: str = ""
    checks: tuple[str, ...] = field(default=())
    scan: bool = False
    mistake: str = ""
    runtime_rule: bool = False

    def __post_init__(self) -> None:
        if not self.runtime_rule:
            register(_family_rule(self))

    @property
    def rule(self) -> Rule:
        """The rule this family is an instance of: its own, or the runtime rule of the same slug."""
        if self.runtime_rule:
            # The runtime rules load only when a family's docs are read.
            from ..runtime.protocol_rules import RULES

            return RULES[self.slug]
        return REGISTRY[self.slug]


#: What the fix of a family can do: the crash hook writes its code with the names of the failing frames.
#: The in-place fix a dtype family's cause offers when the odd operand comes from a tensor held beside weights.
_HELD_FIX_SAFETY = (
    "Unsafe, in place: when the odd operand comes from a buffer or tensor attribute that the failing line reads "
    "(`self.scale`, left fp32 beside bf16 weights), that tensor is cast where it is held (it stays a buffer); "
    "undo puts the very tensor back."
)

_FAMILY_FIX_SAFETY = (
    "Display-only: the crash hook writes this code with the names of the failing tensors and objects read "
    "from the frames; nothing is changed in place. A check whose finding explains the crash (the objects in "
    "reach) may offer its own in-place fix."
)


def _doc_code(template: str) -> str:
    """A family's code template with the names the docs use."""
    return template.format(src="x", dst="destination", dtype="torch.bfloat16", scaler="scaler",
                           optimizer="optimizer")  # fmt: skip


def _family_rule(f: Family) -> Rule:
    """The :class:`Rule` of kind ``crash-family`` a family is documented by."""
    types = " / ".join(f"`{t}`" for t in f.exception_types)
    sources = sorted({f"{ex.provenance}: {ex.where}" for ex in f.examples})
    return Rule(
        slug=f.slug,
        title=f.title,
        kind=RuleKind.CRASH_FAMILY,
        severities=(Severity.ERROR,),
        why=f.cause,
        example=f.mistake,
        use_instead=_doc_code(f.code),
        fix_safety=(Applicability.DISPLAY_ONLY, Applicability.UNSAFE) if f.kind == DTYPE else (Applicability.DISPLAY_ONLY,),
        fix_safety_note=f"{f.fix} {_FAMILY_FIX_SAFETY}" + (f" {_HELD_FIX_SAFETY}" if f.kind == DTYPE else ""),
        sources="; ".join(sources),
        detects=f"An exception of type {types} whose message matches one of {len(f.messages)} "
        f"pattern{'s' if len(f.messages) > 1 else ''} ({f.kind} family; versions: {f.versions}).",
        severity_note="Error: the run raised.",
    )


def _raised(text: str, where: str) -> Example:
    return Example(text, "raised", where)


def _source(text: str, where: str) -> Example:
    return Example(text, "source", where)


def _report(text: str, where: str) -> Example:
    return Example(text, "report", where)


_RT = ("builtins.RuntimeError",)
_FLOAT = r"(?:Float|Double|Half|BFloat16|ComplexFloat|ComplexDouble|Float8_\w+)"

FAMILIES: tuple[Family, ...] = (
    Family(
        slug="crash-matmul-dtype",
        title="matmul / mm / addmm / baddbmm / addmv / dot / Linear",
        mistake=(
            'model = nn.Linear(8, 8).to(torch.bfloat16)\n'
            'x = torch.randn(2, 8)  # fp32\n'
            'model(x)'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(
            r"mat1 and mat2 must have the same dtype",
            r"expected m1 and m2 to have the same dtype",
            r"expected mat1 and mat2 to have the same dtype",
            r"self and mat2 must have the same dtype",
            r"Input dtypes must be the same, got: input",
            r"addmv input tensors must have the same dtype",
            r"dot : expected both vectors to have same dtype",
            r"both inputs should have same dtype",
        ),
        examples=(
            _raised("mat1 and mat2 must have the same dtype, but got Float and BFloat16", "torch 2.13 CPU: nn.Linear"),
            _raised("expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16",
                    "torch 2.13 CPU: torch.mm / @"),
            _raised("expected m1 and m2 to have the same dtype, but got: c10::Float8_e4m3fn != c10::BFloat16",
                    "torch 2.13 CPU: float8 @ bf16"),
            _raised("self and mat2 must have the same dtype, but got BFloat16 and Float",
                    "torch 2.13 CPU: torch.addmm / F.linear bias"),
            _raised("Input dtypes must be the same, got: input c10::BFloat16, batch1: float, batch2: float",
                    "torch 2.13 CPU: torch.baddbmm"),
            _raised("addmv input tensors must have the same dtype, but got BFloat16, Float, and BFloat16",
                    "torch 2.13 CPU: torch.mv / addmv"),
            _raised("dot : expected both vectors to have same dtype, but found Float and BFloat16",
                    "torch 2.13 CPU: torch.dot"),
            _raised("both inputs should have same dtype", "torch 2.13 CPU: torch.tensordot"),
            _report("expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16",
                    "torch on CUDA, quoted in public code and reports found by code search (Linear on a GPU)"),
        ),  # fmt: skip
        versions="torch 2.1-2.13 (CPU and CUDA word it differently; both matched)",
        cause="A matrix multiply (Linear, matmul, bmm, addmm) met two dtypes: usually a half-precision weight fed "
        "fp32 activations, or an fp32 adapter or head on a bf16/fp16 model, without autocast.",
        fix=f"Cast the activation to the weight's dtype (or the module to the activation's), {_AUTOCAST}.",
        cast=TO_PARAMETER,
        code="{src} = {src}.to({dtype})",
        checks=_DTYPE_CHECKS,
    ),
    Family(
        slug="crash-scalar-type-dtype",
        title="bmm / baddbmm / einsum / conv-transpose / cdist / grid_sample / loss weights / CUDA norms",
        mistake=(
            'x = torch.randn(2, 4, 5)  # fp32\n'
            'torch.bmm(torch.randn(2, 3, 4, dtype=torch.bfloat16), x)'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(rf"expected scalar type {_FLOAT} but found {_FLOAT}",),
        examples=(
            _raised("expected scalar type Float but found BFloat16",
                    "torch 2.13 CPU: torch.bmm, einsum, ConvTranspose2d, cdist, grid_sample, cross_entropy weight"),
        ),  # fmt: skip
        versions="torch 1.x-2.13 (the generic ScalarType check: many kernels, CPU and CUDA)",
        cause="A kernel that computes in one dtype was handed a tensor of another: the first dtype is the one "
        "the op runs in (its first input or its weight), the second the operand that disagrees.",
        fix=f"Cast the operand of the 'found' dtype to the 'expected' one, {_AUTOCAST}.",
        cast=TO_EXPECTED,
        code="{src} = {src}.to({dtype})",
        checks=_DTYPE_CHECKS,
    ),
    Family(
        slug="crash-conv-dtype",
        title="Conv1d/2d/3d (weight and bias)",
        mistake=(
            'conv = nn.Conv2d(3, 8, 3).to(torch.bfloat16)\n'
            'x = batch["pixel_values"]  # fp32 from the image processor\n'
            'conv(x)'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(r"Input type \(.+?\) and (?:weight|bias) type \(.+?\) should be the same",),
        examples=(
            _raised("Input type (float) and bias type (c10::BFloat16) should be the same",
                    "torch 2.13 CPU: nn.Conv2d / F.conv2d"),
            _raised("Input type (float) and bias type (c10::Half) should be the same", "torch 2.13 CPU: nn.Conv1d"),
            _report("Input type (torch.cuda.FloatTensor) and weight type (torch.cuda.HalfTensor) should be the same",
                    "torch on CUDA, quoted in many public reports found by code search (a .half() conv fed fp32)"),
        ),  # fmt: skip
        versions="torch 1.x-2.13 (older and CUDA builds name legacy tensor types: torch.cuda.HalfTensor)",
        cause="A convolution's input and its weight or bias have different dtypes (a half-precision conv fed fp32, "
        "or the reverse) without autocast.",
        fix=f"Cast the input to the convolution's weight dtype (or the conv to the input's), {_AUTOCAST}.",
        cast=TO_PARAMETER,
        code="{src} = {src}.to({dtype})",
        checks=_DTYPE_CHECKS,
    ),
    Family(
        slug="crash-norm-dtype",
        title="LayerNorm / GroupNorm / BatchNorm / InstanceNorm on the CPU",
        mistake=(
            'norm = nn.LayerNorm(8).to(torch.bfloat16)\n'
            'x = torch.randn(2, 8)  # fp32, on the CPU\n'
            'norm(x)'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(
            r"mixed dtype \(\w+\): expect parameter to have scalar type of \w+",
            r"mixed dtype \(\w+\): all inputs must share same datatype",
        ),
        examples=(
            _raised("mixed dtype (CPU): expect parameter to have scalar type of Float",
                    "torch 2.13 CPU: LayerNorm, GroupNorm, BatchNorm1d, InstanceNorm1d (bf16/fp16 params, fp32 input)"),
            _source("mixed dtype (CPU): all inputs must share same datatype.",
                    "torch aten/src/ATen/native/mixed_type.h (check_mixed_data_type, fp64 input / fp32 params)"),
        ),  # fmt: skip
        versions="torch 2.0-2.13 (CPU kernels; CUDA raises the generic 'expected scalar type')",
        cause="A normalisation layer's parameters and its input have different dtypes. The CPU kernels accept a "
        "half-precision input with fp32 parameters, never fp32 input with half parameters.",
        fix=f"Cast the input to the norm's parameter dtype, or keep the norm in fp32, {_AUTOCAST}.",
        cast=TO_PARAMETER,
        code="{src} = {src}.to({dtype})",
        checks=_DTYPE_CHECKS,
    ),
    Family(
        slug="crash-rnn-dtype",
        title="RNN / LSTM / GRU",
        mistake=(
            'lstm = nn.LSTM(8, 16).to(torch.bfloat16)\n'
            'x = torch.randn(5, 2, 8)\n'
            'lstm(x)'
        ),
        kind=DTYPE,
        exception_types=("builtins.ValueError",),
        messages=(
            r"RNN input dtype \(.+?\) does not match weight dtype",
            r"^input must have the type torch\.\w+, got type torch\.\w+$",
        ),
        examples=(
            _raised("RNN input dtype (torch.float32) does not match weight dtype (torch.bfloat16). Convert input: "
                    "input.to(torch.bfloat16), or convert model: model.to(torch.float32)",
                    "torch 2.13: nn.LSTM / nn.GRU (LSTMCell and GRUCell raise the matmul family)"),
            _source("input must have the type torch.bfloat16, got type torch.float32",
                    "torch 2.4-2.12 torch/nn/modules/rnn.py: RNNBase.check_input (raised by the oldest corner's test)"),
        ),  # fmt: skip
        versions="torch 2.4-2.13 (the Python-side check in nn.RNNBase, worded anew in 2.13; cells raise the matmul message)",
        cause="A recurrent layer's weights and its input have different dtypes.",
        fix=f"Cast the input to the RNN's weight dtype (or the RNN to the input's), {_AUTOCAST}.",
        cast=TO_PARAMETER,
        code="{src} = {src}.to({dtype})",
        checks=_DTYPE_CHECKS,
    ),
    Family(
        slug="crash-attention-dtype",
        title="scaled_dot_product_attention: query, key, value",
        mistake=(
            'x = torch.randn(1, 2, 4, 8)  # the query, fp32\n'
            'k = v = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)\n'
            'F.scaled_dot_product_attention(x, k, v)'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(r"Expected query, key, and value to have the same dtype",),
        examples=(
            _raised("Expected query, key, and value to have the same dtype, but got query.dtype: float key.dtype: "
                    "c10::BFloat16 and value.dtype: c10::BFloat16 instead.", "torch 2.13 CPU: F.scaled_dot_product_attention"),
        ),  # fmt: skip
        versions="torch 2.1-2.13",
        cause="scaled_dot_product_attention got query, key and value in different dtypes: one projection runs in "
        "another precision than the others.",
        fix=f"Cast query, key and value to one dtype, {_AUTOCAST}.",
        cast=TO_EXPECTED,
        code="{src} = {src}.to({dtype})",
        checks=_DTYPE_CHECKS,
    ),
    Family(
        slug="crash-attention-mask-dtype",
        title="attention masks (SDPA, MultiheadAttention)",
        mistake=(
            'x = batch["attention_mask"][:, None, None, :]  # int64 from the tokenizer\n'
            'F.scaled_dot_product_attention(q, k, v, attn_mask=x)'
        ),
        kind=DTYPE,
        exception_types=("builtins.RuntimeError", "builtins.AssertionError"),
        messages=(
            r"Expected attn_mask dtype to be bool or (?:float or )?to match query dtype",
            r"only bool and floating types of (?:attn_mask|key_padding_mask) are supported",
        ),
        examples=(
            _raised("Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: "
                    "long int and  query.dtype: float instead.", "torch 2.13 CPU: F.scaled_dot_product_attention"),
            _raised("only bool and floating types of attn_mask are supported", "torch 2.13: nn.MultiheadAttention"),
            _report("Expected attn_mask dtype to be bool or to match query dtype, but got attn_mask.dtype: float and  "
                    "query.dtype: c10::BFloat16 instead.",
                    "torch 2.0-2.x, before float masks were accepted (foundation-model-stack PR #215, open_clip #484)"),
        ),  # fmt: skip
        versions="torch 2.0-2.13 (before about 2.5 a float mask had to match the query's dtype too)",
        cause="The attention mask is neither bool nor in the query's floating dtype: an integer 0/1 padding "
        "mask from a tokenizer, or an additive mask built in fp32 for a bf16/fp16 query.",
        fix="Make the mask bool (True = attend) or, for an additive mask, cast it to the query's dtype.",
        cast=MASK,
        code="{src} = {src}.bool()  # True = attend; an additive float mask: {src}.to({dtype})",
    ),
    Family(
        slug="crash-index-put-dtype",
        title="index_put_ / x[idx] = y / masked assignment",
        mistake=(
            'destination = torch.zeros(4, 8)\n'
            'x = hidden.to(torch.bfloat16)\n'
            'destination[idx] = x'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(r"Index put requires the source and destination dtypes match",),
        examples=(
            _raised("Index put requires the source and destination dtypes match, got Float for the destination and "
                    "BFloat16 for the source.", "torch 2.13 CPU: x[idx] = y, index_put_, x[mask] = y"),
        ),  # fmt: skip
        versions="torch 1.x-2.13",
        cause="A write into a tensor by index got values of another dtype: typically bf16/fp16 values computed under "
        "autocast written into an fp32 buffer created outside it (or the reverse).",
        fix="Cast the values to the destination's dtype before writing them.",
        cast=TO_DESTINATION,
        code="{src} = {src}.to({dst}.dtype)",
    ),
    Family(
        slug="crash-index-add-dtype",
        title="index_add_ / index_reduce_ / index_copy_ / put_",
        mistake=(
            'destination = torch.zeros(4, 8)\n'
            'destination.index_add_(0, idx, x)  # x is bf16'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(
            r"index_(?:add|reduce)_?\(\): self \(\w+\) and source \(\w+\) must have the same scalar type",
            r"index_copy_?\(\): self and source expected to have the same dtype",
            r"put_\(\): self and source expected to have the same dtype",
        ),
        examples=(
            _raised("index_add_(): self (Float) and source (BFloat16) must have the same scalar type",
                    "torch 2.13 CPU: Tensor.index_add_"),
            _raised("index_reduce_(): self (Float) and source (BFloat16) must have the same scalar type",
                    "torch 2.13 CPU: Tensor.index_reduce_"),
            _raised("index_copy_(): self and source expected to have the same dtype, but got (self) Float and (source) "
                    "BFloat16", "torch 2.13 CPU: Tensor.index_copy_"),
            _raised("put_(): self and source expected to have the same dtype, but got self.dtype = Float and "
                    "source.dtype = BFloat16", "torch 2.13 CPU: Tensor.put_"),
        ),  # fmt: skip
        versions="torch 1.x-2.13",
        cause="An indexed accumulation or copy (MoE token routing, scatter of expert outputs, embedding updates) "
        "got a source in another dtype than the tensor it writes into.",
        fix="Cast the source to the destination's dtype (or build the destination in the source's dtype).",
        cast=TO_DESTINATION,
        code="{src} = {src}.to({dst}.dtype)",
    ),
    Family(
        slug="crash-scatter-dtype",
        title="scatter_ / scatter_add_ / scatter_reduce_",
        mistake=(
            'destination = torch.zeros(2, 10)\n'
            'destination.scatter_(1, idx, x)  # x is bf16'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(r"scatter\(\): Expected self\.dtype to be equal to src\.dtype",),
        examples=(
            _raised("scatter(): Expected self.dtype to be equal to src.dtype",
                    "torch 2.13 CPU: scatter_, scatter_add_, scatter_reduce_"),
        ),  # fmt: skip
        versions="torch 1.x-2.13",
        cause="A scatter wrote values of another dtype than the tensor scattered into.",
        fix="Cast src to the destination's dtype.",
        cast=TO_DESTINATION,
        code="{src} = {src}.to({dst}.dtype)",
    ),
    Family(
        slug="crash-masked-scatter-dtype",
        title="masked_scatter_ (multimodal embedding merges)",
        mistake=(
            'destination = text_embeds.to(torch.bfloat16)\n'
            'x = image_features  # the vision tower returns fp32\n'
            'destination.masked_scatter_(image_mask, x)'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(r"masked_scatter_?: expected self and source to have same dtypes",),
        examples=(
            _raised("masked_scatter: expected self and source to have same dtypes but gotBFloat16 and Float",
                    "torch 2.13 CPU: Tensor.masked_scatter_"),
        ),  # fmt: skip
        versions="torch 2.1-2.13",
        cause="masked_scatter merged features of another dtype into a tensor: the usual case is image or audio "
        "features from an fp32 encoder written into bf16/fp16 text embeddings of a multimodal model.",
        fix="Cast the source features to the destination embeddings' dtype.",
        cast=TO_DESTINATION,
        code="{src} = {src}.to({dst}.dtype)",
    ),
    Family(
        slug="crash-same-type-check",
        title="embedding_bag and other ops checking argument types (per_sample_weights, weight)",
        mistake=(
            'bag = nn.EmbeddingBag(100, 8).to(torch.bfloat16)\n'
            'x = torch.rand(ids.shape)  # fp32 per-sample weights\n'
            'bag(ids, offsets, per_sample_weights=x)'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(r"Expected tensor for argument #\d+ '\w+' to have the same type as tensor for argument #\d+ '\w+'",),
        examples=(
            _raised("Expected tensor for argument #1 'weight' to have the same type as tensor for argument #1 "
                    "'per_sample_weights'; but type torch.FloatTensor does not equal CPUBFloat16Type (while checking "
                    "arguments for embedding_bag)", "torch 2.13 CPU: F.embedding_bag, nn.EmbeddingBag"),
        ),  # fmt: skip
        versions="torch 1.x-2.13 (checkSameType in aten/src/ATen/TensorUtils.cpp)",
        cause="Two arguments of one op must share a dtype and do not: for embedding_bag, per_sample_weights in "
        "another dtype than the embedding table.",
        fix="Cast the argument to the weight's dtype (per_sample_weights to the table's dtype).",
        cast=TO_PARAMETER,
        code="{src} = {src}.to({dtype})",
        checks=_DTYPE_CHECKS,
    ),
    Family(
        slug="crash-loss-dtype",
        title="loss functions: binary_cross_entropy and float targets",
        mistake=(
            'x = labels.double()\n'
            'F.binary_cross_entropy(torch.sigmoid(logits), x)'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(rf"Found dtype {_FLOAT} but expected {_FLOAT}",),
        examples=(
            _raised("Found dtype Double but expected Float", "torch 2.13 CPU: F.binary_cross_entropy (fp64 target)"),
        ),  # fmt: skip
        versions="torch 1.x-2.13 (TensorIterator's common-dtype check)",
        cause="A loss got a target (or weight) in another floating dtype than the prediction: labels built with numpy "
        "(float64), or an fp32 target against a half-precision output.",
        fix="Cast the target to the prediction's dtype (or compute the loss in fp32: both to float()).",
        cast=TO_EXPECTED,
        code="{src} = {src}.to({dtype})",
    ),
    Family(
        slug="crash-index-dtype",
        title="class targets and indices cast to a float dtype (nll_loss, cross_entropy, embedding, gather)",
        mistake=(
            'x = batch["labels"].to(torch.bfloat16)  # the whole batch cast\n'
            'F.cross_entropy(logits, x)'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(
            r"expected target dtype to be Long or Byte",
            r"expected scalar type Long but found \w+",
            r"Expected tensor for argument #\d+ 'indices' to have one of the following scalar types: Long, Int",
            r"gather\(\): Expected dtype int(?:32/int)?64 for index",
        ),
        examples=(
            _raised("expected target dtype to be Long or Byte, but got Float", "torch 2.13 CPU: F.nll_loss, cross_entropy"),
            _raised("Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int; "
                    "but got torch.FloatTensor instead (while checking arguments for embedding)",
                    "torch 2.13 CPU: nn.Embedding"),
            _raised("gather(): Expected dtype int32/int64 for index", "torch 2.13 CPU: torch.gather"),
            _report("expected scalar type Long but found Int",
                    "older torch, quoted in user code found by code search (cross_entropy on int32 labels)"),
        ),  # fmt: skip
        versions="torch 1.x-2.13 (the wording changed around 2.1: 'expected target dtype to be Long or Byte')",
        cause="Integer ids or class labels became floats: a whole batch cast with .to(torch.bfloat16) / .half() / "
        ".float(), labels built as floats, or int32 labels from numpy on Windows.",
        fix="Cast only floating tensors of a batch; give ids and labels back their int64 dtype.",
        cast=INDEX_LONG,
        code="{src} = {src}.long()",
    ),
    Family(
        slug="crash-fp8-promotion",
        title="float8 tensors in ordinary ops (type promotion)",
        mistake=(
            'x = weight.to(torch.float8_e4m3fn)\n'
            'hidden + x  # a bf16 tensor meets a float8 one'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(r"Promotion for Float8 Types is not supported, attempted to promote \w+ and \w+",),
        examples=(
            _raised("Promotion for Float8 Types is not supported, attempted to promote Float8_e4m3fn and BFloat16",
                    "torch 2.13 CPU: fp8 + bf16, torch.cat, torch.where"),
            _raised("Promotion for Float8 Types is not supported, attempted to promote Float8_e4m3fn and Float8_e5m2",
                    "torch 2.13 CPU: e4m3 * e5m2"),
        ),  # fmt: skip
        versions="torch 2.1-2.13 (since the float8 dtypes appeared)",
        cause="A float8 tensor (fp8 weight storage, a checkpoint saved in float8) met another dtype in an ordinary "
        "op: torch never promotes float8; it must be upcast (and rescaled) explicitly before the math.",
        fix="Upcast the float8 tensor to the compute dtype (times its scale when it was stored scaled) before use.",
        cast=FP8_UPCAST,
        code="{src} = {src}.to({dtype})  # times its scale if it was stored scaled",
    ),
    Family(
        slug="crash-scaler-bf16",
        title="_amp_foreach_non_finite_check_and_unscale_ (CUDA) with bf16 gradients",
        mistake=(
            'model.to(torch.bfloat16)\n'
            'scaler = torch.amp.GradScaler("cuda")\n'
            'scaler.scale(loss).backward()\n'
            'scaler.step(optimizer)  # on CUDA builds without the bf16 unscale kernel'
        ),
        kind=DTYPE,
        exception_types=("builtins.RuntimeError", "torch.AcceleratorError"),
        messages=(r"_amp_foreach_non_finite_check_and_unscale\w* ?\"? not implemented for 'BFloat16'",),
        examples=(
            _source("\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'",
                    "torch CUDA aten/src/ATen/native/cuda/AmpKernels.cu (pytorch #127176; the CPU kernel takes bf16)"),
        ),  # fmt: skip
        versions="torch 2.1-2.13 on CUDA (the CPU kernel accepts bf16)",
        cause="A GradScaler unscaled bf16 gradients; this CUDA kernel has no bf16 version, and bf16 needs no loss "
        "scaling at all.",
        fix="Disable the scaler for bf16 (GradScaler(enabled=False), or set enabled on the live one).",
        code="{scaler} = torch.amp.GradScaler(enabled=False)  # bf16 needs no loss scaling",
        checks=("scaler-with-bf16",),
    ),
    Family(
        slug="crash-amp-state-dtype",
        title="_amp_foreach_non_finite_check_and_unscale_ / _amp_update_scale_ state tensors",
        mistake=(
            'scaler = torch.amp.GradScaler("cuda")\n'
            'scaler.load_state_dict(state)\n'
            'scaler._scale = scaler._scale.half()  # the loss scale moved to fp16 with a model cast'
        ),
        kind=DTYPE,
        exception_types=_RT,
        messages=(
            r"(?:inv_scale|found_inf|current_scale) must be a float tensor\.",
            r"growth_tracker must be an int tensor\.",
        ),
        examples=(
            _raised("inv_scale must be a float tensor.", "torch 2.13 CPU: torch._amp_foreach_non_finite_check_and_unscale_"),
            _raised("found_inf must be a float tensor.", "torch 2.13 CPU: both AMP kernels"),
            _raised("current_scale must be a float tensor.", "torch 2.13 CPU: torch._amp_update_scale_"),
            _raised("growth_tracker must be an int tensor.", "torch 2.13 CPU: torch._amp_update_scale_"),
        ),  # fmt: skip
        versions="torch 1.6-2.13 (CPU and CUDA AMP kernels)",
        cause="The loss-scaling state reached the AMP kernels in the wrong dtype: a scale or found-inf tensor cast "
        "to half or double (a custom scaler, a state dict restored through .half()/.double(), or a model-wide "
        "cast that caught the scaler's tensors).",
        fix="Keep the scale and found_inf tensors in fp32 and the growth tracker in int32; restore a scaler with "
        "scaler.load_state_dict(state), not by casting its tensors.",
        cast=AMP_STATE,
        code="{src} = {src}.to({dtype})  # the AMP kernels take fp32 scales and an int32 growth tracker",
    ),
    Family(
        slug="crash-unscale-fp16",
        title="GradScaler with fp16 parameters",
        mistake=(
            'model.half()\n'
            'scaler = torch.amp.GradScaler("cuda")\n'
            'scaler.scale(model(x).sum()).backward()\n'
            'scaler.step(optimizer)'
        ),
        kind=PROTOCOL,
        exception_types=("builtins.ValueError",),
        messages=(r"Attempting to unscale FP16 gradients",),
        examples=(_raised("Attempting to unscale FP16 gradients.", "torch 2.13: GradScaler.unscale_ / step"),),
        versions="torch 1.6-2.13",
        cause="A GradScaler was asked to unscale gradients of fp16 parameters. Loss scaling needs fp32 master "
        "weights: fp16 belongs in autocast, not in the trainable parameters.",
        fix="Cast the trainable parameters (with their grads and optimizer state) to fp32 and keep fp16 in "
        "torch.autocast; or drop the scaler if the run is meant to be pure half precision.",
        protocol_rule="GradScaler unscales fp32 master gradients: the trainable parameters stay fp32, autocast runs the "
        "forward in fp16.",
        code="model.float()  # fp32 master weights; then re-create the optimizer\n"
        "with torch.autocast(device_type, dtype=torch.float16):\n    loss = model(batch)",
        checks=("fp16-trainable-params-with-scaler",),
    ),
    Family(
        slug="amp-unscale-twice",
        title="GradScaler.unscale_ called twice before update()",
        runtime_rule=True,
        kind=PROTOCOL,
        exception_types=_RT,
        messages=(r"unscale_\(\) has already been called on this optimizer since the last update\(\)",),
        examples=(
            _raised("unscale_() has already been called on this optimizer since the last update().",
                    "torch 2.13: GradScaler.unscale_"),
        ),  # fmt: skip
        versions="torch 1.6-2.13",
        cause="unscale_ ran twice for one optimizer between two update() calls: usually unscale_ inside a "
        "gradient-accumulation loop (per micro-batch) instead of once before the real step.",
        fix="Call unscale_ once per real step, after the last micro-batch's backward and before clipping.",
        protocol_rule="scale(loss).backward() per micro-batch -> unscale_(optimizer) at most once per real step -> clip -> "
        "step(optimizer) -> update()",
        code="if (i + 1) % accumulation_steps == 0:\n    {scaler}.unscale_({optimizer})\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n    {scaler}.step({optimizer})\n"
        "    {scaler}.update()\n    {optimizer}.zero_grad()",
        checks=("amp-unscale-twice",),  # the runtime watcher's finding of the same rule, when it saw the loop
    ),
    Family(
        slug="amp-update-missing",
        title="GradScaler.step called again without update()",
        runtime_rule=True,
        kind=PROTOCOL,
        exception_types=_RT,
        messages=(r"step\(\) has already been called since the last update\(\)",),
        examples=(
            _raised("step() has already been called since the last update().", "torch 2.13: GradScaler.step"),
        ),
        versions="torch 1.6-2.13",
        cause="scaler.step(optimizer) ran twice for one optimizer with no scaler.update() between: update() is "
        "missing from the loop (or sits outside it).",
        fix="Call scaler.update() once per real step, after all scaler.step calls of that step.",
        protocol_rule="step(optimizer) once per optimizer per real step, then update() once",
        code="{scaler}.step({optimizer})\n{scaler}.update()  # once per real step, after every scaler.step",
        checks=("amp-update-missing",),  # the runtime watcher's finding of the same rule, when it saw the loop
    ),
    Family(
        slug="amp-unscale-after-step",
        title="GradScaler.unscale_ after step()",
        mistake=(
            'scaler.scale(loss).backward()\n'
            'scaler.step(optimizer)\n'
            'scaler.unscale_(optimizer)  # after step: too late to clip\n'
            'scaler.update()'
        ),
        kind=PROTOCOL,
        exception_types=_RT,
        messages=(r"unscale_\(\) is being called after step\(\)",),
        examples=(_raised("unscale_() is being called after step().", "torch 2.13: GradScaler.unscale_"),),
        versions="torch 1.6-2.13",
        cause="unscale_ ran after scaler.step for the same optimizer in one step: clipping (or a gradient read) "
        "placed after the step, where the gradients were already unscaled and applied.",
        fix="Move unscale_ and clipping before scaler.step.",
        protocol_rule="unscale_(optimizer) -> clip -> step(optimizer) -> update(), in that order",
        code="{scaler}.unscale_({optimizer})\ntorch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
        "{scaler}.step({optimizer})\n{scaler}.update()",
    ),
    Family(
        slug="amp-no-inf-checks",
        title="GradScaler.step on an optimizer whose gradients were never scaled",
        mistake=(
            'loss.backward()  # not scaler.scale(loss)\n'
            'scaler.step(optimizer)\n'
            'scaler.update()'
        ),
        kind=PROTOCOL,
        exception_types=("builtins.AssertionError",),
        messages=(r"No inf checks were recorded for this optimizer",),
        examples=(_raised("No inf checks were recorded for this optimizer.", "torch 2.13: GradScaler.step"),),
        versions="torch 1.6-2.13",
        cause="scaler.step found no gradient to check for this optimizer: none of its parameters got a gradient "
        "(the loss was not built from them, backward was not called through scaler.scale(loss), or the "
        "parameters are frozen).",
        fix="Call scaler.scale(loss).backward() before scaler.step, on a loss that depends on the optimizer's "
        "trainable parameters.",
        protocol_rule="scale(loss).backward() must give this optimizer's parameters gradients before step(optimizer)",
        code="{scaler}.scale(loss).backward()\n{scaler}.step({optimizer})\n{scaler}.update()",
    ),
    Family(
        slug="amp-update-without-step",
        title="GradScaler.update with no step or unscale since the last update",
        mistake=(
            'scaler.scale(loss).backward()\n'
            'scaler.update()  # no step or unscale_ since the last update'
        ),
        kind=PROTOCOL,
        exception_types=("builtins.AssertionError",),
        messages=(r"No inf checks were recorded prior to update",),
        examples=(_raised("No inf checks were recorded prior to update.", "torch 2.13: GradScaler.update"),),
        versions="torch 1.6-2.13",
        cause="scaler.update() ran with no scaler.step(optimizer) since the last update: the step is missing "
        "(never called, or optimizer.step() called directly instead), or update() runs on micro-batches that take "
        "no step.",
        fix="Call scaler.step(optimizer) before every scaler.update(), once per real step.",
        protocol_rule="update() once per real step, after step(optimizer)",
        code="{scaler}.step({optimizer})\n{scaler}.update()  # once per real step",
        # the watcher's finding of the loop, when it saw it: which of the three the loop did
        checks=("amp-step-missing", "amp-step-bypasses-scaler", "amp-update-per-microbatch"),
    ),
    Family(
        slug="amp-closure",
        title="GradScaler.step with a closure",
        mistake=(
            'optimizer = torch.optim.LBFGS(model.parameters())\n'
            'scaler.step(optimizer, closure)'
        ),
        kind=PROTOCOL,
        exception_types=_RT,
        messages=(r"Closure use is not currently supported if GradScaler is enabled",),
        examples=(
            _raised("Closure use is not currently supported if GradScaler is enabled.", "torch 2.13: GradScaler.step"),
        ),
        versions="torch 1.6-2.13",
        cause="scaler.step was given a closure (LBFGS-style): GradScaler cannot re-run the forward and backward "
        "under its scale.",
        fix="Run the forward and backward yourself, then scaler.step(optimizer) without a closure; or train "
        "without loss scaling (bf16 or fp32) for closure optimizers.",
        protocol_rule="step(optimizer) takes no closure while the scaler is enabled",
        code="{scaler}.scale(loss).backward()\n{scaler}.step({optimizer})  # no closure\n{scaler}.update()",
    ),
    Family(
        slug="crash-lowbit-block-size",
        title="MXFP8 / NVFP4 / float8 shape rules (torchao, torch._scaled_mm)",
        mistake=(
            'model = nn.Sequential(nn.Linear(40, 40))\n'
            'quantize_(model, NVFP4DynamicActivationNVFP4WeightConfig())  # 40 is not a multiple of 16'
        ),
        kind=REFUSAL,
        exception_types=("builtins.AssertionError", "builtins.RuntimeError"),
        messages=(
            r"must be divisible by block_size",
            r"only supports weight shape with last 2 dims divisible by 16",
            r"Expected trailing dimension of mat\w* to be divisible by 16",
            r"(?:rows|cols) must be a multiple of 32",
        ),
        examples=(
            _raised("the last dimension of shape torch.Size([4, 40]) must be divisible by block_size 32",
                    "torchao 0.18: prototype.mx_formats.mx_tensor.to_mx (MXFP8)"),
            _raised("K dim must be divisible by block_size", "torchao 0.18: NVFP4Tensor.to_nvfp4"),
            _raised("NVFP4 only supports weight shape with last 2 dims divisible by 16, got torch.Size([40, 40])",
                    "torchao 0.18: quantize_(model, NVFP4DynamicActivationNVFP4WeightConfig())"),
            _source("Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: (16x41).",
                    "torch CUDA torch._scaled_mm (quoted in torchao's float8 tests)"),
            _source("rows must be a multiple of 32", "torchao 0.18 prototype/mx_formats/kernels.py (CUDA kernels)"),
        ),  # fmt: skip
        versions="torchao 0.7-0.18 (MX/NVFP4 prototypes); torch 2.1-2.13 _scaled_mm on CUDA",
        cause="A block format or fp8 GEMM got a dimension it cannot tile: MXFP8 scales blocks of 32 along the "
        "contraction dimension, NVFP4 blocks of 16, and fp8 GEMMs need dims that are multiples of 16.",
        fix="Keep the layers whose dims are not multiples of the block size in high precision (a module filter), "
        "or pad those dims.",
        code="def module_filter_fn(module, fqn):\n"
        "    return isinstance(module, torch.nn.Linear) and module.in_features % 32 == 0 and module.out_features % 32 == 0",
    ),
    Family(
        slug="crash-fp8-capability",
        title="fp8 / NVFP4 kernels refused on this device",
        mistake=(
            '# on a CPU or an A100\n'
            'quantize_(model, Float8DynamicActivationFloat8WeightConfig())'
        ),
        kind=REFUSAL,
        exception_types=("builtins.AssertionError", "builtins.RuntimeError"),
        messages=(
            r"Float8 .*requires CUDA compute capability",
            r"Float8 dynamic activation quantization is only supported on CUDA>=8\.9",
            r"NVFP4 \w+ mode is only supported on sm100\+ machines",
            r"torch\._scaled_mm is only supported on CUDA devices with compute capability",
        ),
        examples=(
            _raised("Float8 dynamic quantization requires CUDA compute capability ≥8.9 or MI300+ or XPU.",
                    "torchao 0.18: quantize_(model, Float8DynamicActivationFloat8WeightConfig()) on a CPU"),
            _raised("NVFP4 DYNAMIC mode is only supported on sm100+ machines",
                    "torchao 0.18: quantize_(model, NVFP4DynamicActivationNVFP4WeightConfig()) on a CPU"),
            _source("Float8 dynamic activation quantization is only supported on CUDA>=8.9 and MI300+",
                    "torchao 0.18 quantization/quant_api.py (raised on CUDA below sm89)"),
            _source("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9, or "
                    "ROCm MI300+", "torch CUDA aten/src/ATen/native/cuda/Blas.cpp (torch 2.1-2.13)"),
        ),  # fmt: skip
        versions="torchao 0.8-0.18; torch 2.1-2.13 _scaled_mm",
        cause="The fp8 (or NVFP4) recipe needs hardware fp8 GEMMs: compute capability 8.9+ (Ada, Hopper) for "
        "float8, 10.0 (Blackwell) for NVFP4. This device has none, so the library refuses the recipe.",
        fix="Run the fp8 recipe on a device that has fp8 GEMMs; here, train in bf16 (or emulate the precision "
        "with mpdoctor.compare to see what fp8 would do).",
        code="# no fp8 GEMMs on this device: keep the model in bf16\nmodel.to(torch.bfloat16)",
    ),
    Family(
        slug="crash-torchao-float8-op",
        title="an unsupported op on a torchao float8 training tensor",
        mistake=(
            'x = hp_tensor_to_float8_dynamic(hidden, torch.float8_e4m3fn, LinearMMConfig())\n'
            'x + residual  # only matmuls and views are defined on it'
        ),
        kind=REFUSAL,
        exception_types=("builtins.NotImplementedError",),
        messages=(r"attempting to run aten\.\w+(?:\.\w+)?, this is not supported",),
        examples=(
            _raised("attempting to run aten.add.Tensor, this is not supported",
                    "torchao 0.18: Float8TrainingTensor + tensor"),
        ),  # fmt: skip
        versions="torchao 0.5-0.18 (Float8TrainingTensor.__torch_dispatch__)",
        cause="A torchao float8 training tensor (the fp8 cast of a Float8Linear's input or weight) reached an op "
        "its dispatch table does not implement: only matmuls and a few views are defined on it.",
        fix="Use the float8 tensor only inside the converted Linear; elsewhere work on the high-precision tensor "
        "(or its dequantized value: tensor.to_original_precision()).",
        cast=FP8_UPCAST,
        code="{src} = {src}.to_original_precision()",
    ),
)


def family(slug: str) -> Family | None:
    """The family of ``slug``, or None."""
    return next((f for f in FAMILIES if f.slug == slug), None)


def catalogue_markdown() -> str:
    """``docs/exception-families.md``: the catalogue as Markdown (a test keeps the file equal to this)."""
    lines = [
        "# Mixed-precision exception families",
        "",
        "<!-- Generated from mpdoctor/attach/crash/catalogue.py by `python -m mpdoctor checks --update-docs`; a test keeps "
        "it in sync. -->",
        "",
        "Every dtype error torch (2.1 to 2.13), its GradScaler and torchao raise that mpdoctor's crash hook "
        "(`%load_ext mpdoctor`, `mpdoctor run`, `mpdoctor.watch`) explains: the message, where it was seen, what it "
        "means, and the cast or rule that fixes it. The hook names the two tensors of the failing op from the "
        "failing frames (module path and parameter, or the local name) and writes the cast with those names; for "
        "GradScaler's protocol errors it states the rule and the loop line. The protocol families reuse the slugs of "
        "the runtime watcher's rules (`amp-unscale-twice`, `amp-update-missing`) where one exists. Each family is a rule "
        "(`python -m mpdoctor checks` lists it) documented with ruff's sections: Why is this bad?, Example, Use "
        "instead, Fix safety.",
        "",
        "Provenance of each message: **raised** = a test (`tests/test_exception_families.py`) raises exactly this "
        "error from real objects on a CPU with torch 2.13 / torchao 0.18; **source** = the text is quoted from the "
        "library's source (it is raised only on a GPU path); its test matches the pattern on that quoted text and "
        "says so; **report** = the text is quoted from a public report (a GPU or an older version).",
        "",
        "Versions: the upper bound (2.13, torchao 0.18) is where each raised message was raised here; earlier bounds "
        "are those of the reports and sources quoted, as far as found, not a bisection.",
        "",
        "| slug | ops | kind | versions |",
        "|---|---|---|---|",
    ]
    for f in FAMILIES:
        lines.append(f"| [`{f.slug}`](#{f.slug}) | {f.title} | {f.kind} | {f.versions} |")
    for f in FAMILIES:
        lines += ["", f"## {f.slug}", "", f"**{f.title}** ({f.kind}; `{'` / `'.join(f.exception_types)}`)", ""]
        lines.append("Messages:")
        lines.append("")
        for ex in f.examples:
            lines.append(f"- {ex.provenance}: `{ex.text}` ({ex.where})")
        lines += ["", "Patterns: " + ", ".join(f"`{m}`" for m in f.messages), ""]
        lines.append(f"Versions: {f.versions}.")
        if f.protocol_rule:
            lines += ["", f"Rule: {f.protocol_rule}"]
        if f.checks:
            lines += ["", "Checks that explain it when the objects are in reach: " + ", ".join(f"`{c}`" for c in f.checks)]
        if f.runtime_rule:
            lines += ["", f"The runtime rule `{f.slug}` ([checks.md](checks.md)) documents this mistake; its sections:"]
        lines += f.rule.sections_markdown(3, skip=("What it does", "Severity", "Sources"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m mpdoctor.attach.crash.catalogue docs/exception-families.md
    import sys

    with open(sys.argv[1], "w", encoding="utf-8") as out:
        out.write(catalogue_markdown())


# -- the places between steps: linear algebra, FFT and samplers that have no half-precision kernel ------------

_LOW = r"'(?:BFloat16|Half)'"

FAMILIES = FAMILIES + (
    Family(
        slug="crash-linalg-half",
        title="torch.linalg (qr, svd, eigh, eig, solve, cholesky, inv, det, triangular solves) in bf16 / fp16",
        mistake=(
            'grad = torch.randn(8, 8, dtype=torch.bfloat16)\n'
            'q, _ = torch.linalg.qr(grad)  # an orthogonalizing optimizer (SOAP, Shampoo) on bf16 grads'
        ),
        kind=REFUSAL,
        exception_types=("builtins.NotImplementedError", "builtins.RuntimeError"),
        messages=(
            r'"(?:geqrf|orgqr|ormqr|linalg_svd|svd|linalg_eigh|linalg_eig|eig|lu|lu_factor|lu_solve|cholesky|'
            r'cholesky_inverse|triangular_solve|linalg_householder_product)\w*" not implemented for ' + _LOW,
            r"linalg\.\w+: Low precision dtypes not supported\. Got (?:BFloat16|Half)",
        ),
        examples=(
            _raised("\"geqrf_cpu\" not implemented for 'BFloat16'", "torch 2.13 CPU: torch.linalg.qr"),
            _raised("\"linalg_svd_cpu\" not implemented for 'BFloat16'", "torch 2.13 CPU: torch.linalg.svd"),
            _raised("\"cholesky_cpu\" not implemented for 'Half'",
                    "torch 2.13 CPU: torch.distributions.MultivariateNormal (its scale_tril)"),
            _raised("\"triangular_solve_cpu\" not implemented for 'BFloat16'",
                    "torch 2.13 CPU: torch.linalg.solve_triangular"),
            _raised("linalg.inv: Low precision dtypes not supported. Got BFloat16", "torch 2.13 CPU: torch.linalg.inv"),
            _report("\"geqrf_cuda\" not implemented for 'BFloat16'", "HomebrewML/HeavyBall#57 (torch.linalg.qr on CUDA)"),
            _report("\"svd_cuda_gesvdj\" not implemented for 'BFloat16'",
                    "arcee-ai/mergekit#304, huggingface/peft#1052 (torch.linalg.svd on CUDA)"),
            _report("\"cholesky_cusolver\" not implemented for 'BFloat16'", "ModelCloud/GPTQModel#1777"),
        ),  # fmt: skip
        versions="torch 1.8-2.13 (CPU LAPACK and cuSOLVER have no 16-bit kernels)",
        cause="A linear-algebra decomposition or solve got a bf16 / fp16 tensor: LAPACK (CPU) and cuSOLVER "
        "(CUDA) have no 16-bit kernels, and even where a 16-bit path exists the factorization loses its answer "
        "in 8 or 11 significant bits (an orthogonal Q that is not orthogonal, a Cholesky factor of a matrix that "
        "rounding made indefinite).",
        fix="Upcast the operand to fp32 for the op and cast the result back (an fp32 island): "
        "torch.linalg.qr(x.float()), then .to(x.dtype) where the result meets half-precision tensors again.",
        code="# torch.linalg has no bf16 / fp16 kernels: run the op in fp32, cast the result back\n"
        "q, r = torch.linalg.qr(x.float())\nq = q.to(x.dtype)",
    ),
    Family(
        slug="crash-fft-half",
        title="torch.fft (fft, rfft, ifft2, rfftn, stft) in bf16 / fp16",
        mistake=(
            'x = torch.randn(4, 12, dtype=torch.bfloat16)\n'
            'spectrum = torch.fft.rfft(x)  # a Fourier layer (FNO, FourierFT, Hyena) in a bf16 model'
        ),
        kind=REFUSAL,
        exception_types=("builtins.RuntimeError", "builtins.NotImplementedError"),  # torch 2.14 raises it as a NotImplementedError
        messages=(
            r"^Unsupported dtype (?:BFloat16|Half)$",
            r"MKL FFT doesn't support tensors? of type: (?:BFloat16|Half)",
            r"cuFFT only supports dimensions whose sizes are powers of two when computing in half precision",
        ),
        examples=(
            _raised("Unsupported dtype BFloat16", "torch 2.13 CPU: torch.fft.rfft"),
            _raised("Unsupported dtype Half", "torch 2.13 CPU: torch.fft.fft"),
            _raised("MKL FFT doesn't support tensors of type: BFloat16", "torch 2.13 CPU: torch.stft"),
            _source("cuFFT only supports dimensions whose sizes are powers of two when computing in half precision, "
                    "but got a signal size of[12]", "torch aten/src/ATen/native/cuda/SpectralOps.cpp (fp16 on CUDA)"),
            _report("Unsupported dtype BFloat16", "pytorch/pytorch#117844, Chaos96/fourierft#17 (torch.fft.ifft2)"),
        ),  # fmt: skip
        versions="torch 1.8-2.13 (no complex bf16 dtype; complex32 only on CUDA for power-of-two sizes)",
        cause="An FFT got a bf16 / fp16 tensor: torch has no complex bf16 dtype at all, and computes fp16 FFTs only "
        "on CUDA (sm53+) for power-of-two sizes; on a CPU both are refused.",
        fix="Run the transform in fp32 and cast the real result back: torch.fft.rfft(x.float()), then "
        "torch.fft.irfft(...).to(x.dtype); under autocast, disable it around the FFT.",
        code="# no bf16 FFT in torch: transform in fp32, cast the real result back\n"
        "spectrum = torch.fft.rfft(x.float())\ny = torch.fft.irfft(spectrum, n=x.shape[-1]).to(x.dtype)",
    ),
    Family(
        slug="crash-sampler-half",
        title="torch.distributions samplers (Dirichlet, Beta, Gamma) in bf16 / fp16",
        mistake=(
            'concentration = torch.ones(4, dtype=torch.bfloat16)\n'
            'torch.distributions.Dirichlet(concentration).sample()'
        ),
        kind=REFUSAL,
        exception_types=("builtins.NotImplementedError", "builtins.RuntimeError"),  # torch 2.4 raises it as a RuntimeError
        messages=(r'"(?:dirichlet|gamma|_standard_gamma|binomial|poisson)\w*" not implemented for ' + _LOW,),
        examples=(
            _raised("\"dirichlet\" not implemented for 'BFloat16'", "torch 2.13 CPU: Dirichlet(...).sample()"),
            _raised("\"gamma_cpu\" not implemented for 'Half'", "torch 2.13 CPU: Gamma(...).sample()"),
        ),  # fmt: skip
        versions="torch 1.8-2.13",
        cause="A distribution's sampler has no bf16 / fp16 kernel: Gamma, Beta and Dirichlet draw through "
        "_standard_gamma / _sample_dirichlet, defined for fp32 and fp64 only.",
        fix="Build the distribution from fp32 parameters and cast the sample back.",
        code="# samplers have no bf16 / fp16 kernels: draw in fp32, cast the sample back\n"
        "sample = torch.distributions.Dirichlet(concentration.float()).sample().to(concentration.dtype)",
    ),
)
