"""The Triton kernels as torch.compile sees them: it writes out the source of each @triton.jit function a kernel calls
(a triton_op's kernel), so a kernel must call each by that function's own name."""

import subprocess
import sys
import textwrap

from conftest import child_env


def test_torch_compile_finds_every_triton_function_a_compiled_kernel_calls_by_the_name_it_calls():
    """torch.compile (a triton_op's kernel) writes out the source of each @triton.jit function a kernel calls, under
    that function's own name: a kernel that calls one by another name (``_add = tl.standard._sum_combine``) failed to
    compile on the GPU ("_add is not defined"). Checked with inductor's own source writer, in a fresh process where
    the kernels are compiled ones (TRITON_INTERPRET unset), so on a machine without a GPU too."""
    script = textwrap.dedent(
        """
        import ast
        from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code as source
        from triton import JITFunction
        from triton.runtime.autotuner import Autotuner
        import detector.kernels.triton_giou, detector.model.conv_pool_kernel, detector.model.bias_pool_kernel
        from detector.kernels import jit
        assert not jit.INTERPRETED
        modules = [detector.kernels.triton_giou, detector.model.stem_kernel, detector.model.conv_pool_kernel]
        modules.append(detector.model.bias_pool_kernel)
        checked, missing = [], []
        for module in modules:
            for name, value in vars(module).items():
                kernel = value.fn if isinstance(value, Autotuner) else value
                if not isinstance(kernel, JITFunction) or kernel.fn.__module__ != module.__name__:
                    continue
                body = ast.parse(source(kernel)).body
                written = {n.name for n in body if isinstance(n, ast.FunctionDef)}
                written |= {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if hasattr(t, "id")}
                todo, seen = [kernel], set()
                while todo:
                    fn = todo.pop()
                    for used in fn.fn.__code__.co_names:
                        target = fn.fn.__globals__.get(used)
                        if isinstance(target, JITFunction) and used not in seen:
                            seen.add(used)
                            todo.append(target)
                            if used not in written:
                                missing.append(f"{name} calls {used}")
                checked.append(name)
        print(len(checked), missing)
        """
    )
    env = {key: value for key, value in child_env().items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    count, missing = done.stdout.strip().split(" ", 1)
    assert int(count) >= 6 and missing == "[]", done.stdout  # the loss's 2 kernels, the blocks' forward and backward
