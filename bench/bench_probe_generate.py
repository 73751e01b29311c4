"""What ``mpdoctor.probe(model, batch, generate=True)`` adds to a plain ``model.generate`` of the same length.

Model: a 4-layer Llama, hidden 256, vocabulary 8192, built from a config (no download), fp32 on the CPU, in eval
mode; prompt: 1 sequence of 32 tokens; 32 new tokens, greedy (``min_new_tokens`` is set on the model's
generation config, so every run decodes exactly as many steps). Three timings, interleaved so that the machine's
noise hits them alike:

- plain: ``model.generate(ids, max_new_tokens=32)`` under ``torch.no_grad()``;
- probe: ``mpdoctor.probe(model, batch, generate=True, max_new_tokens=32)`` (hooks on every module, the per-step
  logits watch, modes / RNG saved and restored, the static checks and the report);
- hooks: ``run_generation_probe`` alone (the same decoding under the hooks, no checks, no report).

Ratio = best probe time / best plain time (the best, i.e. minimum, of N rounds: the run least disturbed by the
shared machine). Target: <= 2x.
``--quick``: 2 layers, 8 new tokens, 3 rounds (seconds; only checks the script works).
``--rounds N``: N interleaved rounds instead of 11.
Prints a table and ``RESULT {json}`` lines for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def build(layers: int, new_tokens: int, prompt: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=8192)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.generation_config.min_new_tokens = new_tokens  # every run decodes the same number of steps
    model.generation_config.pad_token_id = 0
    ids = torch.randint(0, config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (default 11; 3 with --quick)")
    args = parser.parse_args()

    import mpdoctor
    from mpdoctor.attach.numerics.probe import run_generation_probe

    torch.set_num_threads(1)  # the machine is shared: one thread keeps OpenMP barriers out of the noise
    rounds = 3 if args.quick else args.rounds
    layers, new = (2, 8) if args.quick else (4, 32)
    model, batch = build(layers, new)
    n_modules = sum(1 for _ in model.modules())

    def plain() -> None:
        with torch.no_grad():
            out = model.generate(batch["input_ids"], max_new_tokens=new)
        assert out.shape[1] == batch["input_ids"].shape[1] + new

    def probe() -> None:
        report = mpdoctor.probe(model, batch, generate=True, max_new_tokens=new)
        assert report.facts.probes[0].generation.steps == new

    def hooks() -> None:
        assert run_generation_probe(model, batch, max_new_tokens=new).generation.steps == new

    for fn in (plain, probe, hooks):  # warm-up: allocator, first-use imports, the checks' registry
        fn()
    timings: dict[str, list[float]] = {"plain": [], "probe": [], "hooks": []}
    for _ in range(rounds):
        for key, fn in (("plain", plain), ("probe", probe), ("hooks", hooks)):
            start = time.perf_counter()
            fn()
            timings[key].append(time.perf_counter() - start)
    best = {k: min(v) * 1000 for k, v in timings.items()}
    ratio = best["probe"] / best["plain"]
    hooks_ratio = best["hooks"] / best["plain"]
    print(f"{layers}-layer Llama (hidden 256, {n_modules} modules), prompt 1x32, {new} new tokens, fp32 CPU, 1 thread, "
          f"{rounds} interleaved rounds")  # fmt: skip
    print(f"  plain generate()                          {best['plain']:8.1f} ms (best)")
    print(f"  mpdoctor.probe(generate=True) (report)    {best['probe']:8.1f} ms  ratio {ratio:.2f}x (target <= 2x)")
    print(f"  run_generation_probe (hooks only)         {best['hooks']:8.1f} ms  ratio {hooks_ratio:.2f}x")
    for row in (
        {
            "figure": f"probe(generate=True) vs plain generate() ({layers}-layer Llama h256, {new} new tokens)",
            "mpdoctor": round(best["probe"], 1),
            "baseline": round(best["plain"], 1),
            "ratio": round(ratio, 2),
            "target": "ratio <= 2",
            "met": ratio <= 2,
            "unit": "ms (best)",
        },
        {
            "figure": "generation probe hooks only (run_generation_probe) vs plain generate()",
            "mpdoctor": round(best["hooks"], 1),
            "baseline": round(best["plain"], 1),
            "ratio": round(hooks_ratio, 2),
            "target": "ratio <= 2",
            "met": hooks_ratio <= 2,
            "unit": "ms (best)",
        },
    ):
        print("RESULT " + json.dumps(row))


if __name__ == "__main__":
    main()
