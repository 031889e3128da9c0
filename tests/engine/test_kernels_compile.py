"""Every Triton kernel of strata compiled for compute capability 9.0 on the CPU, with Triton's
own ptxas (no GPU): what Triton's interpreter, under which the other CPU tests run the kernels,
never checks. The interpreter runs a kernel as Python; the compiler types it (a helper whose
returns differ in shape, even in a branch a constexpr rules out, fails here and not there),
lays it out and allocates its registers. A kernel that would not compile on the GPU machine
fails here first, in CI, instead of costing a device call.

Each kernel compiles at the constexprs of a decode step's launch (a prompt's for the prompt
kernels), as a programmatic dependent where it has the switch; pointers are bf16 and 16-byte
aligned, integers multiples of 16, unless `support.hopper.TYPES` or OWN_TYPES below say
otherwise."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import strata
from support.hopper import compile_for_hopper, spill_bytes

# A kernel's own argument types, past `support.hopper.TYPES`: (module, kernel) -> {argument:
# type}.
OWN_TYPES = {
    ("strata.engine.runtime._sampling_triton", "race_blocks"): {
        "logits_ptr": "*fp32", "top_values_ptr": "*fp32", "race_ptr": "*fp32",
        "top_ptr": "*fp32", "sum_ptr": "*fp32", "best_ptr": "*fp32", "id_ptr": "*i32"},
    ("strata.engine.runtime._sampling_triton", "race_before_blocks"): {
        "logits_ptr": "*fp32", "race_ptr": "*fp32", "top_ptr": "*fp32", "best_ptr": "*fp32",
        "id_ptr": "*i32", "mass_ptr": "*fp32", "count_ptr": "*i32", "next_best_ptr": "*fp32",
        "next_id_ptr": "*i32"},
    ("strata.engine.runtime._sampling_triton", "race_pick"): {
        "logits_ptr": "*fp32", "race_ptr": "*fp32", "top_values_ptr": "*fp32",
        "top_ptr": "*fp32", "sum_ptr": "*fp32", "best_ptr": "*fp32", "id_ptr": "*i32",
        "mass_ptr": "*fp32", "count_ptr": "*i32", "next_best_ptr": "*fp32",
        "next_id_ptr": "*i32", "out_ptr": "*i64"},
    ("strata.engine.runtime._sampling_triton", "argmax_blocks"): {
        "logits_ptr": "*fp32", "best_ptr": "*fp32", "best_id_ptr": "*i32",
        "nan_id_ptr": "*i32", "out_ptr": "*i64"},
}
OPS, EXPERTS = "strata.engine.model._ops_triton", "strata.engine.experts"
# (module, kernel) -> (constexprs, warps): olmoe-1b-7b's and qwen3-30b-a3b's decode shapes.
KERNELS = {
    (OPS, "add_rms_norm"): ({"HAS_DELTA": True, "BLOCK_D": 2048}, 8),
    (OPS, "qk_norm_rope"): ({"NORM": 1, "WRITE": True, "HEAD_DIM": 128, "BLOCK_P": 16}, 4),
    (OPS, "route"): ({"NORMALIZE": True, "BLOCK_E": 128, "BLOCK_K": 8}, 4),
    (OPS, "router_route"): ({"NORMALIZE": True, "SPLITS": 64, "BLOCK_D": 32, "BLOCK_E": 128,
                             "BLOCK_K": 8}, 4),
    (OPS, "add_norm_router_route"): ({"HAS_DELTA": True, "NORMALIZE": False, "SPLITS": 64,
                                      "BLOCK_ROW": 2048, "BLOCK_D": 32, "BLOCK_E": 64,
                                      "BLOCK_K": 8}, 8),
    (OPS, "rope_and_mask"): ({"HAS_WINDOW": False, "LIBDEVICE": True, "HALF": 64,
                              "BLOCK_N": 1024}, 4),
    ("strata.engine.model._products_triton", "product_one"): (
        {"HAS_BIAS": False, "BLOCK_N": 2, "BLOCK_K": 2048}, 4),
    ("strata.engine.model._products_triton", "add_norm_product_one"): (
        {"HAS_DELTA": True, "HAS_BIAS": False, "BLOCK_N": 8, "BLOCK_K": 2048}, 8),
    ("strata.engine.model._products_triton", "product_add_norm_route"): (
        {"HAS_BIAS": False, "NORMALIZE": False, "BLOCK_N": 8, "BLOCK_K": 2048,
         "BLOCK_ROW": 2048, "BLOCK_P": 256, "BLOCK_E": 64, "BLOCK_TOP_K": 8}, 8),
    ("strata.engine.model._attention_triton", "decode_attention"): (
        {"HAS_MASK": True, "CELLS_PER_SPLIT": 128, "BLOCK_C": 64, "BLOCK_R": 16,
         "BLOCK_D": 128, "BLOCK_S": 2, "MERGE_SPLITS": 0}, 8),
    ("strata.engine.model._attention_triton", "attend_short"): (
        {"HAS_MASK": True, "BLOCK_C": 256, "BLOCK_R": 16, "BLOCK_D": 128,
         "VALUES_FIRST": False}, 8),
    ("strata.engine.model._attention_triton", "rotate_attend_short"): (
        {"NORM": 2, "HAS_MASK": True, "BLOCK_C": 256, "BLOCK_R": 16, "BLOCK_P": 32,
         "HEAD_DIM": 128, "VALUES_FIRST": False}, 8),
    (f"{EXPERTS}._activation_triton", "silu_and_mul"): ({"BLOCK_F": 1024}, 4),
    (f"{EXPERTS}._combine_triton", "combine"): ({"HAS_POSITIONS": True, "BLOCK_D": 1024}, 4),
    (f"{EXPERTS}._dequant_triton", "dequant_blobs"): (
        {"GROUP": 0, "BLOCK_R": 16, "BLOCK_C": 256}, 4),
    (f"{EXPERTS}._grouped_triton", "gate_up_act"): ({"BLOCK_F": 32, "BLOCK_D": 128}, 8),
    (f"{EXPERTS}._grouped_triton", "down"): ({"BLOCK_D": 32, "BLOCK_F": 128}, 8),
    (f"{EXPERTS}._grouped_triton", "down_sum"): (
        {"BLOCK_D": 32, "BLOCK_F": 128, "BLOCK_R": 8}, 8),
    (f"{EXPERTS}._quantized_triton", "int8_act"): ({"BLOCK_F": 8, "BLOCK_D": 512}, 4),
    (f"{EXPERTS}._quantized_triton", "int8_down"): ({"BLOCK_D": 8, "BLOCK_F": 512}, 4),
    (f"{EXPERTS}._quantized_triton", "int4_act"): (
        {"GROUP": 32, "BLOCK_F": 8, "BLOCK_D": 512}, 4),
    (f"{EXPERTS}._quantized_triton", "int4_down"): (
        {"GROUP": 32, "BLOCK_D": 8, "BLOCK_F": 512}, 4),
    ("strata.engine.runtime._sampling_triton", "race_blocks"): (
        {"HAS_TOP_K": False, "BLOCK": 1024}, 4),
    ("strata.engine.runtime._sampling_triton", "race_before_blocks"): (
        {"BLOCK": 1024, "NB": 64}, 4),
    ("strata.engine.runtime._sampling_triton", "race_pick"): (
        {"HAS_TOP_K": False, "CHECK_MASS": True, "BLOCK": 1024, "ROW_BLOCK": 4096, "NB": 64},
        16),
    ("strata.engine.runtime._sampling_triton", "argmax_blocks"): ({"BLOCK": 1024, "NB": 64}, 4),
}


def _jitted() -> tuple[dict[str, tuple[str, ast.FunctionDef]], set[str]]:
    """({name: (module, definition)} of every @triton.jit function in strata's `_*_triton.py`
    modules, the names those functions call)."""
    root = Path(strata.__file__).parent
    jitted, called = {}, set()
    for path in sorted(root.rglob("_*_triton.py")):
        module = ".".join(("strata", *path.relative_to(root).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
                jitted[node.name] = (module, node)
                called |= {ast.unparse(n.func).split(".")[-1] for n in ast.walk(node)
                           if isinstance(n, ast.Call)}
    return jitted, called


def _launched_kernels() -> set[tuple[str, str]]:
    """(module, name) of every @triton.jit function that no other one calls: the kernels a
    launch site launches (the rest are helpers)."""
    jitted, called = _jitted()
    return {(module, name) for name, (module, _) in jitted.items() if name not in called}


def test_no_helper_takes_a_default():
    """A helper's default (a jit function another calls) reaches it as a plain Python value
    with the GPU machine's Triton, the one torch 2.11 brings, where a constexpr string default
    fails to compile ("'str' object has no attribute 'type'": a device call lost on
    2026-12-06); CI's Triton 3.9 wraps it and compiles. So every call passes every argument,
    and only kernels have defaults."""
    jitted, called = _jitted()
    with_defaults = sorted(f"{module}.{name}" for name, (module, node) in jitted.items()
                           if name in called and (node.args.defaults or node.args.kw_defaults))
    assert with_defaults == []


def test_the_table_names_every_kernel_strata_launches():
    assert _launched_kernels() == set(KERNELS)


@pytest.mark.parametrize("module, name", sorted(KERNELS), ids=lambda part: part.split(".")[-1])
def test_the_kernel_compiles_for_hopper(module, name):
    kernel = getattr(importlib.import_module(module), name)
    constexprs, warps = KERNELS[(module, name)]
    compiled = compile_for_hopper(kernel, constexprs, OWN_TYPES.get((module, name)), warps)
    ptx = compiled.asm["ptx"]
    assert ".entry" in ptx and compiled.asm["cubin"]
    assert ("griddepcontrol.wait" in ptx) == ("USE_PDL" in kernel.arg_names)
    _assert_arrivals_follow_a_barrier(ptx)
    assert spill_bytes(compiled) == 0  # at its launch's constexprs and warps


def _assert_arrivals_follow_a_barrier(ptx: str) -> None:
    """A program that counts its arrival after storing its part (`down_sum`, the router's
    splits, the split attention's) does it with a scalar atomic, which one thread runs: Triton
    puts a barrier before it, after every thread's stores, so the atomic's release publishes
    them all to the program that acquires the last count. This checks that Triton still does."""
    lines = [line.strip() for line in ptx.splitlines()]
    for i, line in enumerate(lines):
        if "atom.global" in line:
            before = lines[:i]
            stores = [j for j, x in enumerate(before) if "st.global" in x]
            barriers = [j for j, x in enumerate(before) if x.startswith("bar.sync")]
            assert barriers and (not stores or barriers[-1] > stores[-1]), line
