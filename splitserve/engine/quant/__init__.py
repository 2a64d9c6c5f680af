"""Quantized checkpoints: which formats a `quantization_config` names (config.py), the arithmetic
that turns each format's stored tensors back into a weight (fp8.py, int4.py), and the pass over a
checkpoint's tensors that hands the loader dense weights (checkpoint.py). On a CPU the weights
are dequantized once at load; on a GPU they stay as stored (stored.py: cut for tensor parallelism,
fused) in `QuantLinear` layers (linear.py) whose matmuls are kernels/triton_fp8_gemm.py and
kernels/triton_int4_gemm.py (`EngineConfig.quantized_weights`)."""
