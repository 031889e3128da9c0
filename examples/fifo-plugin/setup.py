# The rule is Cython: it cimports strata's CacheRule, so strata must be importable here.
from Cython.Build import cythonize
from setuptools import setup

setup(ext_modules=cythonize("strata_fifo/rule.pyx", language_level=3))
