"""Every mixed-precision exception family of the catalogue, raised for real and explained.

Each raiser below runs real torch ops on this CPU (torch 2.13) and raises the
family's real error; the crash diagnosis then names the two tensors of the failing op with their dtypes
and gives the cast (dtype families), or the rule and the loop line (GradScaler's protocol errors). torchao's
families (refusals, block sizes) are raised in ``tests/stack/test_exception_families_torchao.py`` with the
helpers below, since only the main venv has torchao. Messages only a GPU raises are matched on the text quoted
from the library's source, and the test says so. The same raisers run as notebook cells in a real
IPython ``InteractiveShell`` after ``%load_ext mpdoctor``; for dtype families the cast the report gives
is then run and the failing line runs again, and works.
"""

from __future__ import annotations

import inspect
import re
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from between_steps_raisers import BETWEEN_STEPS_RAISERS
from test_crash_patterns import scaler_with_fp16_params

from mpdoctor.attach.crash import explain
from mpdoctor.attach.crash.catalogue import DTYPE, FAMILIES, PROTOCOL, catalogue_markdown, family
from mpdoctor.attach.crash.patterns import PATTERNS, match_exception

ROOT = Path(__file__).resolve().parents[1]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# -- the raisers: real ops, the failing line last ------------------------------------------------------------


def matmul_linear_bf16_fed_fp32():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(torch.bfloat16)
    hidden_states = torch.randn(2, 4)
    model(hidden_states)


def matmul_mm():
    activations = torch.randn(2, 4)
    weight_bf16 = torch.randn(4, 4, dtype=torch.bfloat16)
    activations @ weight_bf16


def matmul_fp8_storage():
    weight_fp8 = torch.randn(4, 4).to(torch.float8_e4m3fn)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    weight_fp8 @ x.t()


def matmul_addmm_bias():
    bias = torch.randn(4, dtype=torch.bfloat16)
    x = torch.randn(2, 4)
    weight = torch.randn(4, 4)
    torch.addmm(bias, x, weight)


def matmul_baddbmm():
    scores = torch.randn(1, 2, 4, dtype=torch.bfloat16)
    query = torch.randn(1, 2, 4)
    key_t = torch.randn(1, 4, 4)
    torch.baddbmm(scores, query, key_t)


def matmul_mv():
    matrix = torch.randn(2, 2)
    vector = torch.randn(2, dtype=torch.bfloat16)
    torch.mv(matrix, vector)


def matmul_dot():
    u = torch.randn(2)
    v = torch.randn(2, dtype=torch.bfloat16)
    torch.dot(u, v)


def matmul_tensordot():
    a = torch.randn(2, 2)
    b = torch.randn(2, 2, dtype=torch.bfloat16)
    torch.tensordot(a, b, dims=1)


def scalar_type_bmm():
    attn = torch.randn(1, 2, 4)
    values_bf16 = torch.randn(1, 4, 4, dtype=torch.bfloat16)
    torch.bmm(attn, values_bf16)


def conv_bf16_fed_fp32():
    encoder = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)).to(torch.bfloat16)
    pixel_values = torch.randn(1, 3, 8, 8)
    encoder(pixel_values)


def conv1d_fp16_fed_fp32():
    conv = torch.nn.Conv1d(3, 4, 3).to(torch.float16)
    audio = torch.randn(1, 3, 8)
    conv(audio)


def norm_bf16_fed_fp32():
    norm = torch.nn.LayerNorm(4).to(torch.bfloat16)
    hidden = torch.randn(2, 4)
    norm(hidden)


def rnn_bf16_fed_fp32():
    lstm = torch.nn.LSTM(4, 4).to(torch.bfloat16)
    sequence = torch.randn(2, 1, 4)
    lstm(sequence)


