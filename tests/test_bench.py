"""``graphmode bench`` on the CPU emulator at tiny sizes: the decode
workload's default vendors, clear stops for what cannot run (a vendor, a
device), and ``--workload prefill`` and ``--workload offload`` end to end: their tables and JSON
hold a row per case (or batch) and a column per mode, the piecewise modes
ran in graphs (no eager step), and their logits equal eager's. Timing is not
checked here: the figures come from a GPU (docs/performance.md)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
from pathlib import Path

import pytest
import torch

from graphmode.bench.cases import parse_cases
from graphmode.bench.common import add_arguments
from graphmode.bench.report import print_costs
from graphmode.bench.startup import startup_modes
from graphmode.cli.main import main
from graphmode.plugins import installed_vendor_names

CASES = "1x8,4x8,mix16+4,decode4"


def run_bench(capsys, tmp_path, *arguments: str) -> tuple[str, dict]:
    path = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--steps", "2", "--warmup", "2", "--json", str(path), *arguments]) == 0
    return capsys.readouterr().out, json.loads(path.read_text())


def test_prefill_workload_runs_every_case_in_every_mode_with_eager_results(capsys, tmp_path):
    out, results = run_bench(capsys, tmp_path, "--workload", "prefill", "--cases", CASES)
    modes = ["eager", "piecewise", "full_and_piecewise"]
    names = CASES.split(",")
    assert list(results["latency_ms"]) == modes  # no compile column off CUDA
    for name in ("piecewise+compile", "full_and_piecewise+compile"):
        assert f"{name}: not timed off CUDA (compile=True is refused on the CPU emulator)" in out
    assert [case["name"] for case in results["cases"]] == names
    assert [case["tokens"] for case in results["cases"]] == [8, 32, 20, 4]
    assert results["token_buckets"] == [4, 8, 20, 32] and results["full_graph_batches"] == [4]
    for mode in modes:
        assert set(results["latency_ms"][mode]) == set(names) and not results["errors"][mode]
        assert all(ms > 0 for ms in results["latency_ms"][mode].values())
    for mode in ("piecewise", "full_and_piecewise"):
        assert results["max_abs_diff"][mode] == {name: 0.0 for name in names}, mode
        assert set(results["speedup"][mode]) == set(names)
        assert not results["stats"][mode]["eager_steps"] and results["stats"][mode]["padded_tokens"] == 0
    # Warm-up captures every graph first (one per token bucket, and full_and_piecewise
    # a full decode graph too); then piecewise replays every step (4 per case) and
    # full_and_piecewise runs the decode case in its full graph instead.
    assert set(results["warmup_s"]) == {"piecewise", "full_and_piecewise"}
    assert results["stats"]["piecewise"]["piecewise_captures"] == 4
    assert results["stats"]["piecewise"]["piecewise_replays"] == 4 * len(names)
    assert results["stats"]["full_and_piecewise"]["captures"] == 1
    assert results["stats"]["full_and_piecewise"]["replays"] == 4
    # The printed table: a header with every mode, then one row per case with its sequences and tokens.
    lines = out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("case ") and "eager" in line))
    assert lines[header].split() == ["case", "seqs", "tokens", "eager", "piecewise", "full+piecewise"]
    rows = [line.split() for line in lines[header + 1: header + 1 + len(names)]]
    assert [(row[0], row[1], row[2]) for row in rows] == [("1x8", "1", "8"), ("4x8", "4", "32"),
                                                         ("mix16+4", "5", "20"), ("decode4", "4", "4")]
    assert all(len(row) == 6 for row in rows)
    assert "speed-up over eager (eager ms / mode ms)" in out and "max |logits - eager logits|" in out


def test_offload_workload_compares_per_layer_graphs_with_eager(capsys, tmp_path):
    out, results = run_bench(capsys, tmp_path, "--workload", "offload", "--batches", "1,3")
    assert results["batches"] == [1, 3] and results["ring"] == 2
    for mode in ("eager", "piecewise"):
        assert set(results["latency_ms"][mode]) == {"1", "3"} and not results["errors"][mode]
    assert results["max_abs_diff"]["piecewise"] == {"1": 0.0, "3": 0.0}
    assert results["loads_ms"] > 0 and results["loaded_bytes_per_step"] > 0
    assert "eager steps: none" in results["stats"] and "2 captures, 6 replays" in results["stats"]
    table = out[out.index("offloaded decode, median step ms"):].splitlines()
    assert table[1].split() == ["batch", "eager", "piecewise", "speed-up", "max", "|diff|"]
    assert [row.split()[0] for row in table[2:4]] == ["1", "3"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2y8", "case '2y8' is not one of NxL"),
        ("0x8", "case '0x8': sequences and tokens must be >= 1"),
        ("mix8+0", "case 'mix8+0': sequences and tokens must be >= 1"),
        ("4x8,4x8", "repeat one"),
        (",", "no cases"),
    ],
)
def test_bad_cases_are_refused_with_the_forms(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_cases(text, decode_context=48)


def test_cases_parse_into_sequences_and_tokens():
    prompt, mix, decode = parse_cases("16x2048,mix512+64,decode64", decode_context=1024)
    assert (prompt.sequences, prompt.tokens, prompt.longest, prompt.is_decoding) == (16, 32768, 2048, False)
    assert (mix.sequences, mix.tokens, mix.context[0], mix.new[0]) == (65, 576, 512, 512)
    assert all(1 <= c < 1024 for c in mix.context[1:]) and set(mix.new[1:]) == {1}
    assert (decode.sequences, decode.tokens, decode.is_decoding) == (64, 64, True)


def test_a_case_longer_than_the_model_positions_is_refused(capsys):
    with pytest.raises(SystemExit, match="above the model's max_position_embeddings=4096"):
        main(["bench", "--device", "cpu", "--workload", "prefill", "--cases", "1x5000"])


def test_tensor_parallel_with_another_workload_is_refused():
    with pytest.raises(SystemExit, match="--tp 2 measures the decode workload only"):
        main(["bench", "--device", "cpu", "--workload", "prefill", "--tp", "2"])


def test_the_cpu_default_batches_are_those_the_help_and_the_readme_name(capsys, tmp_path):
    """Without --batches the decode workload on the CPU times the batch
    sizes ``graphmode bench --help`` and README.md name (the help once said
    1,2,4,8 while the run took 1,2,3,4,8)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (action,) = [a for a in parser._actions if a.dest == "batches"]
    helped = [int(b) for b in re.search(r"; ([\d,]+) on the CPU", action.help).group(1).split(",")]
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f"at batches {', '.join(map(str, helped[:-1]))} and {helped[-1]}" in " ".join(readme.split())
    _, results = run_bench(capsys, tmp_path, "--modes", "eager", "--steps", "1", "--warmup", "1")
    assert results["batches"] == helped


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is then cuda: the bench model, minutes")
def test_the_default_vendors_are_those_that_run_the_bench_model(capsys, tmp_path):
    """No --vendors: every installed vendor whose attention ops follow the
    model's contract is timed (the 'cuda' contract: cuda and maca); the
    others are listed with the reason, not a ConfigError traceback."""
    out, results = run_bench(capsys, tmp_path, "--batches", "1", "--steps", "1", "--warmup", "1")
    assert list(results["latency_ms"]) == ["eager", "graphmode[cuda]", "graphmode[maca]"]
    assert all(value["1"] > 0 for value in results["latency_ms"].values())
    for name in ("ascend", "camb", "ppu"):
        assert (f"not timed: {name}: its attention ops follow the {name!r} contract, the bench model's "
                "(ReferenceAttentionOps) the 'cuda' one") in out


