"""DeepSpeed facts: what a DeepSpeed config, engine or HF/accelerate integration says about precision.

Plain data only (names, refs, flags, dtype names, numbers), so a rank's
DeepSpeed facts can be compared with another rank's, serialised and built by
hand. They are read by :mod:`mpdoctor.libraries.deepspeed.integration` (the one place
that touches DeepSpeed's and the HF integration's semi-private state).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeepSpeedFacts:
    """One DeepSpeed setup: an engine, or a config held by TrainingArguments / an accelerator.

    Attributes
    ----------
    name : str
        What the user holds it by (``engine``, ``args``, ``trainer``).
    source : str
        ``"engine"`` (a live ``DeepSpeedEngine``), ``"trainer"`` / ``"training_args"`` / ``"accelerator"``
        (a config not yet turned into an engine: ``train()`` has not run).
    config_path : str
        The expression that reaches the config dict (``trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config``).
    fp16, bf16 : bool, str or None
        ``fp16.enabled`` / ``bf16.enabled`` as the config holds them (``"auto"`` is kept as the string).
    zero_stage : int or None
        ``zero_optimization.stage``.
    communication_data_type : str or None
        The dtype gradients are reduced in (the engine's, or the config's ``communication_data_type``;
        None: the config leaves it to DeepSpeed's default, the training dtype).
    args_fp16, args_bf16 : bool or None
        What the TrainingArguments / accelerate mixed precision ask for (None without arguments).
    args_name : str or None
        The arguments object's name, for fix code.
    mismatches : tuple of str
        The HF integration's own precision mismatch lines (``- ds bf16.enabled=True vs hf ...``) that
        ``trainer.train()`` will raise with.
    loss_scale, min_loss_scale : float or None
        The fp16 loss scaler's current and minimum scale (engine only).
    dynamic_loss_scale : bool or None
        Whether the loss scale is dynamic.
    loss_scale_hysteresis : int or None
        Overflows still tolerated before the next halving.
    master_dtype : str or None
        dtype of the optimizer's master partitions (``float32`` for DeepSpeed's mixed precision).
    master_partitions : int
        Number of fp32 master partitions (ZeRO groups) the optimizer holds.
    module_dtype : str or None
        The dtype of the wrapped module's floating parameters (engine only; ``mixed`` if several).
    ref, config_ref : int
        Refs in the live table: the object and the config dict.
    config_refs, mismatches_refs : tuple of int
        Every config dict (and HF mismatch list) that has to change together: the arguments' and the
        accelerator's copies.
    device_fp16, device_bf16 : bool or None
        Whether DeepSpeed accepts fp16 / bf16 on the live device or the ``target=`` profile.
    device : str or None
        That device's name.
    args_ref, state_ref : int
        Refs of the TrainingArguments and the ``AcceleratorState`` whose precision goes with the config.
    """

    name: str
    source: str
    config_path: str = ""
    fp16: bool | str | None = None
    bf16: bool | str | None = None
    zero_stage: int | None = None
    communication_data_type: str | None = None
    args_fp16: bool | None = None
    args_bf16: bool | None = None
    args_name: str | None = None
    mismatches: tuple[str, ...] = ()
    loss_scale: float | None = None
    min_loss_scale: float | None = None
    dynamic_loss_scale: bool | None = None
    loss_scale_hysteresis: int | None = None
    master_dtype: str | None = None
    master_partitions: int = 0
    module_dtype: str | None = None
    ref: int = 0
    config_ref: int = 0
    config_refs: tuple[int, ...] = ()
    mismatches_refs: tuple[int, ...] = ()
    device_fp16: bool | None = None
    device_bf16: bool | None = None
    device: str | None = None
    args_ref: int = 0
    state_ref: int = 0

    @property
    def is_engine(self) -> bool:
        """True for a live engine (its config is already in force)."""
        return self.source == "engine"

    @property
    def precision(self) -> str:
        """``"fp16"``, ``"bf16"`` or ``"no"`` as the config enables them (``"auto"`` follows the arguments)."""
        fp16 = self.args_fp16 if self.fp16 == "auto" else self.fp16
        bf16 = self.args_bf16 if self.bf16 == "auto" else self.bf16
        if fp16 is True and bf16 is True:
            return "both"
        if bf16 is True:
            return "bf16"
        if fp16 is True:
            return "fp16"
        return "no"
