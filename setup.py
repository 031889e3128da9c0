"""Builds the Cython extensions; everything else is in setup.cfg.

Compiler directives are set here, once, for every module. STRATA_CYTHON_DEBUG=1 turns bounds,
wraparound and initialisation checks back on (then rebuild: `python setup.py build_ext --inplace`).
STRATA_BUILD_ONLY=_vmm (a comma list) builds only those extensions, e.g. while one is mid-edit.
"""

import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("STRATA_CYTHON_DEBUG", "0") not in ("", "0")

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}

extensions = [
    Extension("strata._vmm", ["src/strata/_vmm.pyx"]),
    Extension(
        "strata._residency",
        ["src/strata/_residency.pyx"],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
    # -ffp-contract=off: the lfu replay must round as numpy does (no fused multiply-add).
    Extension(
        "strata.sim._kernels",
        ["src/strata/sim/_kernels.pyx"],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-ffp-contract=off"],
    ),
    # The CPU experts' kernel: OpenMP threads over the experts' rows (cython.parallel.prange);
    # -O3 for its vector loops (src/strata/_cpu_experts_dot.h).
    Extension(
        "strata._cpu_experts",
        ["src/strata/_cpu_experts.pyx"],
        include_dirs=[numpy.get_include(), "src/strata"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-fopenmp", "-O3"],
        extra_link_args=["-fopenmp"],
    ),
]

only = {name for name in os.environ.get("STRATA_BUILD_ONLY", "").split(",") if name}
if only:
    extensions = [ext for ext in extensions if ext.name.removeprefix("strata.") in only]

setup(ext_modules=cythonize(extensions, compiler_directives=directives, force=DEBUG))
