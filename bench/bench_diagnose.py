"""How long ``diagnose()`` takes on big models built on the meta device, and the widget of such a report.

Baselines, measured in the same process and interleaved with mpdoctor's runs
(best of N each; this machine is shared and noisy, so only ratios mean
anything):

- a Llama-3-70B-shaped model (723 parameter tensors) and a 50,000-tensor
  mixture-of-experts model (50 layers of 333 experts): ``diagnose(model)``
  against the bare loop ``sum(p.numel() for p in model.parameters())``.
  Target: ratio <= 3.
- the widget of the 50,000-tensor report, built cold (nothing cached), against
  the same loop. Target: ratio <= 1 (near zero next to the diagnosis).
- discovery over a namespace of 100,000 plain objects, against a bare loop
  reading ``type()`` of each value. Target: well under a second.

Every library of the stack that is installed is imported first (transformers, accelerate, peft, lightning,
diffusers, bitsandbytes, torchao, trl, deepspeed): mpdoctor's integration for a library is active only when
that library is imported, so this is the cost with every integration looking. The rows name the libraries
that were imported (``stack_active``) and those that were not installed (``stack_absent``).

Prints a table and ``RESULT {json}`` lines for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

STACK = ("transformers", "accelerate", "peft", "lightning", "diffusers", "bitsandbytes", "torchao", "trl", "deepspeed")


def import_stack() -> tuple[list[str], list[str]]:
    """Import every installed library of the stack; ``(imported, absent)``."""
    import contextlib
    import importlib
    import io

    imported, absent = [], []
    for name in STACK:
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                importlib.import_module(name)  # their import-time banners are not bench output
            imported.append(name)
        except Exception:  # not installed (or broken): its integration stays inactive, and the row says so
            absent.append(name)
    return imported, absent


def _best_interleaved(fns: list, repeat: int) -> list[float]:
    """Best wall time of each function, the functions run in turn ``repeat`` times."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


class Expert(nn.Module):
    """One feed-forward expert (DeepSeek-V3's shape: 7168 -> 2048 -> 7168)."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)


class MoELayer(nn.Module):
    """A router and its experts."""

    def __init__(self, d: int, h: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(experts))


class MoE(nn.Module):
    """``layers`` MoE layers: ``layers * (3 * experts + 1)`` parameter tensors."""

    def __init__(self, layers: int, experts: int, d: int = 7168, h: int = 2048) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(d, h, experts) for _ in range(layers))


def build_moe(quick: bool) -> nn.Module:
    """50,000 bf16 parameter tensors on meta (5,000 with ``--quick``), in training mode."""
    with torch.device("meta"):
        model = MoE(5 if quick else 50, 333).to(torch.bfloat16)
    return model.train()


def build_model(quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    layers = 8 if quick else 80
    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return model.train()


def _row(figure: str, ours: float, base: float, target: float, unit: str = "ms (best of interleaved runs)") -> dict:
    ratio = ours / base
    return {
        "figure": figure,
        "mpdoctor": round(ours * 1000, 2),
        "baseline": round(base * 1000, 3),
        "ratio": round(ratio, 2),
        "target": f"ratio <= {target:g}",
        "met": ratio <= target,
        "unit": unit,
    }


def _llama_row(mpdoctor, quick: bool, repeat: int) -> dict:
    model = build_model(quick)
    n_tensors = sum(1 for _ in model.parameters())
    mpdoctor.diagnose(model)  # warm-up: first-use imports and the unscale-kernel probe
    t_diag, t_base = _best_interleaved(
        [lambda: mpdoctor.diagnose(model), lambda: sum(p.numel() for p in model.parameters())], repeat
    )
    return _row(f"diagnose() on a Llama-3-70B-shaped meta model ({n_tensors} param tensors)", t_diag, t_base, 3)


def _moe_rows(mpdoctor, quick: bool, repeat: int) -> list[dict]:
    moe = build_moe(quick)
    n_moe = sum(1 for _ in moe.parameters())
    report = mpdoctor.diagnose(moe)

    def widget_cold() -> None:
        report._cache.clear()  # the view (layer strips, rows) and its renderings: what a first display computes
        report.widget().close()

    widget_cold()
    t_moe, t_base, t_widget = _best_interleaved(
        [lambda: mpdoctor.diagnose(moe), lambda: sum(p.numel() for p in moe.parameters()), widget_cold], repeat
    )
    return [
        _row(f"diagnose() on a {n_moe:,}-tensor mixture-of-experts meta model", t_moe, t_base, 3),
        _row(f"report widget of the {n_moe:,}-tensor model, built cold", t_widget, t_base, 1),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-stack", action="store_true", help="import only what the models need (for comparison)")
    args = parser.parse_args()
    active, absent = ([], []) if args.no_stack else import_stack()
    import mpdoctor

    print(f"stack imported (integrations active): {', '.join(active) or 'none'}; not installed: {', '.join(absent) or 'none'}")
    repeat = 5 if args.quick else 15
    few = max(3, repeat // 3)
    rows = [_llama_row(mpdoctor, args.quick, repeat), *_moe_rows(mpdoctor, args.quick, few)]
    n_objects = 10_000 if args.quick else 100_000
    ns = {f"v{i}": (i if i % 3 else [i] if i % 2 else f"s{i}") for i in range(n_objects)}
    ns["model"] = torch.nn.Linear(4, 4)
    t_ns, t_ns_base = _best_interleaved([lambda: mpdoctor.diagnose(namespace=ns), lambda: [type(v) for v in ns.values()]], few)
    rows.append(
        {
            "figure": f"diagnose(namespace=...) over {n_objects:,} objects",
            "mpdoctor": round(t_ns * 1000, 1),
            "baseline": round(t_ns_base * 1000, 2),
            "ratio": round(t_ns / t_ns_base, 1),
            "target": "< 1000 ms",
            "met": t_ns < 1.0,
            "unit": "ms (best of interleaved runs)",
        }
    )
    for r in rows:
        print(f"{r['figure']}: mpdoctor {r['mpdoctor']} {r['unit']}, baseline {r['baseline']}, ratio {r['ratio']} "
              f"(target {r['target']}: {'met' if r['met'] else 'NOT met'})")
    for r in rows:
        print("RESULT " + json.dumps({**r, "stack_active": active, "stack_absent": absent}))


if __name__ == "__main__":
    main()
