"""The training callbacks on a real 2-process gloo job under torchrun (tests/distributed/test_callbacks.py).

``torchrun --nproc_per_node 2 callback_job.py MODE OUT`` with MODE ``hf`` (a transformers Trainer, ``use_cpu=True``,
``ddp_backend="gloo"``) or ``lightning`` (``L.Trainer(accelerator="cpu", devices=2, strategy="ddp")``). Both train a
pure-bf16 model with AdamW, so the start diagnosis has a finding on every rank. Each rank writes ``OUT/rank{N}.json``
(its findings, the exchange it took part in) and ``OUT/rank{N}.log`` (what mpdoctor logged there).
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

import mpdoctor


def _summary(report) -> dict:
    dist = report.facts.distributed
    return {
        "findings": sorted((f.check, f.severity, f.subject) for f in report.findings),
        "exchanged": bool(dist and dist.exchanged),
        "ranks": [r["rank"] for r in report.ranks],
    }


def hf(callback):
    from setups import TinyDataset, tiny_llama, training_args
    from transformers import Trainer

    model = tiny_llama(use_cache=False).to(torch.bfloat16)
    args = training_args(ddp_backend="gloo", max_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset())
    trainer.add_callback(callback)
    trainer.train()
    return {"world": args.world_size, "loss_finite": all(torch.isfinite(p).all().item() for p in model.parameters())}


def lightning(callback):
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x).float(), y.float())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy="ddp", precision="bf16-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])  # fmt: skip
    module = Tiny()
    trainer.fit(module, data)
    return {"world": trainer.world_size, "loss_finite": bool(torch.isfinite(module.layer.weight).all())}


def main(mode: str, out: str) -> None:
    rank = os.environ["RANK"]
    handler = logging.FileHandler(os.path.join(out, f"rank{rank}.log"))
    logging.getLogger("mpdoctor").addHandler(handler)
    logging.getLogger("mpdoctor").setLevel(logging.INFO)
    if mode == "hf":
        callback = mpdoctor.MPDoctorCallback(timeout=60)
    else:
        from mpdoctor.libraries.lightning.callback import MPDoctorLightningCallback

        callback = MPDoctorLightningCallback(timeout=60)
    result = globals()[mode](callback)
    handler.flush()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({**result, "report": _summary(callback.start_report)}, f)
    # Tear the gloo group down on both ranks before the interpreter exits: left to exit, a rank can abort in
    # gloo's thread teardown ("terminate called without an active exception", SIGABRT), seen once in CI.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