def attention_qkv():
    query = torch.randn(1, 1, 2, 4)
    key = torch.randn(1, 1, 2, 4, dtype=torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(query, key, key)


def attention_long_mask():
    query = torch.randn(1, 1, 2, 4)
    attention_mask = torch.ones(2, 2, dtype=torch.long)
    torch.nn.functional.scaled_dot_product_attention(query, query, query, attn_mask=attention_mask)


def attention_mha_long_mask():
    mha = torch.nn.MultiheadAttention(4, 1, batch_first=True)
    tokens = torch.randn(1, 2, 4)
    attn_mask = torch.zeros(2, 2, dtype=torch.long)
    mha(tokens, tokens, tokens, attn_mask=attn_mask)


def index_put_autocast_values():
    buffer = torch.zeros(4)
    rows = torch.tensor([0, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(1, 4)).squeeze(1)
    buffer[rows] = values


def index_add_expert_outputs():
    tokens = torch.zeros(4, 2)
    token_ids = torch.tensor([0, 2])
    expert_out = torch.ones(2, 2, dtype=torch.bfloat16)
    tokens.index_add_(0, token_ids, expert_out)


def index_reduce():
    acc = torch.ones(4)
    slots = torch.tensor([0, 1])
    contrib = torch.ones(2, dtype=torch.bfloat16)
    acc.index_reduce_(0, slots, contrib, "prod")


def index_copy():
    cache = torch.zeros(4)
    positions = torch.tensor([0, 1])
    new_entries = torch.ones(2, dtype=torch.bfloat16)
    cache.index_copy_(0, positions, new_entries)


def put():
    grid = torch.zeros(4)
    flat = torch.tensor([0, 1])
    update = torch.ones(2, dtype=torch.bfloat16)
    grid.put_(flat, update)


def scatter_add():
    counts = torch.zeros(4)
    bins = torch.tensor([0, 1])
    weights = torch.ones(2, dtype=torch.bfloat16)
    counts.scatter_add_(0, bins, weights)


def masked_scatter_image_features():
    inputs_embeds = torch.zeros(4, 2, dtype=torch.bfloat16)
    image_mask = torch.tensor([[True, True], [False, False], [True, True], [False, False]])
    image_features = torch.ones(4, 2)
    inputs_embeds.masked_scatter_(image_mask, image_features)


def embedding_bag_weights():
    bag = torch.nn.EmbeddingBag(4, 4, mode="sum")
    ids = torch.tensor([[0, 1]])
    per_sample = torch.ones(1, 2, dtype=torch.bfloat16)
    bag(ids, per_sample_weights=per_sample)


def loss_double_target():
    probs = torch.rand(4)
    target = torch.rand(4, dtype=torch.float64)
    torch.nn.functional.binary_cross_entropy(probs, target)


def index_labels_cast_with_batch():
    logits = torch.randn(2, 3)
    labels = torch.tensor([0, 1]).to(torch.float32)
    torch.nn.functional.nll_loss(logits.log_softmax(-1), labels)


def index_ids_cast_with_batch():
    embed = torch.nn.Embedding(4, 4)
    input_ids = torch.tensor([0, 1]).to(torch.float32)
    embed(input_ids)


def index_gather():
    table = torch.randn(4)
    index = torch.tensor([0.0, 1.0])
    torch.gather(table, 0, index)


def fp8_promotion_storage():
    weight_fp8 = torch.randn(4).to(torch.float8_e4m3fn)
    x = torch.randn(4, dtype=torch.bfloat16)
    weight_fp8 + x


def fp8_promotion_two_formats():
    grad_e5m2 = torch.randn(4).to(torch.float8_e5m2)
    act_e4m3 = torch.randn(4).to(torch.float8_e4m3fn)
    act_e4m3 * grad_e5m2


def amp_inv_scale():
    grads = [torch.ones(2)]
    found_inf = torch.zeros(1)
    inv_scale = torch.ones(1, dtype=torch.float64)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def amp_found_inf():
    grads = [torch.ones(2)]
    found_inf = torch.zeros(1, dtype=torch.float64)
    inv_scale = torch.ones(1)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def amp_current_scale():
    # 1024 fits fp16: torch 2.4 refuses to build a half 65536 before the AMP kernel is reached.
    scale = torch.full((1,), 1024.0, dtype=torch.float16)
    growth_tracker = torch.zeros(1, dtype=torch.int32)
    found_inf = torch.zeros(1)
    torch._amp_update_scale_(scale, growth_tracker, found_inf, 2.0, 0.5, 2000)


def amp_growth_tracker():
    scale = torch.full((1,), 65536.0)
    growth_tracker = torch.zeros(1, dtype=torch.int64)
    found_inf = torch.zeros(1)
    torch._amp_update_scale_(scale, growth_tracker, found_inf, 2.0, 0.5, 2000)


def scaler_unscale_per_micro_batch():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler16 = torch.amp.GradScaler("cpu")
    for micro_batch in torch.randn(2, 2, 4):
        scaler16.scale(model(micro_batch).sum()).backward()
        scaler16.unscale_(optimizer)


def scaler_step_without_update():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for batch in torch.randn(2, 2, 4):
        scaler.scale(model(batch).sum()).backward()
        scaler.step(opt)


def scaler_unscale_after_step():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.step(optimizer)
    scaler.unscale_(optimizer)


def scaler_step_on_unscaled_optimizer():
    model = torch.nn.Linear(4, 4)
    head = torch.nn.Linear(4, 1)
    head_optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.step(head_optimizer)


def scaler_update_twice():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    scaler.update()


def scaler_closure():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.step(optimizer, closure=lambda: model(torch.randn(2, 4)).sum())


#: family slug -> its raisers
RAISERS = {
    "crash-matmul-dtype": [matmul_linear_bf16_fed_fp32, matmul_mm, matmul_fp8_storage, matmul_addmm_bias,
                           matmul_baddbmm, matmul_mv, matmul_dot, matmul_tensordot],
    "crash-scalar-type-dtype": [scalar_type_bmm],
    "crash-conv-dtype": [conv_bf16_fed_fp32, conv1d_fp16_fed_fp32],
    "crash-norm-dtype": [norm_bf16_fed_fp32],
    "crash-rnn-dtype": [rnn_bf16_fed_fp32],
    "crash-attention-dtype": [attention_qkv],
    "crash-attention-mask-dtype": [attention_long_mask, attention_mha_long_mask],
    "crash-index-put-dtype": [index_put_autocast_values],
    "crash-index-add-dtype": [index_add_expert_outputs, index_reduce, index_copy, put],
    "crash-scatter-dtype": [scatter_add],
    "crash-masked-scatter-dtype": [masked_scatter_image_features],
    "crash-same-type-check": [embedding_bag_weights],
    "crash-loss-dtype": [loss_double_target],
    "crash-index-dtype": [index_labels_cast_with_batch, index_ids_cast_with_batch, index_gather],
    "crash-fp8-promotion": [fp8_promotion_storage, fp8_promotion_two_formats],
    "crash-amp-state-dtype": [amp_inv_scale, amp_found_inf, amp_current_scale, amp_growth_tracker],
    "crash-unscale-fp16": [scaler_with_fp16_params],  # the crash-pattern suite's raiser of the same error
    "amp-unscale-twice": [scaler_unscale_per_micro_batch],
    "amp-update-missing": [scaler_step_without_update],
    "amp-unscale-after-step": [scaler_unscale_after_step],
    "amp-no-inf-checks": [scaler_step_on_unscaled_optimizer],
    "amp-update-without-step": [scaler_update_twice],
    "amp-closure": [scaler_closure],
}  # fmt: skip
RAISERS.update(BETWEEN_STEPS_RAISERS)  # linear algebra, FFT and samplers in half precision

#: torchao's families: raised for real in tests/stack/test_exception_families_torchao.py (the main venv has torchao).
TORCHAO = {"crash-lowbit-block-size", "crash-fp8-capability", "crash-torchao-float8-op"}

#: Families raised only on a GPU: their messages are matched on the text quoted from the library's source.
GPU_ONLY = {"crash-scaler-bf16"}

#: Families whose error is about one tensor and the dtype the op requires of it.
ONE_TENSOR = {"crash-index-dtype", "crash-amp-state-dtype"}

ALL_RAISERS = [(slug, fn) for slug, fns in RAISERS.items() for fn in fns]


def raised(fn) -> BaseException:
    """The exception ``fn`` raises (the test fails if it raises none)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except BaseException as exc:  # noqa: BLE001 - whatever the library raises is what we match
        return exc
    raise AssertionError(f"{fn.__name__} raised nothing")


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0]


def body(fn) -> str:
    """The raiser's body as top-level code (a notebook cell)."""
    lines = inspect.getsource(fn).splitlines()[1:]
    return textwrap.dedent("\n".join(lines))


# -- the catalogue -------------------------------------------------------------------------------------------


def test_every_family_is_raised_for_real_here_or_is_gpu_only_and_says_so():
    slugs = {f.slug for f in FAMILIES}
    assert set(RAISERS) | GPU_ONLY | TORCHAO == slugs and not set(RAISERS) & TORCHAO
    for slug in GPU_ONLY:
        assert {ex.provenance for ex in family(slug).examples} <= {"source", "report"}


def test_every_raised_example_of_the_catalogue_is_exactly_what_a_raiser_raises():
    check_raised_examples(RAISERS)


#: Where another torch of the support matrix words a family's error differently from the catalogue's "raised"
#: example (recorded on torch 2.13): (family, raiser) -> {torch "major.minor": the first line that torch raises}.
#: torch 2.14 raises every example as 2.13 does.
RAISED_ON_OTHER_TORCH: dict[tuple[str, str], dict[str, str]] = {
    ("crash-matmul-dtype", "matmul_mv"): {"2.4": "expected scalar type Float but found BFloat16"},
    ("crash-rnn-dtype", "rnn_bf16_fed_fp32"): {"2.4": "input must have the type torch.bfloat16, got type torch.float32"},
    ("crash-index-dtype", "index_labels_cast_with_batch"): {"2.4": "expected scalar type Long but found Float"},
    ("crash-index-dtype", "index_gather"): {"2.4": "gather(): Expected dtype int64 for index"},
}


def check_raised_examples(raisers: dict) -> None:
    """Every example the catalogue labels "raised" is exactly the first line of one of its family's raisers, on
    this torch; where this torch words it differently, :data:`RAISED_ON_OTHER_TORCH` says what it raises instead,
    and the raiser must raise exactly that."""
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    by_raiser = {slug: {fn.__name__: first_line(raised(fn)) for fn in fns} for slug, fns in raisers.items()}
    reworded: dict[str, int] = {}
    for (slug, name), texts in RAISED_ON_OTHER_TORCH.items():
        if slug in by_raiser and version in texts:
            assert by_raiser[slug][name] == texts[version], (slug, name, version, by_raiser[slug][name])
            reworded[slug] = reworded.get(slug, 0) + 1
    for f in FAMILIES:
        if f.slug not in raisers:
            continue
        missing = [ex.text for ex in f.examples if ex.provenance == "raised" and ex.text not in by_raiser[f.slug].values()]
        # Each example this torch does not raise is one a reworded raiser above accounts for.
        assert len(missing) <= reworded.get(f.slug, 0), (f.slug, version, missing, by_raiser[f.slug])


def test_every_example_is_matched_by_its_family_and_by_no_earlier_pattern():
    # Source / report texts are quoted, not raised here: this matches the pattern on that quoted text.
    for f in FAMILIES:
        for ex in f.examples:
            exc_type = {"builtins.RuntimeError": RuntimeError, "builtins.ValueError": ValueError,
                        "builtins.AssertionError": AssertionError,
                        "builtins.NotImplementedError": NotImplementedError}[f.exception_types[0]]  # fmt: skip
            matched = match_exception(exc_type(ex.text))
            assert matched is not None and matched[0].slug == f.slug, (f.slug, ex.text)


def test_unrelated_messages_are_not_taken_for_a_family():
    for text in ["expected scalar type Long but found Int",  # an index family, not the float one
                 "mat1 and mat2 shapes cannot be multiplied (2x4 and 3x4)", "CUDA out of memory"]:  # fmt: skip
        matched = match_exception(RuntimeError(text))
        assert matched is None or matched[0].slug == "crash-index-dtype"
    assert match_exception(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x4 and 3x4)")) is None


def test_the_catalogue_doc_is_generated_from_the_table():
    doc = (ROOT / "docs" / "exception-families.md").read_text(encoding="utf-8")
    assert doc == catalogue_markdown(), "run: python -m mpdoctor checks --update-docs"
    assert {p.slug for p in PATTERNS if family(p.slug)} == {f.slug for f in FAMILIES}


# -- the diagnosis -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("slug", "raise_it"), ALL_RAISERS, ids=[fn.__name__ for _, fn in ALL_RAISERS])
def test_the_real_error_is_explained_with_its_tensors_and_cast_or_its_rule_and_line(slug, raise_it):
    check_explained(slug, raise_it)


def check_explained(slug: str, raise_it) -> None:
    """The real error matches its family; the cause names its tensors and cast, its rule and line, or the refusal."""
    exc = raised(raise_it)
    pattern, _ = match_exception(exc)
    assert pattern.slug == slug
    report = explain(exc)
    cause = report.cause
    assert cause is report.findings[0]
    assert cause.check in (slug, *family(slug).checks)
    source = body(raise_it)
    kind = family(slug).kind
    if kind == DTYPE:
        operands = cause.evidence["operands"]
        # Both tensors named with a dtype (one, where the op requires one dtype of one tensor: index targets,
        # the AMP kernels' state); at least one by the name it has in the raiser's code.
        assert operands.count(" met ") == (0 if slug in ONE_TENSOR else 1)
        names = re.findall(r"([A-Za-z_][\w.\[\]]*) \((?:fp32|bf16|fp16|fp64|int64|int32|float8_\w+),", operands)
        assert names and any(n.split(".")[0].split("[")[0] in source for n in names), operands
        assert cause.evidence["cast"] in report.to_text()
    elif kind == PROTOCOL:
        assert cause.evidence["rule"] == family(slug).protocol_rule
        line = cause.evidence["loop line"]
        assert f"{Path(inspect.getsourcefile(raise_it)).name}:" in line and line.split(": ", 1)[1] in source
    else:
        assert cause.evidence.get("refused") or cause.evidence.get("line")
        assert family(slug).code.splitlines()[0] in report.to_text()


def test_the_parameter_is_named_by_its_module_path_and_the_input_by_its_local_name():
    report = explain(raised(matmul_linear_bf16_fed_fp32))
    assert report.cause.evidence["operands"] == (
        "In Linear.forward: hidden_states (fp32, [2, 4]) met model.0.weight (bf16, parameter of model.0 (Linear))."
    )
    assert report.cause.evidence["cast"] == "hidden_states = hidden_states.to(torch.bfloat16)"


class Watched(torch.nn.Linear):
    """A user module that records every attribute read once armed (after the crash)."""

    armed = False
    reads: list = []

    def __getattribute__(self, name):
        if type(self).armed:
            type(self).reads.append(name)
        return super().__getattribute__(name)


def test_naming_the_tensors_reads_no_attribute_of_the_users_modules():
    def crash():
        model = torch.nn.Sequential(Watched(4, 4)).to(torch.bfloat16)
        hidden_states = torch.randn(2, 4)
        model(hidden_states)

    exc = raised(crash)
    Watched.armed = True
    try:
        from mpdoctor.attach.crash.cause import family_detail
        from mpdoctor.attach.crash.frames import traceback_frames

        detail = family_detail(match_exception(exc)[0], exc, traceback_frames(exc.__traceback__), None)
    finally:
        Watched.armed = False
    assert detail.evidence["operands"] == (
        "In Linear.forward: hidden_states (fp32, [2, 4]) met model.0.weight (bf16, parameter of model.0 (Watched))."
    )
    assert Watched.reads == []


def test_a_protocol_error_names_the_scaler_and_optimizer_by_the_users_names():
    report = explain(raised(scaler_unscale_per_micro_batch))
    assert "scaler16.unscale_(optimizer)" in report.cause.fixes[0].code
    assert report.cause.evidence["loop line"].endswith("scaler16.unscale_(optimizer)")


def test_the_gpu_only_bf16_unscale_message_is_matched_on_its_quoted_source_text():
    # Quoted from torch's CUDA kernel (no CUDA here); the CPU kernel accepts bf16 gradients.
    text = family("crash-scaler-bf16").examples[0].text
    assert match_exception(RuntimeError(text))[0].slug == "crash-scaler-bf16"
    torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(2, dtype=torch.bfloat16)], torch.zeros(1), torch.ones(1))


