"""Where :func:`mpdoctor.compare` emulates low precision: the model's Linears and attention's two matmuls.

A :class:`Emulation` (a :class:`torch.overrides.TorchFunctionMode`) routes the matmuls of one run through
the emulated ones (:mod:`mpdoctor.attach.emulation.matmuls`):

- at every ``nn.Linear``: ``F.linear`` calls whose weight is one of the model's Linear weights;
- at attention's two matmuls, q·kᵀ and p·v, where they can be reached: ``F.scaled_dot_product_attention``
  (transformers' default ``sdpa`` attention, ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``,
  whose composite ``F.multi_head_attention_forward`` the mode re-enters) is decomposed into its math with a
  float32 softmax; an eager attention's own ``torch.matmul`` / ``bmm`` / ``baddbmm`` / ``@`` between two
  activations of 3+ dims (no Parameter) inside the forward of a module that reads as attention
  (:func:`is_attention_module`) is emulated too, the first of each pair taken for q·kᵀ and the second for
  p·v. Rows are labelled ``path [q·kᵀ]`` and ``path [p·v]`` (:func:`attention_label`).

The module tree is never touched: no module gets a hook and none is swapped. To name the attention module
whose matmuls run, one process-wide module forward pre-hook and one forward hook are registered for the
length of each emulated forward (:class:`RunningModules`) and removed in a ``finally``, also when the run
raises.

A mode may give each Linear its own precision (a mixed model: the layers a plan keeps in bf16, the rest
in fp8) and may skip the measurements (a plan's verification needs the loss and the gradients only).
"""

from __future__ import annotations

import contextlib
import re
import threading
import types
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from .formats import Precision
from .matmuls import EmulatedLinear, LayerStats, emulated_matmul, emulated_sdpa

#: The labels of the two attention matmuls, appended to the attention module's path in the rows.
QK_LABEL = "q·kᵀ"
PV_LABEL = "p·v"
#: Matmuls an eager attention writes by hand (``torch.matmul(q, k.transpose(2, 3))``, ``q @ k.mT``, ``bmm``).
_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm})
_BADDBMM = frozenset({torch.baddbmm, torch.Tensor.baddbmm})
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_ATTENTION_NAME = re.compile("attn|attention", re.IGNORECASE)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def attention_label(path: str, which: str) -> str:
    """The row label of one attention matmul: ``model.layers.0.self_attn [q·kᵀ]`` (``which``: QK_LABEL or PV_LABEL)."""
    return f"{path} [{which}]"


def is_attention_module(module: torch.nn.Module, path: str) -> bool:
    """Whether a module reads as attention: its class name or its own name holds "attn" or "attention".

    ``LlamaAttention``, ``MultiheadAttention``, ``GPT2Attention``, ``BertSelfAttention``, ``self_attn``, ``attn``.
    Only matmuls inside such a module's own forward are taken for eager attention's.
    """
    return bool(_ATTENTION_NAME.search(type(module).__name__) or _ATTENTION_NAME.search(path.rsplit(".", 1)[-1]))


class RunningModules:
    """Which module's forward is running, for the length of one emulated run.

    One process-wide module forward pre-hook and one forward hook (``always_call=True``, so a forward
    that raises pops too), registered on entry and removed on exit, also when the run raises; no module
    of the model gets a hook. Only the thread that entered is tracked.
    """

    def __init__(self, modules: dict[int, tuple[str, torch.nn.Module]]) -> None:
        self.modules = modules
        self.stack: list[list] = []  # [module, attention matmuls seen in this call]
        self._handles: list = []
        self._thread = 0

    def __enter__(self) -> RunningModules:
        from torch.nn.modules import module as nn_module

        self._thread = threading.get_ident()
        self.stack.clear()
        try:
            self._handles.append(nn_module.register_module_forward_pre_hook(self._enter))
            self._handles.append(nn_module.register_module_forward_hook(self._exit, always_call=True))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        while self._handles:
            self._handles.pop().remove()
        self.stack.clear()

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() == self._thread:
            self.stack.append([module, 0])

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] is module:
                del self.stack[i:]
                return

    def path(self) -> str:
        """The path of the innermost running module of the model (``(model)`` when none runs)."""
        for module, _ in reversed(self.stack):
            hit = self.modules.get(id(module))
            if hit is not None and hit[1] is module:
                return hit[0]
        return "(model)"

    def attention_call(self) -> list | None:
        """The innermost running module's entry when it is an attention module of the model, else None."""
        if not self.stack:
            return None
        entry = self.stack[-1]
        hit = self.modules.get(id(entry[0]))
        if hit is None or hit[1] is not entry[0] or not is_attention_module(entry[0], hit[0]):
            return None
        return entry


