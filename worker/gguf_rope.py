"""Llama 3's rotary scaling, read back from a GGUF file: llama.cpp keeps it not as config values but as a tensor
(`rope_freqs`) of the factor each rotary frequency is divided by, which transformers' GGUF config does not read.
The values transformers' `llama3` rope type takes are found from those factors and checked against them."""

from __future__ import annotations

import math

import numpy as np

from worker.checkpoint_error import CheckpointError

# what every Llama 3 release sets (and llama.cpp's converter assumes when they are absent)
LOW_FREQ_FACTOR, HIGH_FREQ_FACTOR, ORIGINAL_CONTEXT = 1.0, 4.0, 8192
_TOLERANCE = 1e-4  # relative: the factors are float32


def llama3_factors(theta: float, head_dim: int, params: dict) -> np.ndarray:
    """The factor of each rotary frequency under llama 3's scaling, as llama.cpp's converter writes them."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    context = params["original_max_position_embeddings"]
    smooth = (context / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, mid))


def llama3_rope(factors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """transformers' rope parameters for a file's `rope_freqs` (None: every factor 1, no scaling), or a
    CheckpointError if no llama 3 scaling gives them."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        pairs = head_dim // 2
        raise CheckpointError(f"its rope_freqs has {factors.size} factors, not one for each of {pairs} rotary pairs")
    if np.allclose(factors, 1.0, rtol=_TOLERANCE, atol=0):
        return None
    factor = float(factors.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (factors > 1 + _TOLERANCE) & (factors < factor * (1 - _TOLERANCE))
    candidates = [ORIGINAL_CONTEXT]
    if mid.any():
        # between the two bands, smooth = (context / wavelength - low) / (high - low): one unknown at llama 3's
        # low and high factors
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        wavelen = 2 * math.pi / inv_freq[mid]
        context = float(np.mean((smooth * (HIGH_FREQ_FACTOR - LOW_FREQ_FACTOR) + LOW_FREQ_FACTOR) * wavelen))
        candidates.insert(0, round(context))
    for context in candidates:
        params = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": LOW_FREQ_FACTOR,
            "high_freq_factor": HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": int(context),
        }
        if np.allclose(llama3_factors(theta, head_dim, params), factors, rtol=_TOLERANCE, atol=0):
            return params
    raise CheckpointError(
        "its rope_freqs are not llama 3's rotary scaling (low and high frequency factors 1 and 4), the one read "
        "from GGUF here"
    )