# -- in a real InteractiveShell ------------------------------------------------------------------------------

#: One raiser per family runs as a notebook cell.
CELLS = [(slug, fns[0]) for slug, fns in RAISERS.items()]


@pytest.fixture(scope="module")
def ip():
    yield from notebook_shell()


def notebook_shell():
    """A real InteractiveShell with ``%load_ext mpdoctor``; the cells' names are removed afterwards."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    before = set(shell.user_ns)
    history = shell.history_manager
    stored = len(history.input_hist_parsed)
    shell.run_cell("%load_ext mpdoctor", store_history=False)
    shell.run_cell("import torch, warnings; warnings.simplefilter('ignore')", store_history=False)
    yield shell
    shell.run_cell("%unload_ext mpdoctor", store_history=False)
    for name in set(shell.user_ns) - before:  # the cells' objects must not reach other tests' shells
        del shell.user_ns[name]
    # Nor their GradScaler misuse: %mpdoctor reads the shell's cell history (blanked, so cell numbers stay).
    for cells in (history.input_hist_parsed, history.input_hist_raw):
        cells[stored:] = [""] * (len(cells) - stored)


@pytest.mark.parametrize(("slug", "raise_it"), CELLS, ids=[slug for slug, _ in CELLS])
def test_in_a_notebook_the_hook_explains_each_family_and_its_cast_makes_the_line_run(ip, capsys, slug, raise_it):
    check_in_notebook(ip, capsys, slug, raise_it)


def check_in_notebook(ip, capsys, slug: str, raise_it) -> None:
    """The raiser's body as a cell: traceback, then the diagnosis; for dtype families the cast makes it run."""
    cell = body(raise_it)
    result = ip.run_cell(cell, store_history=True)
    out = _ANSI.sub("", capsys.readouterr().out)
    assert result.error_in_exec is not None and first_line(result.error_in_exec) in out  # the traceback first
    label = f">> cause of {type(result.error_in_exec).__name__}:"
    assert out.index(first_line(result.error_in_exec)) < out.index(label)
    assert "mpdoctor: could not diagnose" not in out
    diagnosis = " ".join(out[out.index(label):].split())  # text wrapping undone
    kind = family(slug).kind
    report = __import__("mpdoctor.attach.crash", fromlist=["explain"]).explain(result.error_in_exec, namespace=ip.user_ns)
    if kind == DTYPE:
        operands = report.cause.evidence["operands"]
        assert " ".join(operands.split()) in diagnosis
        cast = report.cause.evidence["cast"]
        assert cast in out
        # The cast, run in the notebook, makes the failing line run.
        fixed = ip.run_cell(cast.split("  #")[0] + "\n" + cell.strip().splitlines()[-1], store_history=False)
        assert fixed.success, fixed.error_in_exec
    elif kind == PROTOCOL:
        assert family(slug).protocol_rule in diagnosis
        # The loop line: in the cause's sentence, or in the evidence of the check's finding that explains it.
        assert re.search(r"(?:Broken at |loop line=)cell \[\d+\], line \d+:", diagnosis)
    else:
        assert "Refused:" in diagnosis or "At cell [" in diagnosis
    capsys.readouterr()


