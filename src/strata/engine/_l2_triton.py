"""The device side of `strata.engine.l2_ahead` (imported only when Triton is there)."""

import triton
import triton.language as tl

# One prefetch of the line holding $1 into L2, marked to be evicted last.
_LINE = tl.constexpr("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;")
# One bulk prefetch of $2 bytes from $1 into L2 (sm_90's asynchronous copy unit), marked to be
# evicted last; nothing where $2 is 0.
_BULK = tl.constexpr("""{
    .reg .pred ask;
    .reg .b64 policy;
    setp.ne.u32 ask, $2, 0;
    createpolicy.fractional.L2::evict_last.b64 policy, 1.0;
    @ask cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy;
    mov.u32 $0, 0;
}""")


@triton.jit
def ask_into_l2(ptr, n, part, parts, CHUNK: tl.constexpr, STEP: tl.constexpr,
                BULK: tl.constexpr):
    # Part `part` of `parts` of the n elements at ptr asked into the L2 cache, marked to be
    # evicted last, in chunks of CHUNK elements, STEP chunks a step, every parts-th step from
    # `part` on. BULK: one `cp.async.bulk.prefetch.L2` of each chunk's bytes (a multiple of
    # 16 from a 16-byte aligned address: the caller's CHUNK and ptr; a last chunk's bytes
    # rounded down to one); else one
    # `prefetch.global.L2` of the line (or sector) at each chunk's start, a chunk being that
    # line. Neither loads into registers or is waited for by the program, which goes on at
    # once; the memory system fetches the bytes. Past the end a line prefetch asks for the
    # last element's line again (it takes no mask); a bulk one asks for nothing there.
    element_bytes: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    for start in range(part * STEP * CHUNK, n, parts * STEP * CHUNK):
        at = start + tl.arange(0, STEP) * CHUNK  # [STEP]
        if BULK:
            size = tl.minimum(tl.maximum(n - at, 0), CHUNK) * element_bytes // 16 * 16
            tl.inline_asm_elementwise(_BULK, "=r,l,r", [ptr + at, size.to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_LINE, "=r,l", [ptr + tl.minimum(at, n - 1)],
                                      dtype=tl.int32, is_pure=False, pack=1)