def _sdpa_arguments(args: tuple, kwargs: dict) -> dict | None:
    """SDPA's arguments by name when they are ones the emulation decomposes exactly, else None."""
    if len(args) > len(_SDPA_ARGS) or any(k not in _SDPA_ARGS for k in kwargs):
        return None
    bound = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    mask = bound.get("attn_mask")
    if not all(type(t) in _PLAIN and not t.is_nested and t.is_floating_point() and t.dim() >= 2 for t in (q, k, v)):
        return None
    if not (q.dtype == k.dtype == v.dtype) or q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        return None
    if mask is not None and (type(mask) not in _PLAIN or not (mask.dtype == torch.bool or mask.is_floating_point())):
        return None
    if mask is not None and bound.get("is_causal"):
        return None  # SDPA refuses both: let it say so
    if not isinstance(bound.get("dropout_p", 0.0), (int, float)):
        return None
    return bound


def _activation(t: Any) -> bool:
    """A batched activation: a plain floating tensor of 3+ dims (a Parameter is a weight, not attention)."""
    return type(t) is torch.Tensor and t.is_floating_point() and t.dim() >= 3


def _unchecked_mha() -> Callable:
    """``F.multi_head_attention_forward`` without its own ``__torch_function__`` check at its entrance.

    A mode sees only the outermost function of a Python-level composite; re-entered around this copy,
    the mode also sees the in-projection, SDPA (or bmm) and out-projection calls inside it.
    """
    func = torch.nn.functional.multi_head_attention_forward
    scope = dict(func.__globals__)
    scope["has_torch_function"] = lambda *args: False
    clone = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    return clone


