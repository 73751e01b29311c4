"""The support matrix's corners: what each runs and what it leaves out, with the reason. The one place that says so.

``make test`` runs the whole suite in ``.venv`` (the *pinned* corner) and then each corner here in its own venv
with ``MPDOCTOR_CORNER=<name>``: ``tests/conftest.py`` reads this table, collects only the corner's ``runs``
and deselects its ``excluded`` tests, naming each with its reason in the summary. ``docs/support-matrix.md``
shows the same table to users.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Corner:
    """One corner of the support matrix.

    Attributes
    ----------
    name : str
        The value of ``MPDOCTOR_CORNER``, and the venv's suffix (``.venv-<name>``).
    versions : str
        What the corner installs, for the summary and the docs.
    runs : tuple of str
        Test paths (files or folders, relative to the repository) the corner collects; empty for all.
    excluded : dict
        Test path or node id prefix -> why this corner cannot hold it.
    """

    name: str
    versions: str
    runs: tuple[str, ...] = ()
    excluded: dict[str, str] = field(default_factory=dict)


#: What a version corner must prove: core diagnosis, the fixes, the loop watcher, the crash hook, the exception
#: catalogue, the magic, and the compatibility module. The rest of the suite (renderers, widgets, notebooks,
#: benchmarks, the training stack) does not depend on these versions beyond what these tests reach.
CORE = (
    "tests/test_compat.py",
    "tests/test_core_api.py",
    "tests/test_checks_dtypes.py",
    "tests/test_checks_precision.py",
    "tests/test_checks_scaler_cache.py",
    "tests/test_integrations.py",
    "tests/field/test_torch_core.py",
    "tests/field/test_transformers_core.py",
    "tests/field/test_peft_accelerate_core.py",
    "tests/test_treatment.py",
    "tests/test_fix_safety.py",
    "tests/test_runtime_protocol.py",
    "tests/field/test_runtime_protocol_cases.py",
    "tests/test_crash_watch.py",
    "tests/test_crash_hook.py",
    "tests/test_crash_patterns.py",
    "tests/test_exception_families.py",
    "tests/field/test_exception_cases.py",
    "tests/test_magic.py",
)

#: Test paths only one corner collects: what it holds needs a library only that corner installs. ``path -> (corner,
#: why)``; every other corner (the pinned one included) leaves the path out and names it in its summary.
CORNER_ONLY: dict[str, tuple[str, str]] = {
    "tests/corner_newest": (
        "newest",
        "timm imports torchvision, and the torchvision beside the pinned torch 2.13.0+cpu is a CUDA build that does "
        "not import ('operator torchvision::nms does not exist'); the newest corner's torch 2.14.1 and torchvision "
        "0.29.1 are a matching pair",
    ),
}

#: The numerics-sensitive tests: they compute in bf16 / fp16 / fp8 on this CPU and compare what came out (the field
#: cases' measured harm, the emulation's oracles, the probe's ranges, the proof's "trained"). Which kernels a CPU
#: has (AVX512-BF16, AMX, AVX2 only) changes their roundings; the ``kernels`` corner runs them again under forced
#: capabilities, so a test that holds only on the developer's kernels fails here, not on a user's machine.
KERNELS = (
    "tests/test_kernels.py",
    "tests/field",
    "tests/stack/test_field_lowprecision.py",
    "tests/stack/test_field_bnb_torchao.py",
    "tests/stack/test_field_diffusers.py",
    "tests/stack/test_bf16_update_loss.py",
    "tests/stack/test_compare_oracles.py",
    "tests/stack/test_compare_plan_torchao.py",
    "tests/stack/test_lowprecision_healthy.py",
    "tests/stack/test_lowprecision_readers.py",
    "tests/test_compare.py",
    "tests/test_compare_attention.py",
    "tests/test_compare_plan.py",
    "tests/test_compare_steps.py",
    "tests/test_probe.py",
    "tests/test_nan_origin.py",
    "tests/test_scan.py",
    "tests/test_cures.py",
    "tests/test_healthy_recipes.py",
    "tests/test_checks_optimizer.py",
    "tests/test_between_steps.py",
    "tests/test_proof.py",
    "tests/test_proof_places.py",
    "tests/test_proof_honesty.py",
)

#: What Colab's stack changes is IPython (7.34), ipywidgets (7.7.1) and ipykernel: its Python, torch and transformers
#: are the pinned corner's (``constraints-colab.txt``). So the Colab corner runs the test files that reach one of those
#: (a shell, a widget, a renderer, the magic, a notebook), found by reading each file's source; every other test would
#: run there exactly as it runs in the pinned corner.
_REACHES_COLABS_STACK = re.compile(
    r"IPython|ipywidgets|notebook_shell|InteractiveShell|[Ww]idget|from cure |import cure|render|to_html|_repr_"
    r"|mark\.colab|get_ipython|magic"
)


def _colab_relevant() -> tuple[str, ...]:
    """The test files (``tests/`` and ``tests/field/``) whose source reaches IPython, ipywidgets or a renderer."""
    root = Path(__file__).resolve().parent
    files = sorted([*root.glob("test_*.py"), *(root / "field").glob("test_*.py")])
    return tuple(f"tests/{f.relative_to(root).as_posix()}" for f in files
                 if _REACHES_COLABS_STACK.search(f.read_text(encoding="utf-8")))  # fmt: skip


COLAB = _colab_relevant()

#: The forced CPU capabilities the ``kernels`` corner runs under: ``ATEN_CPU_CAPABILITY`` with oneDNN limited to
#: match (``ONEDNN_MAX_CPU_ISA``), so neither torch's own kernels nor oneDNN's use what the CPU has beyond it.
KERNEL_CAPABILITIES = {"default": "SSE41", "avx2": "AVX2"}

CORNERS: dict[str, Corner] = {
    c.name: c
    for c in (
        Corner(
            "oldest",
            "Python 3.10, torch 2.4.0, transformers 4.50.0, accelerate 1.0.0, peft 0.13.0, IPython 7.34.0, "
            "ipywidgets 7.6.0 (constraints-oldest.txt)",
            runs=CORE,
            excluded={
                # Tests written against transformers >= 4.56 / 5.x APIs that 4.50 does not have.
                "tests/field/test_transformers_core.py::test_from_pretrained_in_bf16_keeps_the_frequencies_fp32_and_draws_nothing":
                    "calls from_pretrained(dtype=...), transformers >= 4.56's spelling (torch_dtype before)",
                "tests/field/test_transformers_core.py::test_flash_attention_2_on_fp32_weights_is_named_before_the_gpu_refuses_it":
                    "calls model.set_attn_implementation(), which transformers 4.50 does not have",
                "tests/test_checks_dtypes.py::test_a_model_loaded_in_its_checkpoint_dtype_is_not_reported":
                    "reads config.dtype, transformers >= 4.56's name (torch_dtype before)",
                "tests/test_checks_precision.py::test_stale_fp16_env_reproduces_and_on_this_cpu_is_a_warning_an_error_on_a_gpu_target":
                    "reads TrainingArguments.mixed_precision, a transformers 5 attribute",
                "tests/test_checks_precision.py::test_lone_training_arguments_built_under_a_stale_env_are_reported_and_fixed":
                    "reads TrainingArguments.mixed_precision, a transformers 5 attribute",
                "tests/test_checks_precision.py::test_training_arguments_read_the_env_var_but_transformers_5_does_not_write_it_back":
                    "transformers 5's behaviour: 4.50 writes ACCELERATE_MIXED_PRECISION back",
                "tests/test_checks_scaler_cache.py::test_transformers_5_checkpointing_sets_the_module_flag_the_fact_reads[activation_checkpointing_enable]":
                    "activation_checkpointing_enable() is transformers 5's",
                "tests/test_checks_scaler_cache.py::test_checkpointing_with_the_cache_on_is_info_for_transformers_which_drops_the_cache_itself":
                    "calls activation_checkpointing_enable(), transformers 5's",
                "tests/test_crash_patterns.py::test_a_real_mixed_precision_failure_is_explained_with_its_cause_first[training_args_bf16_without_gpu]":
                    "transformers 4.50 accepts TrainingArguments(bf16=True) without a GPU: the refusal it reproduces is 5.x's",
                "tests/test_exception_families.py::test_in_a_notebook_the_hook_explains_each_family_and_its_cast_makes_the_line_run[crash-rnn-dtype]":
                    "torch 2.4's oneDNN has no bf16 LSTM forward on this CPU ('could not create a primitive descriptor "
                    "for an LSTM forward propagation primitive'): the error is explained, but the cast line cannot run",
                # torch 2.4 words this error differently (test_exception_families.RAISED_ON_OTHER_TORCH).
                "tests/test_exception_families.py::test_the_real_error_is_explained_with_its_tensors_and_cast_or_its_rule_and_line[matmul_mv]":
                    "torch 2.4 words torch.mv's error 'expected scalar type Float but found BFloat16': explained by the "
                    "scalar-type family, not the matmul family the test names",
                # The watcher on torch 2.4 / 2.5 (docs/support-matrix.md).
                "tests/test_runtime_protocol.py::test_clipping_before_unscale_shrinks_every_step_to_max_norm_over_scale_and_is_named_at_its_line":
                    "calls a clip_grad_norm_ imported by name before the watch: torch < 2.6 clips inside that function, "
                    "so the watcher sees only calls through torch.nn.utils (tests/test_compat.py proves those)",
                # What transformers 4.50 itself erases before mpdoctor can read it.
                "tests/test_checks_dtypes.py::test_a_bf16_checkpoint_held_in_fp32_for_inference_is_info_with_an_unsafe_cast":
                    "transformers 4.50 loads in fp32 by default and rewrites config.torch_dtype to the dtype it loaded in: the checkpoint's bf16 is no longer on the live model for the check to read",
                "tests/test_checks_dtypes.py::test_fp32_master_weights_of_a_bf16_checkpoint_under_an_optimizer_are_info_without_a_fix":
                    "transformers 4.50 loads in fp32 by default and rewrites config.torch_dtype to the dtype it loaded in: the checkpoint's bf16 is no longer on the live model for the check to read",
                "tests/test_treatment.py::test_applying_every_planned_fix_in_order_leaves_a_setup_that_trains_without_errors[launcher_fp8_beaten_by_bf16]":
                    "transformers 4.50's TrainingArguments(bf16=True) writes ACCELERATE_MIXED_PRECISION=bf16 back over the launcher's fp8: the request is gone from the environment the check reads",
                "tests/test_treatment.py::test_applying_every_planned_fix_in_order_leaves_a_setup_that_trains_without_errors[launcher_fp8_arguments_before_the_trainer]":
                    "transformers 4.50's TrainingArguments(bf16=True) writes ACCELERATE_MIXED_PRECISION=bf16 back over the launcher's fp8: the request is gone from the environment the check reads",
            },
        ),
        Corner(
            "newest",
            "Python 3.13, torch 2.14.1, transformers 5.24.0, accelerate 1.15.0, peft 0.21.2, IPython 9.18.1, "
            "ipywidgets 8.1.9, timm 1.0.31 with torchvision 0.29.1 (constraints-newest.txt)",
            runs=(*CORE, "tests/test_notebooks.py::test_notebook_runs_top_to_bottom_and_its_claims_hold[04_cache_in_training]",
                  "tests/corner_newest"),
            excluded={},
        ),
        Corner(
            "kernels",
            "the pinned venv under forced CPU kernels, each in turn: ATEN_CPU_CAPABILITY=default with "
            "ONEDNN_MAX_CPU_ISA=SSE41, and ATEN_CPU_CAPABILITY=avx2 with ONEDNN_MAX_CPU_ISA=AVX2",
            runs=KERNELS,
            excluded={},
        ),
        Corner(
            "colab",
            "Python 3.11, torch 2.13.0, transformers 5.23.0, IPython 7.34.0, ipywidgets 7.7.1, ipykernel 6.17.1 "
            "(constraints-colab.txt)",
            runs=COLAB,
            excluded={
                "tests/stack": "the training stack beyond transformers (Lightning, DeepSpeed, torchao, ...) is "
                "installed in .venv only",
                "tests/distributed": "multi-process jobs of the training stack, installed in .venv only",
                "tests/test_browser.py": "needs JupyterLab and Playwright, installed in .venv only",
                "tests/test_contrast.py::test_the_theme_values_measured_are_jupyterlab_s_own":
                    "reads JupyterLab's own theme CSS, and JupyterLab is installed in .venv only",
                "tests/test_binder.py": "builds Binder's environment with .venv's JupyterLab",
                "tests/test_bench_smoke.py": "the benchmarks measure the pinned stack, in .venv",
                "tests/test_proof_mutations.py": "mutates mpdoctor's own proof code and runs tests against the copy: "
                "the pinned corner proves every mutation is killed, and the stack its killers need is in .venv only",
                "tests/test_loop_accumulation.py::test_a_plain_script_calling_diagnose_is_read_for_its_loop_named_at_its_line_fixed_and_trains":
                    "runs a script in a subprocess (python train.py): no IPython or ipywidgets in it, nothing Colab's stack changes",
                "tests/test_loop_accumulation.py::test_mpdoctor_run_counts_the_loops_backward_calls_per_step_whatever_its_guard_and_the_fix_trains":
                    "runs a script in a subprocess (mpdoctor run): no IPython or ipywidgets in it, nothing Colab's stack changes",
                "tests/test_loop_accumulation.py::test_healthy_twins_in_a_script_draw_nothing":
                    "runs scripts in subprocesses: no IPython or ipywidgets in them, nothing Colab's stack changes",
                "tests/field/test_between_steps_cases.py::test_lightning_18620_epoch_mean_in_bf16_is_wrong_then_set_dtype_fixes_it_and_the_step_trains":
                    "torchmetrics (Lightning's metrics library) is installed in .venv only",
                "tests/field/test_between_steps_cases.py::test_lightning_18620_through_the_widget_button":
                    "torchmetrics (Lightning's metrics library) is installed in .venv only",
                "tests/field/test_between_steps_cases.py::test_xla_2425_a_bf16_running_loss_sum_stops_growing_then_is_fixed_in_place":
                    "torchmetrics (Lightning's metrics library) is installed in .venv only",
                "tests/field/test_between_steps_cases.py::test_healthy_twin_metric_states_kept_fp32_after_the_cast_draw_nothing":
                    "torchmetrics (Lightning's metrics library) is installed in .venv only",
                "tests/test_between_steps.py::test_model_half_leaves_metric_states_fp32_and_draws_nothing_but_model_to_bf16_casts_them":
                    "torchmetrics (Lightning's metrics library) is installed in .venv only",
                "tests/test_between_steps.py::test_a_metric_held_alone_and_inside_a_model_is_one_finding":
                    "torchmetrics (Lightning's metrics library) is installed in .venv only",
                "tests/test_between_steps.py::test_the_metric_fix_is_undone_exactly_and_applying_it_twice_changes_nothing_more":
                    "torchmetrics (Lightning's metrics library) is installed in .venv only",
                "tests/test_between_steps.py::test_diagnosing_changes_nothing_it_reads":
                    "torchmetrics (Lightning's metrics library) is installed in .venv only",
            },
        ),
    )
}


def current() -> Corner | None:
    """The corner this test run is, from ``MPDOCTOR_CORNER``; None for the pinned corner (the whole suite)."""
    name = os.environ.get("MPDOCTOR_CORNER", "")
    if not name:
        return None
    if name not in CORNERS:
        raise ValueError(f"MPDOCTOR_CORNER={name!r}: the corners are {', '.join(CORNERS)}")
    return CORNERS[name]
