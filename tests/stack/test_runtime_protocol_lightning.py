"""The GradScaler protocol observer under Lightning's manual optimization (the Lightning callback; needs the
stack, so it runs in the main venv only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from test_runtime_protocol import X, Y, protocol_module

import mpdoctor


def lightning_fit(clip: bool, max_steps: int = 4):
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Manual(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            loss = F.mse_loss(self.layer(batch[0]), batch[1])
            self.manual_backward(loss)
            if clip:
                self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")  # Lightning's doc
            opt.step()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = mpdoctor.MPDoctorLightningCallback()
    # 16-mixed with a CPU GradScaler: Lightning's own AMP plugin, scaling for real on this CPU.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", plugins=[plugin], logger=False, callbacks=[cb],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    module = Manual()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
    trainer.fit(module, data)
    return cb, module


def test_lightning_manual_optimization_draws_nothing_and_keeps_the_scale_history():
    cb, module = lightning_fit(clip=False)
    assert cb.protocol.findings == [] and len(cb.scale_history) == 4
    assert list(cb.report.scale_history) == list(cb.scale_history) and not protocol_module.installed()


