"""The device side of `strata.engine.cache_hints` (imported only when Triton is there)."""

import triton
import triton.language as tl


@triton.jit
def ask_into_l2(ptr, n, part, parts, LINE: tl.constexpr, STEP: tl.constexpr,
                LAST: tl.constexpr):
    # Part `part` of `parts` of the n elements at ptr asked into the L2 cache: one
    # `prefetch.global.L2` a line of LINE elements (128 bytes), STEP lines a step, every
    # parts-th step from `part` on; marked to be evicted last where LAST. A prefetch loads
    # nothing into registers, but the program ends only once its prefetches have been served
    # (an H100 took as long as for a read of the bytes: bench/results/
    # l2-ahead-h100-2026-12-06.md). Past the end a step asks for the last element's line
    # again: a prefetch takes no mask.
    for start in range(part * STEP * LINE, n, parts * STEP * LINE):
        at = tl.minimum(start + tl.arange(0, STEP) * LINE, n - 1)  # [STEP]
        if LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [ptr + at], dtype=tl.int32, is_pure=False,
                                      pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [ptr + at], dtype=tl.int32, is_pure=False, pack=1)
