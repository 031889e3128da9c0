# Included by _cpu_experts.pyx: the work of one task of each pass over a `Call`, its weight rows
# dotted one, two or four at a time with one row of x (`Call.gate_up_rows`, `down_rows`) or
# four rows of x at a time with one weight row (a quantized expert's many rows).


cdef inline void _dots(const uint8_t *blob, int fmt, const int64_t *rows, int n_rows,
                       int64_t f_width, int64_t d_hidden, int64_t scales_at, const float *x,
                       int64_t prefetch, float *out) noexcept nogil:
    """out[j] = `_dot` of the blob's row rows[j] (gate 0..F-1, up F..2F-1, down 2F..2F+D-1;
    all of one length: gate and up rows, or down rows) with x, j < n_rows (at most 4): bf16
    and int8 rows read at once, int4 rows one at a time. The same bytes as n_rows `_dot`s."""
    cdef int64_t starts[4]
    cdef const void *weights[4]
    cdef int64_t n = d_hidden if rows[0] < 2 * f_width else f_width
    cdef float scale
    cdef int j
    for j in range(n_rows):
        starts[j] = rows[j] * d_hidden if rows[j] < 2 * f_width \
            else 2 * f_width * d_hidden + (rows[j] - 2 * f_width) * f_width
    if fmt == _BF16:
        for j in range(n_rows):
            weights[j] = <const uint16_t *>blob + starts[j]
        strata_dots_bf16_f32(<const uint16_t *const *>weights, n_rows, x, n, out, prefetch)
    elif fmt == _INT8:
        for j in range(n_rows):
            weights[j] = <const int8_t *>blob + starts[j]
        strata_dots_i8_f32(<const int8_t *const *>weights, n_rows, x, n, out, prefetch)
        for j in range(n_rows):
            memcpy(&scale, blob + scales_at + 4 * rows[j], 4)  # scales need not be aligned
            out[j] = out[j] * scale
    else:
        for j in range(n_rows):
            out[j] = _dot(blob, fmt, starts[j], rows[j], scales_at, n, x, prefetch)


