"""strata: run Mixture-of-Experts models larger than the GPU.

Layers, bottom up (docs/architecture.md): `strata._vmm` owns memory, `strata._residency` keeps the
books, `strata.policies` decides, `strata.engine` executes.

`strata.Engine` (`strata.engine.runtime.engine.Engine`) is loaded on first use, so that
`import strata` stays free of torch.
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from strata.engine.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'strata' has no attribute {name!r}")
