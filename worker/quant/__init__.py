"""Quantized weights: how a checkpoint's quantization_config (or `quantization` at load) becomes a scheme
(scheme.py), how a linear layer keeps and multiplies FP8 weights (fp8.py, its GPU GEMMs in gemm.py and
fp8_kernels.py), and the step that turns a built model's linears into quantized ones (prepare.py)."""
