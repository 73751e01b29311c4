"""Checks on DeepSpeed setups: config precision against the arguments and the device, the fp16 loss scale,
16-bit gradient reduction."""

from __future__ import annotations

import json
from collections.abc import Iterator

from ...facts import Facts
from ...rules.checks import check
from ...rules.engine.changes import SetDeepSpeedConfigKey, SetDeepSpeedPrecision
from ...rules.engine.findings import Finding, Severity
from ...rules.engine.fixes import Fix
from ...rules.engine.rules import Applicability, Rule
from .facts import DeepSpeedFacts


def _flag(value: bool | str | None) -> str:
    return json.dumps(value) if value is not None else "absent"


def _config_code(d: DeepSpeedFacts, fp16: bool, bf16: bool) -> str:
    cfg = f"{d.config_path}.config" if not d.config_path.endswith(".config") else d.config_path
    return (
        "# before trainer.train(): the DeepSpeed config follows the arguments\n"
        f"ds_config = {cfg}\n"
        f"ds_config.setdefault('fp16', {{}})['enabled'] = {fp16}\n"
        f"ds_config.setdefault('bf16', {{}})['enabled'] = {bf16}\n"
        + (
            f"{d.config_path.rsplit('.config', 1)[0]}.mismatches[:] = [m for m in "
            f"{d.config_path.rsplit('.config', 1)[0]}.mismatches if 'fp16.enabled' not in m and 'bf16.enabled' not in m]\n"
            if d.mismatches
            else ""
        )
        + "# in the config file itself, the lasting fix: \"fp16\": {\"enabled\": \"auto\"}, \"bf16\": {\"enabled\": \"auto\"}"
    )


def _align_fix(d: DeepSpeedFacts, fp16: bool, bf16: bool, title: str) -> Fix:
    return Fix(
        title,
        _config_code(d, fp16, bf16), applicability=Applicability.SAFE,
        changes=(SetDeepSpeedPrecision(d.name, d.config_refs, d.mismatches_refs, fp16, bf16),),
        recipe="config-follows-arguments",
        cost="none: the run has not started; the config says what the arguments already say",
    )


def _args_code(d: DeepSpeedFacts, precision: str) -> str:
    args = d.args_name or "args"
    return (
        "import dataclasses\n"
        f"# rebuild the arguments so they ask for what the DeepSpeed config enables\n"
        f"{args} = dataclasses.replace({args}, fp16={precision == 'fp16'}, bf16={precision == 'bf16'})\n"
        "# then rebuild the Trainer from them"
    )


