"""The emulated hardware and models, each number with its public source.

A deployment's name is ``<model>@<hardware>`` (``qwen3-32b@p5en``); :func:`deployment` finds
it. Sources were found with the project's search tool; docs/benchmarks.md ("Emulated GPUs")
lists them with the quotes.
"""

from __future__ import annotations

from kvpush.tools.emulation.time_model import Deployment, Efficiency, Gpu, ModelShape

__all__ = ["GPUS", "MODELS", "DEPLOYMENTS", "deployment"]

GBIT = 1e9 / 8  # bytes/s in one Gbit/s

# NVIDIA H200 (https://www.nvidia.com/en-us/data-center/h200/): "BFLOAT16 Tensor Core 1,979
# TFLOPS" with sparsity, dense is half; "141 GB of HBM3e ... 4.8 TB/s". NVIDIA's MLPerf
# Inference v4.1 system file (mlcommons/inference_results_v4.1, closed/NVIDIA/systems/
# H200-SXM-141GBx8_TRT_MaxQ.json): "141 GB", "18x 4th Gen NVLink, 900GB/s" (both directions
# together: 450 GB/s each way).
H200 = Gpu("h200", dense_bf16_flops=989.5e12, hbm_bytes_per_s=4.8e12, hbm_bytes=141e9,
           nvlink_bytes_per_s=450e9)
# NVIDIA H100 SXM (https://www.nvidia.com/en-us/data-center/h100/): BF16 1,979 TFLOPS with
# sparsity (dense 989.4: glennklockwood.com/garden/processors/h100), "80GB", "3.35TB/s",
# "NVLink: 900GB/s".
H100 = Gpu("h100", dense_bf16_flops=989.5e12, hbm_bytes_per_s=3.35e12, hbm_bytes=80e9,
           nvlink_bytes_per_s=450e9)

# Qwen3-32B (https://huggingface.co/Qwen/Qwen3-32B, config.json and model card): 64 layers,
# hidden 5120, 64 query heads, 8 KV heads, head_dim 128; 32,762,123,264 parameters (the
# safetensors total; counting the config's shapes gives the same). KV: 256 KiB per token.
QWEN3_32B = ModelShape("qwen3-32b", parameters=32_762_123_264, layers=64, hidden=5120, heads=64,
                       kv_heads=8, head_dim=128)
# Llama-3.1-8B (https://huggingface.co/meta-llama/Llama-3.1-8B, config.json): 32 layers,
# hidden 4096, 32 heads, 8 KV heads, head_dim 4096/32 = 128; 8,030,261,248 parameters.
# KV: 128 KiB per token.
LLAMA_31_8B = ModelShape("llama-3.1-8b", parameters=8_030_261_248, layers=32, hidden=4096, heads=32,
                         kv_heads=8, head_dim=128)
# Llama-3.3-70B-Instruct (https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct, config.json,
# the same shape as Llama-3.1-70B's): 80 layers, hidden 8192, 64 heads, 8 KV heads, head_dim
# 8192/64 = 128, intermediate 28672, vocabulary 128256, untied embeddings; 70,553,706,496
# parameters counted from those shapes (the model card's "70B", Hugging Face's safetensors
# total 70.6B). KV: 320 KiB per token in bf16. The model the push connector's author names
# beside the seed's table (vLLM PR #35264's thread).
LLAMA_33_70B = ModelShape("llama-3.3-70b", parameters=70_553_706_496, layers=80, hidden=8192, heads=64,
                          kv_heads=8, head_dim=128)

# Efficiencies: what serving reaches of the datasheet peaks.
# - flops 0.48: Databricks, "LLM Inference Performance Engineering: Best Practices"
#   (https://www.databricks.com/blog/llm-inference-performance-engineering-best-practices),
#   Table 1: MPT-7B, a 512-token prompt at batch 1, TTFT 46 ms on 1xA100-40GB:
#   2 x 6.7e9 x 512 / 0.046 s = 149 TFLOP/s of 312: 0.48. (No whole-model prefill MFU for
#   H100/H200 was found published; FlashAttention-3 reports 75% of H100 peak for the attention
#   kernel alone, arXiv 2407.08608.)
# - hbm 0.60: the same post, "At batch size 1, we can achieve a higher MBU of 60% on
#   2xH100-80GBs".
# - nvlink 0.70: no published all-reduce efficiency was found: an assumption, stated as one.
#   It only matters at TP > 1 (the seed's case) and, in prefill, adds about a quarter to the
#   compute time.
# - step_overhead_s 0.001: derived from vLLM's own CI benchmark (buildkite.com/vllm/
#   performance-benchmark/builds/9515, "latency_llama8B_tp1 | H200 | 833.421" ms for 32 input
#   and 128 output tokens at batch 8): 6.5 ms per step, of which reading 16.06 GB at 60% of
#   4.8 TB/s is 5.6 ms; the rest, about 1 ms, is the step's fixed cost.
SERVING = Efficiency(flops=0.48, hbm=0.60, nvlink=0.70, step_overhead_s=0.001)

GPUS = {gpu.name: gpu for gpu in (H200, H100)}
MODELS = {model.name: model for model in (QWEN3_32B, LLAMA_31_8B, LLAMA_33_70B)}

# EC2 P5en (https://docs.aws.amazon.com/ec2/latest/instancetypes/ac.html, "p5en.48xlarge | 8 |
# H200 SXM5 | 1,128 GiB | 16 | 16 | 3,200 Gbps | EFAv3"): one instance per role. The seed's
# tensor parallelism is not in the text of vLLM PR #35264 that could be read (its table's rows
# are missing from the stored copy), so TP 8, the whole instance, as the issue says.
# EC2 P5 (same page): 8 x H100 and 3,200 Gbps of EFA, 400 Gbps per GPU: the smaller pair runs
# one H100 per role with one GPU's share of the network.
DEPLOYMENTS = {
    "qwen3-32b@p5en": Deployment(QWEN3_32B, H200, tp=8, efficiency=SERVING,
                                 link_bytes_per_s=3200 * GBIT),
    "llama-3.1-8b@h100": Deployment(LLAMA_31_8B, H100, tp=1, efficiency=SERVING,
                                    link_bytes_per_s=400 * GBIT),
    # The published push-vs-pull table's setting (issue 45's calibration): P5en, TP 4 on each
    # side (vLLM PR #35264's TP column), so half an instance's GPUs and half its EFA.
    "llama-3.3-70b@p5en": Deployment(LLAMA_33_70B, H200, tp=4, efficiency=SERVING,
                                     link_bytes_per_s=1600 * GBIT),
}


def deployment(name: str) -> Deployment:
    try:
        return DEPLOYMENTS[name]
    except KeyError:
        known = ", ".join(sorted(DEPLOYMENTS))
        raise ValueError(f"no emulated deployment {name!r} (known: {known})") from None