class Emulation(TorchFunctionMode):
    """Routes the model's matmuls through the emulated ones (:mod:`mpdoctor.attach.emulation.matmuls`).

    ``F.linear`` on the model's Linear weights, ``F.scaled_dot_product_attention`` (decomposed), and
    ``torch.matmul`` / ``bmm`` / ``baddbmm`` / ``@`` between two activations inside an attention module's
    own forward (eager attention: the first of each pair is q·kᵀ, the second p·v).
    """

    def __init__(
        self,
        weights: dict[int, tuple[str, torch.Tensor]],
        prec: Precision,
        modules: dict[int, tuple[str, torch.nn.Module]] | None = None,
        *,
        layers: Mapping[str, Precision | None] | None = None,
        attention: bool = True,
        measure: bool = True,
    ) -> None:
        super().__init__()
        self.weights = weights
        self.prec = prec
        #: Linear path -> its own precision (None: left as the model runs it); the others take ``prec``.
        self.layers = dict(layers or {})
        #: Whether attention's matmuls are emulated (torchao's recipes convert Linears only: a plan leaves them).
        self.emulates_attention = attention
        #: Whether each matmul is measured against float32 (the per-layer figures) or only run.
        self.measure = measure
        self.stats: dict[str, LayerStats] = {}
        #: attention row label -> (module path, QK_LABEL or PV_LABEL), in call order.
        self.attention: dict[str, tuple[str, str]] = {}
        self.running = RunningModules(modules or {})
        self._mha: Callable | None = None

    @contextlib.contextmanager
    def engaged(self) -> Iterator[Emulation]:
        """The mode and its module tracker entered for one forward; both left also when the forward raises."""
        with self.running, self:
            yield self

    def _stats(self, key: str) -> LayerStats | None:
        if not self.measure:
            return None
        stats = self.stats.get(key)
        if stats is None:
            stats = self.stats[key] = LayerStats()
        return stats

    def _attention_stats(self, path: str, which: str) -> LayerStats | None:
        label = attention_label(path, which)
        self.attention.setdefault(label, (path, which))
        return self._stats(label)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            emulated = self._linear(args, kwargs)
            if emulated is not None:
                return emulated
        elif func is torch.nn.functional.scaled_dot_product_attention and self.emulates_attention:
            bound = _sdpa_arguments(args, kwargs)
            if bound is not None:
                path = self.running.path()
                scores, mix = self._attention_stats(path, QK_LABEL), self._attention_stats(path, PV_LABEL)
                return emulated_sdpa(**bound, prec=self.prec, scores=scores, mix=mix)
        elif (func in _MATMULS or func in _BADDBMM) and self.emulates_attention:
            emulated = self._eager_matmul(func, args, kwargs)
            if emulated is not None:
                return emulated
        elif func is torch.nn.functional.multi_head_attention_forward:
            if self._mha is None:
                self._mha = _unchecked_mha()
            with self:  # re-entered: its inner linear, SDPA and bmm calls reach this mode
                return self._mha(*args, **kwargs)
        return func(*args, **kwargs)

    def _linear(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """``F.linear`` on one of the model's Linear weights, emulated in its precision; None when not one."""
        x = args[0] if args else kwargs.get("input")
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        hit = self.weights.get(id(weight))
        if hit is None or hit[1] is not weight:
            return None
        prec = self.layers.get(hit[0], self.prec) if self.layers else self.prec
        if (
            prec is None
            or type(x) is not torch.Tensor
            or x.dtype != weight.dtype
            or not x.is_floating_point()
            or not (bias is None or type(bias) in _PLAIN)
        ):
            return None
        return EmulatedLinear.apply(x, weight, bias, prec, self._stats(hit[0]))

    def _eager_matmul(self, func, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """An attention matmul written by hand, emulated; None when the call is not one."""
        if kwargs.get("out") is not None:
            return None
        if func in _BADDBMM:
            if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
                return None
            base, a, b = args
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            if type(base) is not torch.Tensor or not isinstance(beta, (int, float)) or not isinstance(alpha, (int, float)):
                return None
        else:
            if len(args) != 2 or kwargs:
                return None
            (a, b), base, beta, alpha = args, None, 0, 1
        if not (_activation(a) and _activation(b) and a.dtype == b.dtype and a.shape[-1] == b.shape[-2]):
            return None
        entry = self.running.attention_call()
        if entry is None:
            return None
        which = QK_LABEL if entry[1] % 2 == 0 else PV_LABEL
        entry[1] += 1
        y = emulated_matmul(a, b, self.prec, self._attention_stats(self.running.path(), which))
        if alpha != 1:
            y = y * alpha
        if base is not None and beta != 0:
            y = y + (base.to(torch.float32) if beta == 1 else beta * base.to(torch.float32))
        return y.to(a.dtype)


def linears(model: torch.nn.Module) -> dict[int, tuple[str, torch.Tensor]]:
    """``id(weight) -> (path, weight)`` of every ``nn.Linear`` whose weight is a plain floating tensor (a weight
    shared by two Linears counts once, under its first path)."""
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and isinstance(getattr(m, "weight", None), torch.Tensor):
            w = m.weight
            if type(w) in (torch.Tensor, torch.nn.Parameter) and w.is_floating_point() and w.device.type != "meta":
                out.setdefault(id(w), (path or "(model)", w))
    return out

