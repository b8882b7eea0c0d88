"""A check the kernel tests share (tests/model/): torch.compile keeps a function's outputs and gradients."""

import torch


def assert_compiled_matches_eager(forward, params) -> None:
    """``forward()`` eager and under ``torch.compile(fullgraph=True)``: the same output, and the same gradients
    of ``params`` from the loss ``out.float().square().sum()``."""

    def step(fn):
        out = fn()
        out.float().square().sum().backward()
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return out, grads

    eager_out, eager_grads = step(forward)
    out, grads = step(torch.compile(forward, fullgraph=True))
    torch.testing.assert_close(out, eager_out)
    torch.testing.assert_close(grads, eager_grads)
