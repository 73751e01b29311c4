"""Intent, as plain data: fp32 islands a model keeps on purpose, and the averaged (EMA) copies beside it.

An :class:`Island` is a part of a model that is not on its compute path at all (an EMA / averaged copy, a metric,
a frozen copy of a sibling), read from the live objects by :mod:`mpdoctor.objects.readers.intent`. A :class:`ShadowFacts`
is one EMA or weight-averaging object (torch's ``AveragedModel``, diffusers' ``EMAModel``, ema-pytorch's ``EMA``, timm's ``ModelEmaV3``)
with what one of its updates loses in its storage dtype, measured on its own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Island:
    """A submodule kept apart from the model's compute path on purpose, with the evidence quoted.

    ``kind`` is ``"averaged-copy"`` (an EMA / averaged copy), ``"metric"`` (a torchmetrics metric),
    ``"shadow-copy"`` (a frozen copy of a sibling), ``"cast-island"`` (a submodule whose forward hooks cast its
    input to its dtype and its output back: a ReFT intervention kept fp32) or ``"kept-in-fp32"`` (an fp32 parameter the library's
    ``_keep_in_fp32_modules`` names; ``path`` is then the parameter's). ``path`` is the submodule's path in the
    model ("" for the model itself); ``param_ids`` its parameters, so a check can ask whether an optimizer holds
    them (a frozen copy no optimizer holds is a shadow, not a layer).
    """

    path: str
    kind: str
    evidence: str
    param_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class ShadowFacts:
    """One EMA / weight-averaging object: where its shadow tensors live, their dtypes, its decay and the harm.

    ``lost_share`` is measured: one real update of a copy of the shadow tensors toward the online model's
    parameters, in the shadow's dtype and in fp32; it is the share of elements fp32 changes that the shadow's
    dtype leaves unchanged (None when no online model was found, or the two are still equal). ``min_gap`` is
    exact arithmetic from the decay and the dtype: how far (relative to a weight) the online weight must be from
    the shadow for an update to register at all.
    """

    name: str
    ref: int
    kind: str  # "averaged-model" (torch), "ema-model" (diffusers), "ema-pytorch", "timm", "hand-written" (a model the code averages)
    class_path: str
    #: What the user types to reach the shadow tensors (``ema.module``, ``ema.ema_model``, ``ema.shadow_params``).
    shadow_path: str
    shadow_dtypes: tuple[str, ...]
    shadow_elements: int
    low_elements: int
    decay: float | None
    #: The update takes one dtype on both sides (``torch._foreach_lerp_``, ``Tensor.lerp_``): an fp32 shadow of a
    #: bf16 model then raises unless the online tensors are cast first (ema-pytorch's ``coerce_dtype``).
    same_dtype_update: bool = False
    coerce_dtype: bool | None = None
    #: The library rounds a bf16 shadow's update stochastically (timm's ``ModelEmaV3``): updates register in
    #: expectation, so round-to-nearest's lost share does not apply to its bf16 tensors.
    stochastic_rounding: bool = False
    #: The online model as a path the facts know (a model's name, or a path inside one: ``ema.online_model``).
    source: str | None = None
    #: The user's own name for it (``net``, where ``net = ema.online_model``): what the messages and the code say.
    source_name: str | None = None
    source_dtypes: tuple[str, ...] = ()
    lost_share: float | None = None
    changed_in_fp32: int = 0
    min_gap: float | None = None
    #: A hand-written update: the statement as the user wrote it, where (``cell [4]``), and its op (``lerp_``,
    #: ``lerp_cast``, ``mul_add``: see :class:`mpdoctor.objects.readers.ema_code.EmaUpdate`).
    update_line: str | None = None
    update_where: str | None = None
    update_op: str | None = None
    #: A hand-written ``lerp_`` update: the user's function or top-level loop holding it, runnable, with the
    #: online weight cast to fp32 (None where it sits inside a larger loop).
    update_fixed: str | None = None
