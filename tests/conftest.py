import torch

# The grid compiles the `compiled` strategy once per (dtype, shape) variant; keep them all compiled
# instead of letting dynamo fall back to eager after its default 8 recompilations.
torch._dynamo.config.recompile_limit = 64
