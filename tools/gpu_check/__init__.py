"""The transfer path on a GPU in one call (``scripts/gpu-check.sh``): kvpush's own transfer
thread and KV layout code moving vLLM-shaped KV between two processes, every byte checked,
against a raw NIXL WRITE; and the carry folder a lent GPU machine needs to run it.

- ``layouts``: KV tensors as vLLM lays them on GPUs (the ``KVCacheLayout`` permutations),
  and the byte patterns that check them;
- ``check``: the two-process check (``python -m kvpush.tools.gpu_check.check``), on CUDA
  memory (VRAM) or, in CI, on CPU memory (DRAM);
- ``pack``: the carry folder: the cp312 CUDA NIXL wheels, repacked to fit, and what else
  the device's Python lacks.
"""
