"""Facts: frozen, plain snapshots of everything checks look at.

No live object is held here (a fact that points at one holds its *ref*, an int, into the
:class:`~mpdoctor.objects.live.Live` table), so a check is a pure function of data, facts can be built by hand (a
V100, an 8-rank job), compared, serialised and simulated. This package imports no integration and reads no
live object: :mod:`mpdoctor.objects.readers` read one object into its facts, :mod:`mpdoctor.objects.gathering` walks the
subjects and asks the integrations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .configs import ConfigFacts
from .hardware import DeviceProfile
from .optimizer import OptimizerFacts
from .precision import PrecisionFacts, TorchStateFacts
from .scaler import ScalerFacts, ScalerStateFacts
from .tensors import ModuleTensors, TensorTally

__all__ = [
    "ConfigFacts",
    "DeviceProfile",
    "Facts",
    "ModelFacts",
    "OptimizerFacts",
    "PrecisionFacts",
    "ScalerFacts",
    "SubjectFacts",
    "TorchStateFacts",
]


@dataclass(frozen=True)
class SubjectFacts:
    """An inspected object as plain data: its kind, the name the user knows it by, its ref in the live table.

    ``inner_ref`` / ``inner_path`` point at the object inside wrappers (the
    network inside DDP / ``torch.compile`` / PEFT, the optimizer inside
    accelerate's wrapper); ``aliases`` are other names the user holds it, or
    a part of it, by.
    """

    kind: str
    name: str
    ref: int
    inner_ref: int
    inner_path: str
    owner: str | None
    class_name: str
    class_path: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelFacts:
    """Everything about one model.

    ``forward_wrapped`` is True when accelerate replaced ``forward`` with its
    autocast + fp32-output-conversion wrapper (``_original_forward`` is set).
    """

    name: str
    config_path: str
    class_name: str
    class_path: str
    inner_class: str
    training: bool
    tensors: ModuleTensors
    configs: tuple[ConfigFacts, ...]
    forward_wrapped: bool
    is_peft: bool
    is_pretrained: bool
    #: Refs of the model (as the user holds it) and of the network inside its wrappers.
    ref: int = 0
    inner_ref: int = 0
    #: accelerate's ``prepare()`` has seen this model (it will not wrap ``forward`` again).
    accelerate_prepared: bool = False
    #: transformers' ``_supports_sdpa`` of the network (None when not a transformers model).
    supports_sdpa: bool | None = None
    #: transformers' ``_keep_in_fp32_modules`` (and ``_strict``): module names its modeling code keeps
    #: in fp32 and casts around on purpose.
    keep_in_fp32: tuple[str, ...] = ()
    #: The subject this model was reached through (``pipe`` for ``pipe.vae``), None for a top-level model.
    owner: str | None = None
    #: bitsandbytes quantized layers (:class:`~mpdoctor.facts.quantized.LowBitLayer`), from the bitsandbytes integration.
    low_bit_layers: tuple = ()
    #: torchao float8 training layers (:class:`~mpdoctor.facts.fp8_training.Float8Layer`), from the torchao integration.
    float8_layers: tuple = ()
    #: torch's own ``nn.Linear`` layers below the root, as ``(path, in_features, out_features)``: what a float8
    #: training conversion could swap (read by the torchao integration while torchao is imported).
    float8_candidates: tuple[tuple[str, int, int], ...] = ()
    #: Modules whose own weights are stored in float8 / float4 and what upcasts them
    #: (:class:`~mpdoctor.facts.quantized.StoredLayer`), from the float8 storage reader.
    stored_layers: tuple = ()
    #: Layers whose weight is a torchao quantized tensor (:class:`~mpdoctor.facts.quantized.QuantizedWeight`).
    quantized_weights: tuple = ()
    #: A diffusers component's class and precision flags (:class:`~mpdoctor.libraries.diffusers.facts.ComponentFacts`), or None.
    component: object = None
    #: Rotary-embedding frequency buffers held in half precision, as ``(module path, class name, dtype,
    #: phase error in radians at the last position, positions)``; read by the transformers integration.
    rope_buffers: tuple[tuple[str, str, str, float, int], ...] = ()
    #: Normalisation layers' epsilons as ``(module path, class name, attribute, eps, kernel)``; kernel is
    #: ``"fused"`` (torch's own norm kernels add eps in fp32), ``"upcast"`` (its forward casts to fp32 first)
    #: or ``"dtype"`` (it computes, eps included, in its input's dtype).
    norm_eps: tuple[tuple[str, str, str, float, str], ...] = ()
    #: The config fields that set those epsilons, as ``(config ref, attribute, eps)``.
    config_eps: tuple[tuple[int, str, float], ...] = ()
    #: ``config._name_or_path`` of a transformers model: the checkpoint it was loaded from, empty for a model
    #: built from a config (advice says ``from_pretrained`` only when there is something to load).
    loaded_from: str = ""
    #: Submodules kept off the compute path on purpose (:class:`~mpdoctor.facts.intent.Island`): averaged copies,
    #: metrics, frozen copies of a sibling; read by :mod:`mpdoctor.objects.readers.intent`.
    islands: tuple = ()

    @property
    def model_type(self) -> str | None:
        """``config.model_type`` of the root config, if any."""
        return self.configs[0].model_type if self.configs and not self.configs[0].is_generation_config else None

    @property
    def config_dtype(self) -> str | None:
        """The dtype the checkpoint was saved in (``config.dtype`` / ``torch_dtype``)."""
        for cfg in self.configs:
            if cfg.dtype and not cfg.is_generation_config:
                return cfg.dtype
        return None


@dataclass(frozen=True)
class Facts:
    """The bundle checks read: one tuple per kind of fact, plus the device and runtime."""

    subjects: tuple[SubjectFacts, ...]
    models: tuple[ModelFacts, ...]
    optimizers: tuple[OptimizerFacts, ...]
    scalers: tuple[ScalerFacts, ...]
    precisions: tuple[PrecisionFacts, ...]
    runtime: TorchStateFacts
    hardware: DeviceProfile
    scans: tuple = ()
    errors: tuple[tuple[str, str], ...] = ()
    probes: tuple = ()  # mpdoctor.attach.numerics.probe.ProbeFacts, from a one-batch probe
    #: mpdoctor.libraries.lightning.facts.LightningPrecisionFacts, one per Lightning Trainer / Fabric
    lightning: tuple = ()
    #: mpdoctor.libraries.distributed.facts.DistributedFacts: process group, FSDP units, launcher state, other ranks.
    distributed: Any = None
    #: mpdoctor.libraries.trl.facts.TrlFacts, one per TRL trainer (SFT, DPO, GRPO ...): its config and reference model.
    trl: tuple = ()
    #: mpdoctor.libraries.deepspeed.facts.DeepSpeedFacts: DeepSpeed engines and configs (integrations' ``facts``)
    deepspeed: tuple = ()
    #: mpdoctor.facts.fp8_training.FP8RecipeFacts: the TransformerEngine fp8 recipes accelerators hold (accelerate's ``facts``)
    fp8_recipes: tuple = ()
    #: mpdoctor.facts.fp8_training.AORecipeFacts: the torchao fp8 recipes accelerators hold (accelerate's ``facts``)
    ao_recipes: tuple = ()
    #: mpdoctor.facts.quantized.AdapterConfigFacts: PEFT adapter configs the user holds, not yet applied.
    adapter_configs: tuple = ()
    #: mpdoctor.facts.between.BetweenFacts: accumulation, metric states, merged adapters, router biases.
    between: Any = None
    #: mpdoctor.facts.intent.ShadowFacts: EMA / weight-averaging objects and what their updates lose.
    averaging: tuple = ()
    #: mpdoctor.facts.inference.KVCacheFacts: KV caches the user holds (the transformers integration's ``facts``).
    kv_caches: tuple = ()
    #: mpdoctor.facts.inference.AttentionMaskFacts: 4D additive attention masks the user holds.
    attention_masks: tuple = ()
    #: mpdoctor.libraries.diffusers.facts.PipelineFacts: diffusers pipelines, their VAE and whether they honour force_upcast.
    pipelines: tuple = ()
    #: GradScaler states the user holds (``ckpt["scaler"]``), read by their keys: what a resumed scaler can load.
    scaler_states: tuple[ScalerStateFacts, ...] = ()

    @property
    def tallies(self) -> tuple[TensorTally, ...]:
        """All histogram rows: models, then optimizer state."""
        rows: list[TensorTally] = []
        for m in self.models:
            rows.extend(m.tensors.tallies)
        for o in self.optimizers:
            rows.extend(o.tallies)
        return tuple(rows)

    def subject(self, name: str) -> SubjectFacts | None:
        """The subject called ``name``."""
        return next((s for s in self.subjects if s.name == name), None)

    def optimizers_of(self, model: ModelFacts) -> tuple[OptimizerFacts, ...]:
        """Optimizers holding at least one of ``model``'s parameters."""
        ids = model.tensors.param_ids
        return tuple(o for o in self.optimizers if o.param_ids & ids)

    def optimizer_refs(self, param_ids: frozenset[int]) -> tuple[int, ...]:
        """Live refs of the optimizers holding any of ``param_ids``, each once, in order.

        A cast of those parameters must reach these optimizers' state too. An optimizer reached through two
        subjects (its wrapper and itself) is one ref; one without a subject is left out.
        """
        out: list[int] = []
        for o in self.optimizers:
            s = self.subject(o.name) if o.param_ids & param_ids else None
            if s is not None and s.inner_ref not in out:
                out.append(s.inner_ref)
        return tuple(out)

    def models_of(self, optimizer: OptimizerFacts) -> tuple[ModelFacts, ...]:
        """Models owning at least one of ``optimizer``'s parameters."""
        return tuple(m for m in self.models if m.tensors.param_ids & optimizer.param_ids)


def __getattr__(name: str) -> Any:
    # 0.3.0's RuntimeFacts, for facts built by hand: warns and answers TorchStateFacts (removed in 0.4).
    if name == "RuntimeFacts":
        from . import precision

        return precision.RuntimeFacts
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
