"""Lightning precision facts: what a ``Trainer`` / ``Fabric`` was asked for and what its precision plugin runs.

Lightning expresses precision as one plugin object per recipe (``MixedPrecision``,
``HalfPrecision``, ``Precision``, ...). The reads of its state live in
:mod:`mpdoctor.libraries.lightning.integration`; this module holds the plain data and
Lightning's rule for which plugin a request becomes on a device.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Lightning's aliases (``_convert_precision_to_unified_args``): what a short flag means.
ALIASES = {
    "16": "16-mixed",
    "bf16": "bf16-mixed",
    "32": "32-true",
    "64": "64-true",
    "half": "16-true",
    "bf16-true": "bf16-true",
}

#: The warning Lightning 2.x emits when it replaces ``16-mixed`` on a CPU (accelerator connector).
CPU_FALLBACK_WARNING = (
    "You passed `Trainer(accelerator='cpu', precision='16-mixed')` but AMP with fp16 is not supported on CPU. "
    "Using `precision='bf16-mixed'` instead."
)


def unify(flag: str | int | None) -> str | None:
    """A precision flag in Lightning's unified form (``16`` -> ``"16-mixed"``)."""
    if flag is None:
        return None
    text = str(flag)
    return ALIASES.get(text, text)


def lightning_effective(requested: str | None, device: str | None) -> str | None:
    """The precision Lightning 2.x runs for ``requested`` on ``device`` (its connector's rule).

    ``16-mixed`` on a CPU becomes ``bf16-mixed`` (with :data:`CPU_FALLBACK_WARNING`); everything else
    runs as asked.
    """
    requested = unify(requested)
    if requested == "16-mixed" and device == "cpu":
        return "bf16-mixed"
    return requested


@dataclass(frozen=True)
class LightningPrecisionFacts:
    """Requested and effective precision of one Lightning ``Trainer`` or ``Fabric``.

    Attributes
    ----------
    name : str
        The Trainer or Fabric as the user holds it.
    kind : str
        ``"trainer"`` or ``"fabric"``.
    requested : str or None
        The precision flag the accelerator connector holds (``_precision_flag`` / ``_precision_input``).
        Lightning overwrites it when it replaces ``16-mixed`` on a CPU, so it equals the request except in
        that one case; None when it cannot be read.
    effective : str or None
        What the precision plugin runs (``precision_plugin.precision``).
    plugin : str
        The precision plugin's class name.
    input_dtype : str or None
        ``_desired_input_dtype`` of a ``HalfPrecision`` plugin (inputs and the default dtype inside
        ``forward_context``); None for mixed and fp32 plugins.
    scaler_enabled : bool or None
        Whether that scaler is enabled.
    device : str or None
        The accelerator flag the connector resolved (``"cpu"``, ``"cuda"``, ``"mps"``, ...).
    model_names, optimizer_names : tuple of str
        Subjects brought by this Trainer / Fabric.
    planned_optimizer : str or None
        Before ``fit`` (no optimizer yet): the class path of the torch optimizer the LightningModule's
        ``configure_optimizers`` builds, read from its source.
    """

    name: str
    kind: str
    requested: str | None
    effective: str | None
    plugin: str
    input_dtype: str | None = None
    scaler_enabled: bool | None = None
    device: str | None = None
    model_names: tuple[str, ...] = ()
    optimizer_names: tuple[str, ...] = ()
    ref: int = 0
    planned_optimizer: str | None = None

    @property
    def true_half(self) -> str | None:
        """``"bfloat16"`` / ``"float16"`` for ``bf16-true`` / ``16-true`` runs (weights in half), else None."""
        return {"bf16-true": "bfloat16", "16-true": "float16"}.get(self.effective or "")

    @property
    def autocast(self) -> str | None:
        """``"bf16"`` / ``"fp16"`` for the mixed recipes (autocast over fp32 weights), else None."""
        return {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(self.effective or "")
