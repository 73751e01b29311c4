"""The real errors of the between-steps exception families (linear algebra, FFT, samplers in half precision).

Each raiser runs real torch ops on this CPU and raises its family's error from its last line; they are listed
in ``tests/test_exception_families.py``'s ``RAISERS`` and run there as functions and as notebook cells.
"""

from __future__ import annotations

import torch


def linalg_qr_bf16_grads():
    grad = torch.randn(8, 8, dtype=torch.bfloat16)
    torch.linalg.qr(grad)


def linalg_svd_bf16_delta():
    delta_weight = torch.randn(16, 8, dtype=torch.bfloat16)
    torch.linalg.svd(delta_weight, full_matrices=False)


def linalg_mvn_fp16_covariance():
    covariance = torch.eye(4, dtype=torch.float16)
    torch.distributions.MultivariateNormal(torch.zeros(4, dtype=torch.float16), covariance)


def linalg_solve_triangular_bf16():
    upper = torch.randn(6, 6, dtype=torch.bfloat16).triu() + 4 * torch.eye(6, dtype=torch.bfloat16)
    torch.linalg.solve_triangular(upper, torch.randn(6, 2, dtype=torch.bfloat16), upper=True)


def linalg_inv_bf16():
    hessian = torch.randn(6, 6, dtype=torch.bfloat16) + 4 * torch.eye(6, dtype=torch.bfloat16)
    torch.linalg.inv(hessian)


def fft_rfft_bf16_features():
    features = torch.randn(4, 12, dtype=torch.bfloat16)
    torch.fft.rfft(features)


def fft_fft_fp16_signal():
    signal = torch.randn(16, dtype=torch.float16)
    torch.fft.fft(signal)


def fft_stft_bf16_audio():
    audio = torch.randn(256, dtype=torch.bfloat16)
    torch.stft(audio, n_fft=64, return_complex=True)


def sampler_dirichlet_bf16():
    concentration = torch.ones(4, dtype=torch.bfloat16)
    torch.distributions.Dirichlet(concentration).sample()


def sampler_gamma_fp16():
    rate = torch.ones(4, dtype=torch.float16)
    torch.distributions.Gamma(rate, rate).sample()


#: family slug -> its raisers
BETWEEN_STEPS_RAISERS = {
    "crash-linalg-half": [linalg_qr_bf16_grads, linalg_svd_bf16_delta, linalg_mvn_fp16_covariance,
                          linalg_solve_triangular_bf16, linalg_inv_bf16],
    "crash-fft-half": [fft_rfft_bf16_features, fft_fft_fp16_signal, fft_stft_bf16_audio],
    "crash-sampler-half": [sampler_dirichlet_bf16, sampler_gamma_fp16],
}  # fmt: skip