# -- mpdoctor run: the same explanations after a script's traceback ------------------------------------------

SCRIPT = """
import sys
import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for micro_batch in torch.randn(2, 2, 4):
    scaler.scale(model(micro_batch).sum()).backward()
    if sys.argv[1] == "protocol":
        scaler.unscale_(optimizer)
    else:
        buffer = torch.zeros(2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            values = model(micro_batch)[:, 0]
        buffer[torch.tensor([0, 1])] = values
"""


@pytest.mark.parametrize("which", ["protocol", "dtype"])
def test_mpdoctor_run_explains_a_scripts_family_error_with_the_script_line(tmp_path, which):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # A relative path, as typed: the report redacts long token-like paths such as pytest's temporary directories.
    done = subprocess.run([sys.executable, "-m", "mpdoctor", "run", "train.py", which], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1
    err = "".join(done.stderr.split())  # the report's line wrapping (which may split a path at a hyphen) undone

    def said(text: str) -> bool:
        return "".join(text.split()) in err

    if which == "protocol":
        # `mpdoctor run` first reads the script (the loop reader names the line before it runs); the crash
        # diagnosis then comes after the real traceback.
        crash = err.index("RuntimeError:unscale_()hasalreadybeencalled")
        # One mistake, told once: the crash after the traceback names the mistake the reading showed.
        assert err.index("ERRORamp-unscale-twicetrain.py:11") < crash
        assert err.count("ERRORamp-unscale-twice") == 1
        assert said("this RuntimeError is the amp-unscale-twice mistake at train.py:11, shown above.")
    else:
        assert err.index("RuntimeError:Indexputrequires") < err.index("crash-index-put-dtype")
        assert said("values (bf16, [2]) met buffer (fp32, [2])")
        assert said("values = values.to(buffer.dtype)")
