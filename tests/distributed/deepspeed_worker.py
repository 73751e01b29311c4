"""One rank of a 2-process DeepSpeed job (launched by torch.distributed.run): train, diagnose, report JSON.

Usage: ``deepspeed_worker.py STAGE COMM OUT_DIR`` (COMM is ``none`` for DeepSpeed's default reduction dtype).
"""

from __future__ import annotations

import json
import os
import sys

import deepspeed
import torch

import mpdoctor


def main() -> None:
    stage, comm, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    if comm != "none":
        cfg["communication_data_type"] = comm
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    torch.manual_seed(1 + rank)
    # rank 1's gradients pass fp16's 65504; rank 0's stay small
    loss = engine(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum() * (1e6 if rank == 1 else 1.0)
    engine.backward(loss)
    engine.step()
    report = mpdoctor.diagnose(namespace={"engine": engine})
    (facts,) = report.facts.deepspeed
    result = {
        "rank": rank,
        "skipped_steps": engine.skipped_steps,
        "findings": [[f.severity, f.check] for f in report.findings],
        "facts": {"zero_stage": facts.zero_stage, "bf16": facts.bf16, "communication_data_type": facts.communication_data_type,
                  "master_dtype": facts.master_dtype, "module_dtype": facts.module_dtype},
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
