"""What ``graphmode bench`` prints of a decode run: the table of median
steps, the HBM floor, the ratios between modes, graphmode's costs (host,
capture, compile), each vendor's padding waste, and the plot."""

from __future__ import annotations

from typing import Any

from graphmode.bench.measure import difference_text
from graphmode.bench.startup import print_startup

WASTE_UP_TO = 256  # the padding-waste summary's batch sizes: 1..256


def print_table(results: dict[str, Any]) -> None:
    latency = results["latency_ms"]
    modes = list(latency)
    short = {m: m.replace("graphmode", "gm").replace("hand-written graph", "hand").replace("torch.compile reduce-overhead", "compile")
             .replace(" over torch.compile", "+compile").replace(" (exact size)", "-exact") for m in modes}
    print("\nmedian decode step, ms (device-synchronised)")
    print("batch " + " ".join(f"{short[m]:>13s}" for m in modes))
    for batch in results["batches"]:
        cells = []
        for mode in modes:
            value = latency[mode].get(batch)
            cells.append(f"{value:13.3f}" if value is not None else f"{'failed':>13s}")
        print(f"{batch:5d} " + " ".join(cells))
    floor = results["floor"]
    if floor:
        print_floor(results, modes, short)
    else:
        print(f"\nno HBM floor off CUDA (give --hbm-tbps); attention {results['attention']}")
    print_ratios(results, modes)
    print_costs(results)
    print_startup(results.get("startup", {}), results.get("startup_batch", 1))


def print_floor(results: dict[str, Any], modes: list[str], short: dict[str, str]) -> None:
    latency, floor = results["latency_ms"], results["floor"]
    print(f"\nstep time / HBM floor (weights + KV read once at {floor['bandwidth_Bps'] / 1e12:.2f} TB/s, "
          f"{floor['source']}); attention {results['attention']}")
    print("batch  floor ms " + " ".join(f"{short[m]:>13s}" for m in modes))
    for batch in results["batches"]:
        least = floor["ms"][batch]
        cells = [f"{latency[m][batch] / least:12.2f}x" if latency[m].get(batch) else f"{'-':>13s}" for m in modes]
        print(f"{batch:5d} {least:9.3f} " + " ".join(cells))


def print_ratios(results: dict[str, Any], modes: list[str]) -> None:
    latency = results["latency_ms"]
    reference = "hand-written graph" if "hand-written graph" in latency else None
    ours = "graphmode[cuda]" if "graphmode[cuda]" in latency else next((m for m in modes if m.startswith("graphmode[")), None)
    lines = []
    for batch in results["batches"]:
        parts = []
        if ours is None:
            break
        if latency[ours].get(batch) and latency.get("eager", {}).get(batch):
            parts.append(f"eager/graphmode {latency['eager'][batch] / latency[ours][batch]:.2f}x")
        if reference and latency[reference].get(batch) and latency[ours].get(batch):
            parts.append(f"graphmode/hand-written {latency[ours][batch] / latency[reference][batch] - 1:+.1%}")
        compiled = latency.get("torch.compile reduce-overhead", {}).get(batch)
        if compiled and latency[ours].get(batch):
            parts.append(f"graphmode/compile {latency[ours][batch] / compiled - 1:+.1%}")
        over = latency.get("graphmode[cuda] over torch.compile", {}).get(batch)
        if compiled and over:
            parts.append(f"graphmode-over-compile/compile {over / compiled - 1:+.1%}")
        if parts:
            lines.append(f"{batch:5d} " + ", ".join(parts))
    if lines:
        print("\nratios", *lines, sep="\n")


