"""Triton kernels compiled for compute capability 9.0 on any machine (Triton's own ptxas, no
GPU): what the compiler makes of a kernel, which Triton's interpreter never shows."""

from __future__ import annotations

from typing import Any

import pytest

# Pointer and scalar arguments whose type is not bf16 / i32, by name, in strata's kernels.
TYPES = {"index_ptr": "*i64", "ids_ptr": "*i64", "positions_ptr": "*i64", "out_ptr": "*bf16",
         "arrived_ptr": "*i32", "weights_ptr": "*fp32", "partial_ptr": "*fp32",
         "acc_ptr": "*fp32", "stats_ptr": "*fp32", "inv_freq_ptr": "*fp32", "blob_ptr": "*u8",
         "blobs_ptr": "*u8", "eps": "fp32", "scale": "fp32", "temperature": "fp32",
         "top_p": "fp32"}


def compile_for_hopper(kernel: Any, constexprs: dict[str, Any],
                       types: dict[str, str] | None = None, num_warps: int = 4) -> Any:
    """`kernel` (a @triton.jit function) compiled for sm_90 at `constexprs`, as a programmatic
    dependent where it has the USE_PDL switch: the compiled kernel (`.asm["ptx"]`,
    `.asm["cubin"]`). Arguments are typed by `types`, then TYPES, else bf16 pointers and i32
    integers, all 16-byte aligned (integers multiples of 16, as launches from real tensors
    are); a constexpr the kernel needs and `constexprs` lacks fails the test, named, and one
    with a default takes it."""
    triton = pytest.importorskip("triton", minversion="3.3",  # attrs keyed by argument paths
                                 reason="the dev extra installs Triton on Linux x86_64")
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dependent = "USE_PDL" in kernel.arg_names
    constexprs = {**constexprs, "USE_PDL": True} if dependent else dict(constexprs)
    wanted = {param.name for param in kernel.params
              if param.is_constexpr and param.default is inspect.Parameter.empty}
    defaults = {param.name: param.default for param in kernel.params
                if param.is_constexpr and param.default is not inspect.Parameter.empty}
    constexprs = {**defaults, **constexprs}  # a launch that leaves one out gets its default
    missing = sorted(wanted - set(constexprs))
    assert not missing, f"{kernel.__name__}: no value given for {missing}"
    types = {**TYPES, **(types or {})}
    signature, aligned = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        signature[arg] = types.get(arg, "*bf16" if arg.endswith("_ptr") else "i32")
        if signature[arg] != "fp32":
            aligned[(index,)] = [["tt.divisibility", 16]]
    options = {"num_warps": num_warps, "enable_fp_fusion": True,  # as strata launches them
               **({"launch_pdl": True} if dependent else {})}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                    attrs=aligned),
                          target=GPUTarget("cuda", 90, 32), options=options)


def spill_bytes(compiled: Any) -> int:
    """The bytes a compiled kernel (`compile_for_hopper`'s) spills to local memory, stores and
    loads, as Triton's own ptxas reports them for its PTX (`-v`): register pressure the
    interpreter never shows, which costs a trip to memory in the middle of a kernel. The
    first of Triton's ptxas binaries that takes the PTX's version answers, run with the flags
    Triton runs it with; none: a skip."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as file:
            file.write(compiled.asm["ptx"])
        for name in ("ptxas-blackwell", "ptxas"):
            ptxas = os.path.join(tools, name)
            if not os.path.exists(ptxas):
                continue
            # Triton's own flags (its `make_cubin`): its register allocation, not the default.
            done = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2",
                                   "--gpu-name=sm_90a", ptx, "-o", os.devnull],
                                  capture_output=True, text=True)
            report = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                               done.stderr)
            if done.returncode == 0 and report:
                return int(report[1]) + int(report[2])
    pytest.skip("no ptxas of Triton's takes this PTX")
