"""Shared test set-up: the Triton interpreter where there is no GPU, and dynamo's recompile limit."""

import os

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # Before detector.kernels.triton_giou is imported (it reads the variable once): the triton strategy's
    # kernel then runs as numpy on the CPU, so its tests run here too.
    os.environ["TRITON_INTERPRET"] = "1"
    print("no CUDA device: Triton kernels run in the interpreter (TRITON_INTERPRET=1)")

# The grid compiles the `compiled` strategy once per (dtype, shape) variant; keep them all compiled
# instead of letting dynamo fall back to eager after its default 8 recompilations.
torch._dynamo.config.recompile_limit = 64