def print_costs(results: dict[str, Any]) -> None:
    if results["host"]:
        print("\ngraphmode host cost per step (runner call minus graph launch, us; the device idle before each "
              "call; against the hand-packed floor's call, as scripts/host_path.py)")
        for batch, cost in results["host"].items():
            host = difference_text(cost["host_cost_us"], cost["noise_us"])
            native = f", native step {cost['native_calls']}/{cost['calls']} calls" if "native_calls" in cost else ""
            floor = (f", floor {cost['floor_us']:.1f}: call/floor {cost['floor_ratio']:.2f}"
                     if "floor_us" in cost else "")
            print(f"{batch:5d} {host:>10s} (call {cost['runner_call_us']:.1f}, launch "
                  f"{cost['graph_launch_us']:.1f}{floor}{native})")
    if "capture" in results:
        every, alone = results["capture"]["all_buckets"], results["capture"]["largest_alone"]
        ratio = every["graph_memory_bytes"] / max(alone["graph_memory_bytes"], 1)
        print(f"\ncapture: {every['buckets']} buckets in {every['seconds']:.2f} s, graph memory "
              f"{every['graph_memory_bytes'] / 2**20:.0f} MiB; largest alone {alone['graph_memory_bytes'] / 2**20:.0f} MiB "
              f"in {alone['seconds']:.2f} s; ratio {ratio:.2f}")
        first = results["capture"].get("first_in_process")
        if first is not None:
            print(f"  the process's first capture of every bucket (first-use work included): {first['seconds']:.2f} s, "
                  f"{first['graph_memory_bytes'] / 2**20:.0f} MiB")
    if results.get("compile_s"):
        print("\ncompile time (s, outside the timed steps)")
        for mode, seconds in results["compile_s"].items():
            print(f"  {mode:36s} {seconds:7.1f}")
    print_waste(results["padding_waste"])


def print_waste(wastes: dict[str, dict[str, Any]]) -> None:
    """The timed vendors' padding waste over 1..WASTE_UP_TO; batches above
    a vendor's largest graph run eagerly, and are counted as such."""
    if not wastes:
        return
    print(f"\npadding waste over batch sizes 1..{WASTE_UP_TO}: mean over n of (bucket(n) - n) / bucket(n), "
          "for the batches a graph holds (those above a vendor's largest graph run eagerly, unpadded)")
    for vendor, waste in wastes.items():
        if "failed" in waste:
            print(f"  {vendor:8s} failed: {waste['failed']}")
            continue
        line = f"  {vendor:8s} {waste['graphs']:3d} graphs: mean {waste['mean']:.1%}, worst {waste['worst']:.1%}"
        if waste["eager"]:
            graphed = waste["graphed"]
            line += (f" over 1..{graphed}; batches {graphed + 1}..{WASTE_UP_TO} ({waste['eager']}) run eagerly "
                     f"(above its largest graph, {graphed})")
        print(line)


def plot(results: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    latency = {mode: {int(b): v for b, v in values.items() if v is not None}
               for mode, values in results["latency_ms"].items()}
    figure, (axes, ratios) = plt.subplots(1, 2, figsize=(13, 5))
    for mode, values in latency.items():
        points = sorted(values.items())
        if points:
            axes.plot([b for b, _ in points], [v for _, v in points], marker="o", label=mode)
    axes.set_ylabel("median decode step (ms)")
    axes.set_title(f"{results['model']} model on {results['machine']['device']}")
    # The ratios the targets are stated in: graphmode against the hand-written
    # graph, and against (and over) torch.compile reduce-overhead.
    compared = [(mode, baseline) for mode, baseline in (
        (next((m for m in latency if m.startswith("graphmode[") and "compile" not in m), None), "hand-written graph"),
        (next((m for m in latency if m.startswith("graphmode[") and "compile" not in m), None),
         "torch.compile reduce-overhead"),
        (next((m for m in latency if m.startswith("graphmode[") and "compile" in m), None),
         "torch.compile reduce-overhead"),
    ) if mode is not None and baseline in latency]
    for mode, baseline in compared:
        points = sorted((b, v / latency[baseline][b]) for b, v in latency[mode].items() if b in latency[baseline])
        ratios.plot([b for b, _ in points], [r for _, r in points], marker="o", label=f"{mode} / {baseline}")
    ratios.axhline(1.0, color="black", linewidth=0.8)
    ratios.set_ylabel("step time ratio (below 1: faster than the baseline)")
    ratios.set_title("ratios")
    for panel in (axes, ratios):
        panel.set_xscale("log", base=2)
        panel.set_xlabel("batch size (sequences)")
        panel.grid(True, alpha=0.3)
        panel.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
