"""bench/cpu_experts.py's calls started on the CPU's own thread, as the cache starts a decode
call on CUDA (`CpuExperts.start`, then `finish`): its `start-*` columns, a `CpuExperts` each,
and the call that times one.
"""

from __future__ import annotations

import itertools

import torch

from strata.engine.experts.cpu import CpuCallTimes, CpuExperts
from strata.engine.experts.routed import Routed


def started_columns(cpu: CpuExperts, quantized_cpu: dict[str, CpuExperts], n_tokens: int,
                    threads: int | None, weight_rows: tuple[tuple[int, int], ...] = (),
                    down_blocks: tuple[int, ...] = (), pinned: bool = False
                    ) -> dict[str, CpuExperts]:
    """`start-SCHEDULE` and `start-SCHEDULE-int8`/`-int4`: a CpuExperts per schedule ("dynamic",
    "steal", and "steal-alone": steal with the thread in `finish` only waiting,
    `caller_helps` off) over the store and each quantized one, for a decode call (T = 1)
    where strata's kernel computes it, `start-SCHEDULE-rowsGxD` (dynamic and steal) with
    `CpuExperts.gate_up_rows` G and `down_rows` D for each (G, D) of `weight_rows`, and
    `start-SCHEDULE-downblockN` with `down_block_rows` N for each of `down_blocks`, and with
    `pinned` `start-dynamic-pinned`, the team pinned one CPU a thread (`pin_team`); none
    otherwise."""
    if n_tokens != 1 or cpu.kernel != "strata":
        return {}
    stores = {"": cpu.store, **{name.removeprefix("compute"): q.store
                                for name, q in quantized_cpu.items()}}
    columns = {}
    for suffix, store in stores.items():
        for schedule in ("dynamic", "steal", "steal-alone"):
            cpu = columns[f"start-{schedule}{suffix}"] = CpuExperts(store, threads)
            cpu.schedule = schedule.removesuffix("-alone")
            cpu.caller_helps = not schedule.endswith("-alone")
        for (gate_up, down), schedule in itertools.product(weight_rows, ("dynamic", "steal")):
            cpu = columns[f"start-{schedule}-rows{gate_up}x{down}{suffix}"] = \
                CpuExperts(store, threads)
            cpu.schedule, cpu.gate_up_rows, cpu.down_rows = schedule, gate_up, down
        for n_rows, schedule in itertools.product(down_blocks, ("dynamic", "steal")):
            cpu = columns[f"start-{schedule}-downblock{n_rows}{suffix}"] = \
                CpuExperts(store, threads)
            cpu.schedule, cpu.down_block_rows = schedule, n_rows
        if pinned:
            cpu = columns[f"start-dynamic-pinned{suffix}"] = CpuExperts(store, threads)
            cpu.pin_team = True
    return columns


def start_and_finish(cpu: CpuExperts, layer: int, x_one: torch.Tensor, routed: Routed,
                     out: torch.Tensor) -> CpuCallTimes:
    """A decode call as the cache runs it on CUDA: `start` on the worker's thread with the
    token's one row x_one [1, D], then `finish` (which, under "steal", takes tasks too); where
    its time went (`CpuExperts.last_call`)."""
    if not cpu.start(layer, x_one, routed, out):
        raise RuntimeError("CpuExperts.start did not take a decode call")
    cpu.finish()
    return cpu.last_call()
