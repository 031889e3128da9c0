"""Programmatic dependent launch (`strata.engine.dependent_launch`): where it is used, and on
a GPU that has it, that the kernels launched as dependents give the bytes of plain launches
(a kernel that read before the one it follows had finished would not)."""

import dataclasses

import pytest
import torch

from strata.engine import dependent_launch
from strata.engine.model import ops
from strata.engine.model.moe import load_model
from strata.engine.model.tokenizer import Tokenizer
from strata.engine.runtime.generate import GenerateOptions, generate
from support.checkpoints import cached_checkpoint
from support.hopper import compile_for_hopper, spill_bytes


def test_off_cuda_the_kernels_are_launched_plainly(monkeypatch):
    assert dependent_launch.kernel_options(torch.device("cpu")) == {}
    assert not dependent_launch.supported(torch.device("cpu"))
    monkeypatch.setattr(dependent_launch, "supported", lambda device: True)
    assert dependent_launch.kernel_options(torch.device("cpu")) == {"USE_PDL": True,
                                                                     "launch_pdl": True}
    monkeypatch.setattr(dependent_launch, "enabled", False)
    assert dependent_launch.kernel_options(torch.device("cpu")) == {}


def test_on_cuda_every_launch_asks_for_fused_multiply_adds(monkeypatch):
    """Not left to Triton's default, which 3.10 turns to no contraction (other float32
    roundings after an upgrade, and 3.9 warns each run); as dependents or not, and not on the
    host, whose interpreter has no such choice, nor under torch.compile's tracing."""
    cuda = torch.device("cuda")
    assert dependent_launch.compile_options(cuda) == {"enable_fp_fusion": True}
    monkeypatch.setattr(dependent_launch, "supported", lambda device: False)
    assert dependent_launch.kernel_options(cuda) == {"enable_fp_fusion": True}
    monkeypatch.setattr(dependent_launch, "supported", lambda device: True)
    assert dependent_launch.kernel_options(cuda) == {"enable_fp_fusion": True, "USE_PDL": True,
                                                     "launch_pdl": True}
    assert dependent_launch.compile_options(torch.device("cpu")) == {}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dependent_launch.compile_options(cuda) == {}