@check("deepspeed-precision-mismatch", Severity.ERROR, fix_safety=(Applicability.SAFE, Applicability.DISPLAY_ONLY))
def deepspeed_precision_mismatch(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A DeepSpeed config enables fp16 and bf16 together, or a precision its TrainingArguments contradict.

    What it does
        Before ``trainer.train()``: a DeepSpeed config (``TrainingArguments(deepspeed=...)``, the accelerator's
        ``DeepSpeedPlugin``) whose ``fp16.enabled`` / ``bf16.enabled`` disagree with ``args.fp16`` /
        ``args.bf16`` (the HF integration's own ``hf_deepspeed_config.mismatches`` lines), or that enables both.
    Why is this bad?
        ``trainer.train()`` raises in ``trainer_config_finalize``: "ValueError: Please correct the following
        DeepSpeed config values that mismatch TrainingArguments values: - ds bf16.enabled=True vs hf
        bf16|bf16_full_eval=False". Both enabled: accelerate refuses the Trainer ("`--mixed_precision` arg
        cannot be set to `bf16` when `fp16` is set in the DeepSpeed config file") and DeepSpeed itself asserts
        "bfloat16 and fp16 modes cannot be simultaneously enabled". Hours of queueing end at step 0.
    Example
        ds_config = {"fp16": {"enabled": True}, "train_micro_batch_size_per_gpu": "auto"}
        args = TrainingArguments(output_dir="out", bf16=True, deepspeed=ds_config)
    Use instead
        ds_config = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
                     "train_micro_batch_size_per_gpu": "auto"}
        args = TrainingArguments(output_dir="out", bf16=True, deepspeed=ds_config)
    Severity
        Error: the run cannot start.
    Fix safety
        In place, before ``train()``: set the config's ``fp16.enabled`` / ``bf16.enabled`` to what the arguments
        ask (what ``"auto"`` would have resolved to) in every copy of the config, and drop the HF mismatch lines
        about them. Alternative (display only): rebuild the arguments to ask for the config's precision.
    Sources
        transformers ``integrations/deepspeed.py`` (``HfTrainerDeepSpeedConfig.fill_match``,
        ``trainer_config_finalize``); accelerate ``DeepSpeedPlugin.set_mixed_precision``; DeepSpeed
        ``runtime/config.py``; MedicalGPT #191, BELLE #154, GOT-OCR2.0 #134, Arctic-Platform #78.
    """
    for d in facts.deepspeed:
        if d.is_engine:
            continue
        both = d.fp16 is True and d.bf16 is True
        want_fp16, want_bf16 = bool(d.args_fp16), bool(d.args_bf16)
        if not (both or d.mismatches or _args_contradict(d)):
            continue
        if want_fp16 and want_bf16:
            continue  # the arguments contradict themselves: transformers refuses them first
        asked = "fp16" if want_fp16 else "bf16" if want_bf16 else "fp32"
        config = "fp16 and bf16" if both else "fp16" if d.fp16 is True else "bf16" if d.bf16 is True else "fp32"
        lines = list(d.mismatches) or [f"- ds fp16.enabled={_flag(d.fp16)}, bf16.enabled={_flag(d.bf16)}"]
        fixes = [_align_fix(d, want_fp16, want_bf16, f"Make {d.name}'s DeepSpeed config follow the arguments ({asked})")]
        if not both and config != "fp32":
            fixes.append(
                Fix(
                    f"Rebuild the arguments with {config} (the config's precision)",
                    _args_code(d, config),
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="arguments-follow-config",
                )
            )
        yield rule.finding(
            d.name,
            _mismatch_message(d, config, asked, lines),
            {"config_fp16": d.fp16, "config_bf16": d.bf16, "args_fp16": d.args_fp16, "args_bf16": d.args_bf16,
             "mismatches": lines, "config": d.config_path},
            fixes,
        )


def _args_contradict(d: DeepSpeedFacts) -> bool:
    """True when the config sets fp16 or bf16 to the opposite of what the arguments ask."""
    wants = ((d.fp16, bool(d.args_fp16)), (d.bf16, bool(d.args_bf16)))
    return d.args_fp16 is not None and any(value in (True, False) and value != want for value, want in wants)


def _mismatch_message(d: DeepSpeedFacts, config: str, asked: str, lines: list[str]) -> str:
    """What transformers or DeepSpeed will raise for a config that contradicts the arguments or itself."""
    where = "arguments" if d.args_name else "accelerator's mixed precision"
    return (
        f"{d.name}'s DeepSpeed config enables {config} while its {where} ask for {asked}: "
        + ("trainer.train() will raise 'Please correct the following DeepSpeed config values that mismatch "
           f"TrainingArguments values: {' '.join(lines)}'." if d.mismatches else
           "DeepSpeed refuses both at once ('bfloat16 and fp16 modes cannot be simultaneously enabled').")
    )  # fmt: skip


def _precision_code(d: DeepSpeedFacts, use: str) -> str:
    args = d.args_name or "args"
    section = {"fp16": {"enabled": use == "fp16"}, "bf16": {"enabled": use == "bf16"}}
    lines = ["# the DeepSpeed config (file or dict): " + json.dumps(section)[1:-1]]
    if d.args_name or not d.is_engine:
        lines.insert(0, "import dataclasses")
        lines.append(f"{args} = dataclasses.replace({args}, fp16={use == 'fp16'}, bf16={use == 'bf16'})")
        lines.append("# then rebuild the Trainer (or Accelerator) and the engine from them")
    else:
        lines.append(f"{d.name}, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config, ...)  # a new engine")
    return "\n".join(lines)


@check("deepspeed-precision-unsupported", Severity.ERROR, fix_safety=(Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
def deepspeed_precision_unsupported(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A DeepSpeed config or engine in fp16 or bf16 that DeepSpeed refuses on this device (or the target).

    What it does
        A DeepSpeed setup (engine, or a config not yet trained) whose precision DeepSpeed's accelerator does
        not accept on the live device or the ``target=`` profile: fp16 on a CPU without oneDNN fp16 (this
        machine), bf16 on a GPU below compute capability 8.0 (V100, T4, P100, RTX 20xx).
    Why is this bad?
        ``deepspeed.initialize`` (``trainer.train()``) raises "ValueError: Type fp16 is not supported on your
        device." / "Type bf16 is not supported on your device." in ``_do_sanity_check``, after the model is
        built and the processes have joined.
    Example
        # on a CPU
        ds_config = {"fp16": {"enabled": True}}
        args = TrainingArguments(output_dir="out", fp16=True, deepspeed=ds_config)
    Use instead
        # on a CPU: bf16
        ds_config = {"bf16": {"enabled": True}}
        args = TrainingArguments(output_dir="out", bf16=True, deepspeed=ds_config)
    Severity
        Error: the engine cannot be created.
    Fix safety
        The precision the device has (bf16 on a CPU, fp16 with its dynamic loss scale on a V100/T4; fp32 where
        neither). Before ``train()`` on the live machine, in place (unsafe: it changes the numerics): the
        DeepSpeed config, the arguments' ``fp16`` / ``bf16`` / ``mixed_precision`` and the accelerator's mode
        switch together. For an engine or a ``target=`` what-if, display only: the config and arguments to
        rebuild with.
    Sources
        DeepSpeed ``runtime/engine.py`` (``_do_sanity_check``), ``accelerator/cpu_accelerator.py``
        (``is_fp16_supported``: ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``); NVIDIA compute capabilities.
    """
    for d in facts.deepspeed:
        precision = d.precision
        ok = {"fp16": d.device_fp16, "bf16": d.device_bf16}.get(precision)
        if ok is not False:
            continue
        use = "bf16" if d.device_bf16 else "fp16" if d.device_fp16 else "no"
        device = d.device or "this device"
        label = use if use != "no" else "fp32"
        fixes = []
        if not d.is_engine and d.args_ref and facts.hardware.live:
            # Before train(), on this machine: the config, the arguments and the accelerator switch together.
            spec = SetDeepSpeedPrecision(d.name, d.config_refs, d.mismatches_refs, use == "fp16", use == "bf16",
                                         d.args_ref, d.state_ref)
            fixes.append(Fix(
                f"Switch {d.name} to {label} (DeepSpeed config, arguments and accelerator)",
                _config_code(d, use == "fp16", use == "bf16")
                + f"\n{d.args_name}.fp16, {d.args_name}.bf16 = {use == 'fp16'}, {use == 'bf16'}"
                + f"\n{d.args_name}.mixed_precision = {use!r}", applicability=Applicability.UNSAFE,
                changes=(spec,),
                recipe=f"precision-{use}",
                cost=f"numerics: {label} instead of {precision}",
            ))
        fixes.append(Fix(
            f"Train {d.name} in {label} (what {device} supports)",
            _precision_code(d, use),
            applicability=Applicability.DISPLAY_ONLY,
            recipe=f"rebuild-{use}",
        ))
        yield rule.finding(
            d.name,
            f"{d.name} runs DeepSpeed in {precision}, which DeepSpeed refuses on {device}: "
            f"deepspeed.initialize raises 'ValueError: Type {precision} is not supported on your device.'. "
            f"Use {label} instead.",
            {"precision": precision, "device": device, "device_fp16": d.device_fp16, "device_bf16": d.device_bf16,
             "config": d.config_path},
            fixes,
        )


@check("deepspeed-loss-scale-collapsed", Severity.ERROR, fix_safety=(Applicability.DISPLAY_ONLY,))
def deepspeed_loss_scale_collapsed(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A DeepSpeed fp16 dynamic loss scale that has fallen to its minimum.

    What it does
        The fp16 loss scaler of a DeepSpeed engine's optimizer (``DynamicLossScaler``) whose current scale equals
        ``min_loss_scale``, with no hysteresis left: every step so far overflowed.
    Why is this bad?
        The next overflowing step raises "Exception: Current loss scale already at minimum - cannot decrease
        scale anymore. Exiting run."; until then every overflowing step is skipped, so the model stops
        learning. The usual cause is a checkpoint trained in bf16 whose activations exceed fp16's 65504.
    Example
        ds_config = {"fp16": {"enabled": True}, "train_micro_batch_size_per_gpu": 8}
        # the loss scale has fallen to its minimum: every step overflows
    Use instead
        ds_config = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 8}
    Severity
        Error: the run is skipping its updates and will end at the next overflow.
    Fix safety
        Display only (the engine must be rebuilt): train in bf16 (``"bf16": {"enabled": true}``) on a device
        that has it; where none does, fp32, or fp16 with a lower ``initial_scale_power`` and checks on the data.
    Sources
        DeepSpeed ``runtime/fp16/loss_scaler.py`` (``DynamicLossScaler.update_scale``); Chinese-LLaMA-Alpaca
        #534, Firefly #68 ("enable bf16, matching the pretraining precision"), ms-swift #4374.
    """
    for d in facts.deepspeed:
        if not d.dynamic_loss_scale or d.loss_scale is None or d.min_loss_scale is None:
            continue
        if d.loss_scale > d.min_loss_scale or (d.loss_scale_hysteresis or 1) > 1:
            continue
        use = "bf16" if d.device_bf16 else "fp32"
        yield rule.finding(
            d.name,
            f"{d.name}'s fp16 loss scale is at its minimum ({d.loss_scale:g}): steps keep overflowing and are "
            "skipped, and the next overflow ends the run with 'Current loss scale already at minimum - cannot "
            f"decrease scale anymore. Exiting run.'. Train in {use} instead of fp16.",
            {"loss_scale": d.loss_scale, "min_loss_scale": d.min_loss_scale, "hysteresis": d.loss_scale_hysteresis},
            [
                Fix(
                    f"Rebuild {d.name} in {use}",
                    "# deepspeed.initialize fixes an engine's precision; mpdoctor does not rebuild an engine\n"
                    "# the DeepSpeed config:\n"
                    + ("#   \"fp16\": {\"enabled\": false}, \"bf16\": {\"enabled\": true}\n" if use == "bf16" else
                       "#   \"fp16\": {\"enabled\": false}\n")
                    + f"{d.name}, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe=f"rebuild-{use}",
                )
            ],
        )


_HALF = ("float16", "bfloat16")


@check("deepspeed-low-precision-reduction", Severity.WARNING, Severity.INFO, fix_safety=(Applicability.SAFE, Applicability.DISPLAY_ONLY))
def deepspeed_low_precision_reduction(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """DeepSpeed reducing gradients in 16 bits: fp16 under bf16 training (warning), or the 16-bit default (info).

    What it does
        A DeepSpeed setup whose ``communication_data_type`` is fp16 while it trains in bf16 (or fp32), and, as
        information, a ZeRO setup that reduces gradients in its 16-bit training dtype (DeepSpeed's default when
        ``communication_data_type`` is unset).
    Why is this bad?
        fp16 holds nothing above 65504: bf16 gradients cast to fp16 for the all-reduce turn into inf and the
        overflow check skips the step (DeepSpeed #2071: "FP16 used for all reduce even if BFLOAT16 is enabled").
        A reduction in the training dtype itself is DeepSpeed's standard recipe: it halves the bytes on the wire
        and sums ranks in 8 (bf16) or 11 (fp16) mantissa bits, a rounding that grows with the number of ranks.
    Example
        ds_config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
        # gradients are averaged across ranks in bf16
    Use instead
        ds_config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                     "communication_data_type": "fp32"}
    Severity
        Warning for fp16 reduction of bf16 or fp32 training (measurable: large gradients become inf); info for
        the 16-bit default (true, harmless at a few ranks; reconsider at hundreds).
    Fix safety
        Before ``train()``, in place: ``communication_data_type: "fp32"`` in the config (safe for the warning).
        Cost: twice the gradient bytes on the wire. For a live engine the ZeRO optimizer has already captured the
        dtype: the code says what to put in the config before ``deepspeed.initialize``.
    Sources
        DeepSpeed ``runtime/engine.py`` (``communication_data_type``), ``runtime/zero/stage_1_and_2.py``;
        DeepSpeed issue #2071, PR #3370; Megatron-LM #372.
    """
    for d in facts.deepspeed:
        comm = d.communication_data_type
        precision = d.precision
        if precision == "both":
            continue
        training = {"fp16": "float16", "bf16": "bfloat16"}.get(precision, "float32")
        if comm is None:
            comm = training  # DeepSpeed's default: the training dtype
        if comm not in _HALF:
            continue
        narrower = comm == "float16" and training != "float16"
        if not narrower and (d.zero_stage is None or d.zero_stage < 1):
            continue
        code = (
            f"{d.config_path}.config['communication_data_type'] = 'fp32'  # before trainer.train()"
            if not d.is_engine
            else "# in the DeepSpeed config, before deepspeed.initialize:\n#   \"communication_data_type\": \"fp32\""
        )
        fix_kw: dict = {"recipe": "fp32-reduction", "cost": "2x gradient bytes on the wire"}
        if d.is_engine or not narrower:
            # Information only: the standard recipe; the fp32 option is shown with its cost, not planned.
            fixes = [Fix("Reduce gradients in fp32" + (" (config, then rebuild the engine)" if d.is_engine else ""), code,
                         applicability=Applicability.DISPLAY_ONLY, **fix_kw)]
        else:
            fixes = [Fix(f"Reduce {d.name}'s gradients in fp32", code, applicability=Applicability.SAFE,
                         changes=(SetDeepSpeedConfigKey(d.name, d.config_refs, "communication_data_type", "fp32"),), **fix_kw)]
        if narrower:
            message = (
                f"{d.name} trains in {precision if precision != 'no' else 'fp32'} but reduces gradients in fp16 "
                "(communication_data_type): any gradient above 65504 becomes inf in the all-reduce and the step is "
                "skipped. Reduce in fp32 (or bf16)."
            )
        else:
            message = (
                f"{d.name} (ZeRO stage {d.zero_stage}) reduces gradients in {comm.replace('bfloat16', 'bf16').replace('float16', 'fp16')}, "
                "DeepSpeed's default: half the bytes of fp32, summed with a 16-bit mantissa. Fine at a few ranks; "
                "'communication_data_type': 'fp32' costs 2x the gradient traffic."
            )
        yield rule.finding(
            d.name,
            message,
            {"communication_data_type": comm, "training": training, "zero_stage": d.zero_stage},
            fixes,
            severity=Severity.WARNING if narrower else Severity.INFO,
        )