cdef inline void _dot4(const uint8_t *blob, int fmt, int64_t start, int64_t row,
                       int64_t scales_at, int64_t n, const float *x, int64_t x_stride,
                       float *out) noexcept nogil:
    """out[j] = `_dot` of a quantized row with the row x + j * x_stride, j = 0..3, the row
    read once (the same bytes as four `_dot`s)."""
    cdef float scale
    cdef const float *rows[4]
    cdef int j
    for j in range(4):
        rows[j] = x + j * x_stride
    if fmt == _INT8:
        memcpy(&scale, blob + scales_at + 4 * row, 4)  # a blob's scales need not be aligned
        strata_dot4_i8_f32(<const int8_t *>blob + start, rows, n, out)
        for j in range(4):
            out[j] = out[j] * scale
    else:
        strata_dot4_i4_f32(blob + start // 2, <const float *>(blob + scales_at)
                           + start // _group(fmt), rows, n, _group(fmt), out)


cdef inline float _activation(float g, float u) noexcept nogil:
    """act = bf16(silu(bf16(g)) * bf16(u)), torch's roundings."""
    g = _round(g)
    return _round(_round(g / (1.0 + expf(-g))) * _round(u))


cdef inline void _activations4(const Call *c, const uint8_t *blob, int64_t f,
                                int64_t scales_at, int64_t r) noexcept nogil:
    """act[r..r+3, f] of a quantized expert, its gate and up rows f read once for the four (the
    sums on this call's stack: a thread's own)."""
    cdef int64_t d_hidden = c.d_hidden
    cdef const float *x = c.x + r * c.x_stride
    cdef float gs[4]
    cdef float us[4]
    cdef int j
    _dot4(blob, c.fmt, f * d_hidden, f, scales_at, d_hidden, x, c.x_stride, gs)
    _dot4(blob, c.fmt, (c.f_width + f) * d_hidden, c.f_width + f, scales_at, d_hidden, x,
          c.x_stride, us)
    for j in range(4):
        c.act[(r + j) * c.f_width + f] = _activation(gs[j], us[j])


cdef inline void _outputs4(const Call *c, const uint8_t *blob, int64_t d, int64_t down_at,
                           int64_t scales_at, int64_t r) noexcept nogil:
    """out[r..r+3, d] of a quantized expert, its down row d read once for the four."""
    cdef int64_t f_width = c.f_width
    cdef float ys[4]
    cdef int j
    _dot4(blob, c.fmt, down_at + d * f_width, 2 * f_width + d, scales_at, f_width,
          c.act + r * f_width, f_width, ys)
    for j in range(4):
        c.out[(r + j) * c.d_hidden + d] = strata_f32_to_bf16(ys[j])


cdef inline int64_t _rows_of_four(const Call *c, int64_t i) noexcept nogil:
    """Expert i's rows taken four at a time (a quantized expert's; 0 for bf16): the first
    4 * (rows // 4), the rest one at a time."""
    if c.fmt == _BF16:
        return 0
    return (c.row_starts[i + 1] - c.row_starts[i]) // 4 * 4


cdef inline void _activations_one(const Call *c, const uint8_t *blob, int64_t f, int64_t f_end,
                                  int64_t scales_at, int64_t r) noexcept nogil:
    """act[r, f..f_end-1] of one row of x: gate's and up's rows of each f, `Call.gate_up_rows`
    of them read at once (1: one at a time; 2: gate's and up's of one f; 4: those of two f,
    half the block apart: four places in memory, a stream each)."""
    cdef int64_t f_width = c.f_width
    cdef const float *x = c.x + r * c.x_stride
    cdef int64_t rows[4]
    cdef float sums[4]
    cdef int64_t half = (f_end - f) // 2 if c.gate_up_rows == 4 else 0
    cdef int64_t i
    for i in range(half):  # f + i and f + half + i at once
        rows[0] = f + i
        rows[1] = f_width + f + i
        rows[2] = f + half + i
        rows[3] = f_width + f + half + i
        _dots(blob, c.fmt, rows, 4, f_width, c.d_hidden, scales_at, x, c.prefetch, sums)
        c.act[r * f_width + f + i] = _activation(sums[0], sums[1])
        c.act[r * f_width + f + half + i] = _activation(sums[2], sums[3])
    f = f + 2 * half
    while f < f_end:
        if c.gate_up_rows == 1:
            sums[0] = _dot(blob, c.fmt, f * c.d_hidden, f, scales_at, c.d_hidden, x, c.prefetch)
            sums[1] = _dot(blob, c.fmt, (f_width + f) * c.d_hidden, f_width + f, scales_at,
                           c.d_hidden, x, c.prefetch)
        else:
            rows[0] = f
            rows[1] = f_width + f
            _dots(blob, c.fmt, rows, 2, f_width, c.d_hidden, scales_at, x, c.prefetch, sums)
        c.act[r * f_width + f] = _activation(sums[0], sums[1])
        f = f + 1


cdef inline void _activation_task(const Call *c, int64_t n_blocks, int64_t scales_at,
                                  int64_t task) noexcept nogil:
    """Pass 1's task `task`: act[r, f] for one block of BLOCK_ROWS f of one expert, every row."""
    cdef int64_t i = task // n_blocks
    cdef const uint8_t *blob = c.blobs + c.experts[i] * c.blob_bytes
    cdef int64_t f0 = (task % n_blocks) * BLOCK_ROWS
    cdef int64_t f_end = min(f0 + BLOCK_ROWS, c.f_width)
    cdef int64_t r_four = c.row_starts[i] + _rows_of_four(c, i)
    cdef int64_t f, r
    for f in range(f0, f_end):  # four rows a weight row read
        for r in range(c.row_starts[i], r_four, 4):
            _activations4(c, blob, f, scales_at, r)
    for r in range(r_four, c.row_starts[i + 1]):
        _activations_one(c, blob, f0, f_end, scales_at, r)


cdef inline void _outputs_one(const Call *c, const uint8_t *blob, int64_t d, int64_t d_end,
                              int64_t scales_at, int64_t r) noexcept nogil:
    """out[r, d..d_end-1] of one row of act: down's rows, `Call.down_rows` adjacent ones read at
    once (one stream through memory, as one at a time reads it, each row prefetching ahead of
    itself), the block's last rows one at a time."""
    cdef int64_t f_width = c.f_width
    cdef const float *act = c.act + r * f_width
    cdef int64_t rows[4]
    cdef float sums[4]
    cdef int k = c.down_rows
    cdef int j
    while k > 1 and d + k <= d_end:
        for j in range(k):
            rows[j] = 2 * f_width + d + j
        _dots(blob, c.fmt, rows, k, f_width, c.d_hidden, scales_at, act, c.prefetch, sums)
        for j in range(k):
            c.out[r * c.d_hidden + d + j] = strata_f32_to_bf16(sums[j])
        d = d + k
    while d < d_end:
        c.out[r * c.d_hidden + d] = strata_f32_to_bf16(_dot(
            blob, c.fmt, 2 * f_width * c.d_hidden + d * f_width, 2 * f_width + d, scales_at,
            f_width, act, c.prefetch))
        d = d + 1


cdef inline void _output_task(const Call *c, int64_t n_blocks, int64_t scales_at,
                              int64_t task) noexcept nogil:
    """Pass 2's task `task`: out[r, d] for one block of `Call.down_block` d of one expert, every
    row."""
    cdef int64_t down_at = 2 * c.f_width * c.d_hidden  # elements before down's first row
    cdef int64_t i = task // n_blocks
    cdef const uint8_t *blob = c.blobs + c.experts[i] * c.blob_bytes
    cdef int64_t d0 = (task % n_blocks) * c.down_block
    cdef int64_t d_end = min(d0 + c.down_block, c.d_hidden)
    cdef int64_t r_four = c.row_starts[i] + _rows_of_four(c, i)
    cdef int64_t d, r
    for d in range(d0, d_end):  # four rows a weight row read
        for r in range(c.row_starts[i], r_four, 4):
            _outputs4(c, blob, d, down_at, scales_at, r)
    for r in range(r_four, c.row_starts[i + 1]):
        _outputs_one(c, blob, d0, d_end, scales_at, r)