def test_every_launch_of_our_kernels_passes_its_options():
    """Each `kernel[grid](...)` in the package spreads its options (`kernel_options`,
    `compile_options`, or `launch_with`'s), so none is compiled by Triton's defaults."""
    import ast
    from pathlib import Path

    import strata

    launches = []
    for path in sorted(Path(strata.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                    and "kernels" in ast.unparse(node.func.value):
                spread = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
                launches.append((f"{path.name}:{node.lineno}", spread))
    assert len(launches) >= 25  # every launch site found (a rename would hide them)
    unpassed = [site for site, spread in launches
                if not any(s == "options" or s.startswith("dependent_launch.") for s in spread)]
    assert not unpassed, f"launches without their options: {unpassed}"


def test_a_wrapped_launch_passes_the_switch_off_and_a_plain_one_takes_the_options(monkeypatch):
    def wrap(kernel):  # as torch.library.wrap_triton: takes every argument, launches itself
        return kernel

    assert dependent_launch.launch_with(wrap, torch.device("cpu")) == (wrap, {"USE_PDL": False})
    monkeypatch.setattr(dependent_launch, "supported", lambda device: True)
    launch, options = dependent_launch.launch_with(None, torch.device("cpu"))
    assert launch("kernel") == "kernel" and options == {"USE_PDL": True, "launch_pdl": True}
    assert dependent_launch.launch_with(wrap, torch.device("cpu"))[1] == {"USE_PDL": False}


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.cuda
def test_on_hopper_the_decode_kernels_are_launched_as_dependents():
    if not _hopper():
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    assert dependent_launch.kernel_options(torch.device("cuda")) == {
        "enable_fp_fusion": True, "USE_PDL": True, "launch_pdl": True}


def _chain(x, deltas, weight):
    # 64 norms, each reading the one before's output and sum: a dependent that did not wait
    # would read a row still being written.
    for delta in deltas:
        x, normed = ops.add_rms_norm(x, delta, weight, 1e-6)
        x = x + 0 * normed  # keep both outputs live
        x, _ = ops.add_rms_norm(normed, x, weight, 1e-6)
    return x


@pytest.mark.cuda
def test_on_cuda_a_chain_of_dependent_kernels_replays_the_plain_bytes(monkeypatch):
    if not _hopper():
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4096, generator=gen).to(torch.bfloat16).cuda()
    deltas = [torch.randn(1, 4096, generator=gen).to(torch.bfloat16).cuda() for _ in range(64)]
    weight = torch.rand(4096, generator=gen).to(torch.bfloat16).cuda()
    monkeypatch.setattr(dependent_launch, "enabled", False)
    plain = _chain(x, deltas, weight)
    monkeypatch.setattr(dependent_launch, "enabled", True)
    assert torch.equal(_chain(x, deltas, weight), plain)  # eager, as dependents
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, deltas, weight)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_on_cuda_decode_as_dependents_gives_the_plain_launches_tokens(monkeypatch, family):
    """Every round routes anew, so a kernel that read the routing or a row before its wait
    would compute other experts, or other sums, than the plain launches do."""
    if not _hopper():
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    ckpt = cached_checkpoint(family, "tiny", dtype=torch.bfloat16)
    model, tok = load_model(ckpt, device="cuda"), Tokenizer.from_dir(ckpt)
    prompt = tok.encode("dependent launches")
    # 300 rounds cross the 256-cell window: two graphs; bf16 takes the attention kernel.
    options = GenerateOptions(max_new=300, max_context=512, temperature=0.0, ignore_stop=True)
    monkeypatch.setattr(dependent_launch, "enabled", False)
    plain = generate(model, tok, prompt, options)
    monkeypatch.setattr(dependent_launch, "enabled", True)
    model, tok = load_model(ckpt, device="cuda"), Tokenizer.from_dir(ckpt)  # graphs anew
    dependent = generate(model, tok, prompt, options)
    eager = generate(model, tok, prompt, dataclasses.replace(options, cuda_graphs=False))
    assert dependent.decode_path == "cuda-graph"
    assert dependent.tokens == plain.tokens == eager.tokens
    assert torch.equal(dependent.first_logits, plain.first_logits)


# Kernels that read before their wait, and the pointer arguments they may read there: what no
# kernel of a round writes. Attention's one-token products their weights (the output's with
# the router's, and the norms'); the short attention kernels the round's positions and the
# cells, which the round writes at one position only (`attend_short` reads that row again
# after its wait; `rotate_attend_short` writes it itself, after its wait, and attends the row
# it wrote), and the rotating one the q/k norm's weights.
READ_BEFORE_WAIT = {"product_one": {"w_ptr"}, "add_norm_product_one": {"w_ptr", "norm_w_ptr"},
                    "product_add_norm_route": {"w_ptr", "router_ptr", "norm_w_ptr"},
                    "attend_short": {"k_ptr", "v_ptr", "positions_ptr"},
                    "rotate_attend_short": {"k_ptr", "v_ptr", "positions_ptr", "norm_w_ptr"}}


