"""The host path on a host-bound model: graphmode's step against a bare
``graph.replay()`` and the best hand-written graphs, host time and latency.

The model (2 layers, hidden 256) is small enough that its graph runs shorter
than the launch path, so every microsecond of host work shows in the step.
Per batch size, median of ``--repeats`` calls, microseconds:

- host: call to return, the device synchronised (idle) before each call;
- step: call to the device finishing the step.

Rows: ``replay`` a bare ``graph.replay()``; ``hand pinned`` one packed pinned
host-to-device copy then replay (the host packs the step into the pinned
buffer first); ``hand in-graph`` the same copy captured as the graph's first
node; ``graphmode dev`` the runner with device inputs (device-side fill);
``graphmode host`` the runner with host inputs (host staging). Ratios are to
the bare replay and to ``hand pinned``.

    python scripts/profile_host_cost.py --host-bound --batches 1,8,64,256
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import graphmode
from graphmode.bench.packed import HandPacked as HandWritten
from graphmode.bench.workload import Workload
from graphmode.model import ModelConfig
from graphmode.staging import to_host

HOST_BOUND = ModelConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=512, vocab_size=1024, dtype=torch.bfloat16)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, float]:
    """Median host and step microseconds of ``call``, the device idle before each."""
    hosts, steps = [], []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        call()
        returned = time.perf_counter()
        sync(device)
        hosts.append(returned - started)
        steps.append(time.perf_counter() - started)
    return statistics.median(hosts) * 1e6, statistics.median(steps) * 1e6


def run(batches: list[int], device: torch.device, repeats: int) -> None:
    workload = Workload.build(HOST_BOUND, device, max_batches=max(batches), steps=4)

    def runner(**options: Any) -> graphmode.GraphRunner:
        return graphmode.build_graph_runner(workload.model, max_batches=workload.max_batches,
                                            max_blocks_per_seq=workload.width, block_size=workload.block_size,
                                            device=device, capture_batch_sizes=batches, **options)

    on_device, on_host = runner(host_staging=False), runner(host_staging=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU emulator"
    print(f"{name}, torch {torch.__version__}; 2-layer hidden-256 bf16 model; median of {repeats}, microseconds")
    print(f"{'batch':>5} {'path':16} {'host':>8} {'step':>8} {'host/replay':>12} {'host/hand':>10} {'step/hand':>10}")
    with torch.inference_mode():
        for batch in batches:
            step = workload.steps(batch, 2)[0]
            host_step = to_host(step, device)
            pinned = HandWritten(workload.model, step, workload.kv_cache, in_graph=False)
            in_graph = HandWritten(workload.model, step, workload.kv_cache, in_graph=True)
            attn, host_attn = step.attn_metadata, host_step.attn_metadata
            results = [
                on_device(step.input_ids, step.position_ids, workload.kv_cache, attn).clone(),
                on_host(host_step.input_ids, host_step.position_ids, workload.kv_cache, host_attn).clone(),
                pinned(host_step).clone(),
                in_graph(host_step).clone(),
            ]
            differs = max(float((r.float() - results[0].float()).abs().max()) for r in results)
            rows = {
                "replay": timed(pinned.graph.replay, device, repeats),
                "hand pinned": timed(lambda: pinned(host_step), device, repeats),
                "hand in-graph": timed(lambda: in_graph(host_step), device, repeats),
                "graphmode dev": timed(lambda: on_device(step.input_ids, step.position_ids, workload.kv_cache, attn),
                                       device, repeats),
                "graphmode host": timed(lambda: on_host(host_step.input_ids, host_step.position_ids,
                                                        workload.kv_cache, host_attn), device, repeats),
            }
            replay, hand = rows["replay"], rows["hand pinned"]
            for path, (host, latency) in rows.items():
                print(f"{batch:5d} {path:16} {host:8.1f} {latency:8.1f} {host / replay[0]:12.2f} "
                      f"{host / hand[0]:10.2f} {latency / hand[1]:10.2f}")
            print(f"{'':5} outputs of the four paths differ by at most {differs:.3g}")
    if on_host.staging is not None and device.type == "cuda":
        staging = on_host.staging
        launch = timed(lambda: staging.launch(batches[-1]), device, repeats)[0]
        print(f"\nhost staging: the packed copy's launch and its event record {launch:.1f} us (bucket {batches[-1]}), "
              f"taking the next mirror (a wait on a completed event) {timed(staging.begin, device, repeats)[0]:.1f} us; "
              f"arena {staging.nbytes} bytes")
