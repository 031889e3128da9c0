"""The device side of `strata.engine.dependent_launch` (imported only when Triton is there)."""

import triton
import triton.language as tl


@triton.jit
def wait_for_prior(USE_PDL: tl.constexpr):
    # First thing in a kernel launched as a dependent: wait until the kernel before it has
    # finished and its writes are visible, then let the next dependent be set up. A plain
    # launch (USE_PDL False) compiles to nothing here.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