def test_a_named_vendor_that_cannot_run_the_bench_model_is_one_clear_error():
    with pytest.raises(SystemExit, match=re.escape(
        "graphmode bench: --vendors ppu: it cannot time the bench model on cpu: its attention ops follow the 'ppu' "
        "contract, the bench model's (ReferenceAttentionOps) the 'cuda' one. Leave it out of --vendors"
    )):
        main(["bench", "--device", "cpu", "--vendors", "cuda,ppu", "--batches", "1"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is then cuda: the bench model, minutes")
def test_a_vendor_with_a_fixed_capture_list_has_its_batches_above_it_counted_as_eager(monkeypatch, capsys, tmp_path):
    """The padding-waste summary (after every timing) covers the timed
    vendors only, and a vendor whose largest graph is below 256 (here a
    FixedSizes list ending at 32) has the batches above it counted as
    eager, not refused: the run ends with its table and its JSON."""
    from test_plugins import FakeDistribution

    dists = [FakeDistribution("graphmode-fixed", {"fixed": "plugins.fixed_capture_list:plugin"})]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: dists)
    monkeypatch.delenv("GRAPHMODE_PLUGINS", raising=False)
    timing = ("--batches", "1", "--steps", "1", "--warmup", "1", "--modes", "graphmode")
    out, results = run_bench(capsys, tmp_path, *timing)
    assert list(results["latency_ms"]) == ["graphmode[cuda]", "graphmode[fixed]"]
    fixed = results["padding_waste"]["fixed"]
    assert (fixed["graphs"], fixed["graphed"], fixed["eager"]) == (6, 32, 224)
    assert results["padding_waste"]["cuda"]["eager"] == 0
    assert "fixed      6 graphs: mean " in out
    assert " over 1..32; batches 33..256 (224) run eagerly (above its largest graph, 32)" in out
    out, results = run_bench(capsys, tmp_path, *timing, "--vendors", "cuda")
    assert list(results["padding_waste"]) == ["cuda"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
@pytest.mark.parametrize("workload", [[], ["--workload", "prefill"], ["--workload", "offload"], ["--tp", "2"]],
                         ids=["decode", "prefill", "offload", "tp"])
def test_every_workload_on_a_missing_device_is_one_clear_error(workload):
    with pytest.raises(SystemExit, match=re.escape(
        "graphmode bench: --device cuda: no cuda device is available to torch here (torch "
    )) as stop:
        main(["bench", "--device", "cuda", *workload])
    assert "or pass --device cpu for the CPU graph emulator" in str(stop.value)


def test_a_device_torch_does_not_know_is_one_clear_error():
    with pytest.raises(SystemExit, match="graphmode bench: --device 'npu' is not a device torch .* knows"):
        main(["bench", "--device", "npu"])


def test_a_host_cost_that_noise_made_negative_is_printed_as_not_measurable(capsys):
    """Host cost is a runner call's median minus a graph launch's: on a
    loaded machine it can come out negative, which is no cost at all."""
    host = {1: {"runner_call_us": 100.0, "graph_launch_us": 1139.1, "host_cost_us": -1039.1, "noise_us": 812.5},
            2: {"runner_call_us": 150.0, "graph_launch_us": 100.0, "host_cost_us": 50.0, "noise_us": 3.0}}
    print_costs({"host": host, "padding_waste": {}})
    out = capsys.readouterr().out
    assert ("    1 not measurable (noise: came out -1039.1 us, timings scatter by 812.5 us) "
            "(call 100.0, launch 1139.1)") in out
    assert "    2    50.0 us (call 150.0, launch 100.0)" in out


def test_startup_prints_its_own_table_per_execute_mode_on_the_cpu(capsys, tmp_path):
    """The start-up table (graphmode.bench.startup): plan, warm-up, first
    step, wake and graph memory by family, per execute mode; on the CPU
    the graph mode by default, and its figures in the JSON."""
    out, results = run_bench(capsys, tmp_path, "--modes", "eager", "--batches", "1", "--steps", "1", "--warmup", "1")
    assert "start-up per execute mode" in out and "graph memory by family" in out
    row = results["startup"]["graph"]
    assert row["graphs"] > 0 and row["plan_s"] > 0 and row["warmup_s"] > 0 and row["wake_s"] > 0
    assert row["first_step_ms"] > 0 and set(row["families_bytes"]) == {"full"}
    assert row["graph_memory_bytes"] == row["planned_bytes"] > 0  # the emulator's record: the plan is exact
    assert re.search(r"^graph +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+  full [\d.]+", out, re.M)


@pytest.mark.parametrize(("text", "modes"), [(None, ["graph"]), ("none", []), ("piecewise,graph", ["piecewise", "graph"])])
def test_startup_modes_default_to_graph_on_the_cpu(text, modes):
    assert startup_modes(text, torch.device("cpu")) == modes
    assert startup_modes(None, torch.device("cuda")) == ["graph", "piecewise", "full_and_piecewise"]


def test_a_startup_mode_without_graphs_is_refused_naming_the_choices():
    with pytest.raises(SystemExit, match=r"--startup-modes 'eager': \['eager'\] is not an execute mode with graphs; "
                                         r"pass some of graph,piecewise,full_and_piecewise, or none"):
        startup_modes("eager", torch.device("cpu"))


def test_a_vendor_that_is_not_installed_is_one_clear_error_with_a_guess():
    """`--vendors cdua` printed "Installed vendors:." with nothing after it."""
    installed = ", ".join(installed_vendor_names())
    with pytest.raises(SystemExit, match=re.escape(
        f"graphmode bench: --vendors cdua: no vendor of that name is installed; did you mean cuda? (installed: "
        f"{installed}; `graphmode vendors` lists them)"
    )):
        main(["bench", "--device", "cpu", "--vendors", "cdua", "--batches", "1"])


@pytest.mark.parametrize("text, guess", [("gpu", "cuda"), ("gpu:1", "cuda:1"), ("cdua", "cuda"), ("ascend", "npu")])
def test_a_device_name_torch_does_not_know_gets_a_guess(text, guess):
    with pytest.raises(SystemExit, match=re.escape(
        f"graphmode bench: --device {text!r} is not a device torch {torch.__version__} knows; did you mean {guess}? "
    )):
        main(["bench", "--device", text])


def test_modes_that_cannot_run_on_the_cpu_say_so_instead_of_vanishing(capsys, tmp_path):
    """`--modes graphmode,hand` on the CPU dropped hand without a word."""
    out, results = run_bench(capsys, tmp_path, "--modes", "graphmode,hand", "--vendors", "cuda", "--batches", "1",
                             "--steps", "1", "--warmup", "1", "--startup-modes", "none")
    assert list(results["latency_ms"]) == ["graphmode[cuda]"]
    assert "not timed: hand: CUDA only, not on cpu (hand: a hand-written CUDA graph); pass --device cuda on a GPU" in out


def test_the_native_step_is_built_before_anything_is_timed(monkeypatch, capsys, tmp_path):
    """Its build (half a minute, once per torch build) was timed as the first
    replay step of whichever mode came first: "batch 1: 11003.191 ms"."""
    import graphmode.bench.cli as bench

    events: list[str] = []
    real_native, real_turns = bench.native_module, bench.taking_turns
    monkeypatch.setattr(bench, "native_module", lambda: events.append("native") or real_native())
    monkeypatch.setattr(bench, "measure_startup", lambda *args: events.append("timed") or {})
    monkeypatch.setattr(bench, "taking_turns", lambda *args: events.append("timed") or real_turns(*args))
    out, _ = run_bench(capsys, tmp_path, "--modes", "graphmode", "--vendors", "cuda", "--batches", "1",
                       "--steps", "1", "--warmup", "1")
    assert events[0] == "native" and "timed" in events
    assert re.search(r"^native step: (loaded in [\d.]+ s, before any timing|off \()", out, re.M), out
