"""strata: run Mixture-of-Experts models larger than the GPU.

Layers, bottom up (docs/architecture.md): `strata._vmm` owns memory, `strata._residency` keeps the
books, `strata.policies` decides, `strata.engine` executes.
"""

__version__ = "0.1.0"