def _before_wait_only_these_are_read(path, node, allowed):
    """The statements of `node` before `wait_for_prior(USE_PDL)` (at the top level) mention no
    pointer argument but those `allowed` (so they read nothing else, and helpers they call are
    handed nothing else) and store nothing."""
    import ast

    pointers = {a.arg for a in node.args.args if a.arg.endswith("_ptr")}
    for index, stmt in enumerate(node.body):
        if isinstance(stmt, ast.Expr) and ast.unparse(stmt) == "wait_for_prior(USE_PDL)":
            assert index > 0, f"{path.name}: {node.name} is listed as reading before its wait " \
                "but waits first"
            return
        named = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
        assert named & pointers <= allowed, \
            f"{path.name}: {node.name} reads {sorted(named & pointers - allowed)} before its wait"
        calls = {ast.unparse(n.func) for n in ast.walk(stmt) if isinstance(n, ast.Call)}
        assert not {c for c in calls if c.startswith(("tl.store", "tl.atomic"))}, \
            f"{path.name}: {node.name} writes before its wait"
    raise AssertionError(f"{path.name}: {node.name} never waits")


def test_every_kernel_that_can_be_a_dependent_waits_first():
    """The rule `dependent_launch` stands on: a kernel with a USE_PDL switch calls
    `wait_for_prior(USE_PDL)` as its first statement, before it reads or writes anything. A
    kernel added with the switch but without the wait would race the one before it. The
    exceptions, `READ_BEFORE_WAIT`, load only what no kernel of the round writes there."""
    import ast
    from pathlib import Path

    import strata

    root = Path(strata.__file__).parent / "engine"
    switched = []
    for path in sorted(root.rglob("_*_triton.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            if node.name == "wait_for_prior" or \
                    "USE_PDL" not in [arg.arg for arg in node.args.args]:
                continue
            switched.append(node.name)
            if node.name in READ_BEFORE_WAIT:
                _before_wait_only_these_are_read(path, node, READ_BEFORE_WAIT[node.name])
                continue
            first = node.body[0]
            assert isinstance(first, ast.Expr) and ast.unparse(first) == \
                "wait_for_prior(USE_PDL)", f"{path.name}: {node.name} does not wait first"
    assert {"add_rms_norm", "qk_norm_rope", "route", "router_route", "add_norm_router_route",
            "rope_and_mask", "gate_up_act", "down", "down_sum", "combine", "decode_attention",
            "int8_act", "int8_down", "int4_act", "int4_down", "argmax_blocks", *READ_BEFORE_WAIT} \
        <= set(switched)


def _hopper_ptx(kernel, constexprs, types, num_warps=4):
    """`kernel` compiled for compute capability 9.0 as a dependent (no GPU needed): its PTX."""
    return compile_for_hopper(kernel, constexprs, types, num_warps).asm["ptx"]


def _loads_around_the_wait(ptx):
    before, _, after = ptx.partition("griddepcontrol.wait")
    assert after, "no griddepcontrol.wait in the kernel"
    return before.count("ld.global"), after.count("ld.global")


def test_compiled_for_hopper_the_products_kernel_loads_its_weights_before_the_wait():
    """The source rule above, checked where it counts: in the instructions. The weight tile's
    vector loads come before `griddepcontrol.wait` (the compiler did not sink them past it),
    and with a norm the norm's weight too; the token's after; a wait-first kernel loads
    nothing before it."""
    from strata.engine.model import _ops_triton, _products_triton

    ptx = _hopper_ptx(_products_triton.product_one,
                      {"HAS_BIAS": False, "BLOCK_N": 2, "BLOCK_K": 2048}, {})
    before, after = _loads_around_the_wait(ptx)
    # 2 x 2048 bf16 over 128 threads: 32 a thread, four 16-byte loads; then x's.
    assert before == 4 and "ld.global.v4.b32" in ptx.partition("griddepcontrol.wait")[0]
    assert after >= 1
    fused = _hopper_ptx(_products_triton.add_norm_product_one,
                        {"HAS_DELTA": True, "HAS_BIAS": False, "BLOCK_N": 4, "BLOCK_K": 2048},
                        {"eps": "fp32"}, num_warps=8)
    # 4 x 2048 bf16 over 256 threads: the same four, and the norm's 2048 one more; then x's
    # and delta's, and no load after the norm's reduction.
    before, after = _loads_around_the_wait(fused)
    assert before == 5 and after == 2
    assert _loads_after_the_first_sync(fused.partition("griddepcontrol.wait")[2]) == 0
    norm = _hopper_ptx(_ops_triton.add_rms_norm, {"HAS_DELTA": True, "BLOCK_D": 2048},
                       {"eps": "fp32"}, num_warps=8)
    assert _loads_around_the_wait(norm)[0] == 0  # x, delta and the weight at once after it
    assert _loads_after_the_first_sync(norm.partition("griddepcontrol.wait")[2]) == 0


def _loads_after_the_first_sync(ptx):
    """How many loads from global memory `ptx` issues after its first `bar.sync` (the first
    reduction's): each such load is a trip to memory the kernel waits on after the trips
    before it, rather than alongside them."""
    return ptx.partition("bar.sync")[2].count("ld.global") \
        + ptx.partition("bar.sync")[2].count("ld.volatile.global")


def test_compiled_for_hopper_the_last_program_of_the_routing_loads_all_it_reads_at_once():
    """`product_add_norm_route`'s last program to arrive, on which the experts' kernel waits:
    the whole row h, every program's part of the logits and the norm's weight are loaded
    before its first reduction (one trip to memory), none after it."""
    import re

    from strata.engine.model import _products_triton

    ptx = _hopper_ptx(_products_triton.product_add_norm_route,
                      {"HAS_BIAS": False, "NORMALIZE": False, "BLOCK_N": 8, "BLOCK_K": 2048,
                       "BLOCK_ROW": 2048, "BLOCK_P": 256, "BLOCK_E": 64, "BLOCK_TOP_K": 8},
                      {"partial_ptr": "*fp32", "arrived_ptr": "*i32", "ids_ptr": "*i64",
                       "weights_ptr": "*fp32", "eps": "fp32"}, num_warps=8)
    arrived = ptx.partition("atom.global")[2]
    last = re.split(r"\bbra\b", arrived, maxsplit=1)[1]  # past the branch on the count
    first = last.partition("bar.sync")[0]
    # h: 2048 bf16 over 256 threads, one 16-byte load; the parts: 256 x 64 float32, 16.
    assert first.count("ld.volatile.global") == 17 and first.count("ld.global") == 1
    assert _loads_after_the_first_sync(last) == 0


def test_compiled_for_hopper_the_router_and_down_sum_read_nothing_before_the_wait():
    """Both wait first: reading the router's first block of weights, or down's index and
    first tile, before the wait was timed and was no faster
    (bench/results/profile-control-h100-2026-12-06.md)."""
    from strata.engine.experts import _grouped_triton
    from strata.engine.model import _ops_triton

    types = {"partial_ptr": "*fp32", "arrived_ptr": "*i32", "ids_ptr": "*i64",
             "weights_ptr": "*fp32", "eps": "fp32"}
    router = _hopper_ptx(_ops_triton.add_norm_router_route,
                         {"HAS_DELTA": True, "NORMALIZE": True, "SPLITS": 64, "BLOCK_ROW": 2048,
                          "BLOCK_D": 32, "BLOCK_E": 64, "BLOCK_K": 8}, types, num_warps=8)
    down = _hopper_ptx(_grouped_triton.down_sum, {"BLOCK_D": 8, "BLOCK_F": 1024, "BLOCK_R": 8},
                       {"arrived_ptr": "*i32", "weights_ptr": "*fp32"}, num_warps=8)
    for ptx in (router, down):
        before, after = _loads_around_the_wait(ptx)
        assert before == 0 and after > 0


def test_compiled_for_hopper_down_sums_last_program_loads_its_rows_at_once():
    """`down_sum`'s last program to arrive (on which the next kernel waits) sums its K rows
    in BLOCK_R unrolled steps: every row's and weight's load is in the code after the count,
    none in a loop that would issue them a trip to memory apart (1.006x and 1.004x the
    olmoe-1b-7b round on an H200, bench/results/h200-figures-2026-12-07.md)."""
    import re

    from strata.engine.experts import _grouped_triton

    ptx = _hopper_ptx(_grouped_triton.down_sum, {"BLOCK_D": 32, "BLOCK_F": 128, "BLOCK_R": 8},
                      {"arrived_ptr": "*i32", "weights_ptr": "*fp32"}, num_warps=8)
    last = ptx.partition("atom.global")[2]
    assert last.count("ld.volatile.global") == 8 and last.count("ld.global") == 8
    assert len(re.findall(r"\bbra\b", last)) == 1  # past the sum, not back into a loop


@pytest.mark.parametrize("cells, values_first", [(128, True), (256, False)])
def test_compiled_for_hopper_the_short_attention_reads_the_cells_before_the_wait(cells,
                                                                                 values_first):
    """The keys' loads (and at 128 cells the values') before the wait; q, the written row and
    the mask after it, the row as volatile loads (past the L1 cache, which may hold the row
    read before the wait)."""
    from strata.engine.model import _attention_triton

    ptx = _hopper_ptx(_attention_triton.attend_short,
                      {"HAS_MASK": True, "BLOCK_C": cells, "BLOCK_R": 16, "BLOCK_D": 128,
                       "VALUES_FIRST": values_first},
                      {"positions_ptr": "*i64", "scale": "fp32"}, num_warps=8)
    before, after = _loads_around_the_wait(ptx)
    # [cells, 128] bf16 over 256 threads in 16-byte loads: cells / 16 a matrix, and the position
    assert before == (2 if values_first else 1) * cells // 16 + 1
    assert "ld.volatile.global" in ptx.partition("griddepcontrol.wait")[2]
    assert after >= 2


@pytest.mark.parametrize("norm", [0, 1, 2])
def test_compiled_for_hopper_the_rotating_short_kernel_reads_the_cells_before_the_wait(norm):
    """The keys' halves before the wait (and the position), and with a norm its weights; the
    projection, the rotation's tables and the mask after it, with a norm all of them before
    its first reduction: only the values' loads after that (at 256 cells they come once the
    keys are spent). Without a norm the mask's row is loaded after the keys' products: held
    across them it spilled at 8 warps (255 registers a thread). Compiling also checks what
    the interpreter does not: the helpers it shares with `qk_norm_rope` type-check (one
    return type each)."""
    from strata.engine.model import _attention_triton, _ops_triton

    compiled = compile_for_hopper(_attention_triton.rotate_attend_short,
                                  {"NORM": norm, "HAS_MASK": True, "BLOCK_C": 256,
                                   "BLOCK_R": 16, "BLOCK_P": 32, "HEAD_DIM": 128,
                                   "VALUES_FIRST": False},
                                  {"positions_ptr": "*i64", "eps": "fp32", "scale": "fp32"},
                                  num_warps=8)
    ptx = compiled.asm["ptx"]
    assert spill_bytes(compiled) == 0  # without a norm the mask's row comes after the products
    before, after = _loads_around_the_wait(ptx)
    keys = 2 * 256 * 64 // (256 * 8) + 1
    assert (before > keys if norm else before == keys) and after > 0
    if norm:  # the values: [256, 128] bf16 over 256 threads, sixteen 16-byte loads
        assert _loads_after_the_first_sync(ptx.partition("griddepcontrol.wait")[2]) == 16
    for write in (False, True):
        rope = _hopper_ptx(_ops_triton.qk_norm_rope,
                           {"NORM": norm, "WRITE": write, "HEAD_DIM": 128, "BLOCK_P": 32},
                           {"positions_ptr": "*i64", "eps": "fp32"})
        assert _loads_around_the_wait(rope)[0] == 0
        if not write:  # its heads, weights and tables at once (writing, v's copy comes after)
            assert _loads_after_the_first_sync(rope.partition("griddepcontrol.wait")[2]) == 0
