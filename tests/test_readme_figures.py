"""The README's H200 and H100 figures are the committed raw runs' medians (min-max): every row cited below is
recomputed from its results file in docs/runs/25-peers/ (one JSON object a run, or the RESULT lines a call
printed) and must appear in the README as written there, so a figure copied wrong, or a raw file edited after
the fact, fails here rather than in a reader's rerun."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "runs" / "25-peers"
M21 = "megatrain arrival-resident:resident_layers=21;compile_layers=true"
M24 = "megatrain arrival-resident:resident_layers=24;compile_layers=true"
M4 = "megatrain arrival-resident:resident_layers=4;compile_layers=true"

# (results file, config as the file names it) for each README row that shows a median (min-max) of 3 or 2 runs
CITED = [
    ("bench3b-8x2048-b.jsonl", M21), ("bench3b-8x2048-b.jsonl", "megatrain auto"),
    ("bench3b-8x2048-b.jsonl", "all-on-gpu"), ("bench3b-8x2048-b.jsonl", "zero3-offload"),
    ("bench3b-8x2048-b.jsonl", "superoffload-adam50"),
    ("bench3b-8x2048-a.jsonl", "superoffload"), ("bench3b-8x2048-a.jsonl", "superoffload:clip=0"),
    ("bench3b-8x2048-a.jsonl", "megatrain auto:clip=0"), ("bench3b-8x2048-a.jsonl", "all-on-gpu:clip=0"),
    ("bench3b-8x2048-d.jsonl", M21), ("bench3b-8x2048-d.jsonl", "all-on-gpu"),
    ("bench3b-8x2048-d.jsonl", "twinflow"), ("bench3b-8x2048-d.jsonl", "twinflow:clip=0"),
    ("bench3b-8x2048-d.jsonl", "zero3-offload:clip=0"), ("bench3b-8x2048-d.jsonl", "fsdp2-cpuoffload"),
    ("bench3b-8x2048-d.jsonl", "fsdp2-cpuoffload:clip=0"),
    ("bench3b-16x2048-a.jsonl", M21), ("bench3b-16x2048-a.jsonl", M21 + ";clip=0"),
    ("bench3b-16x2048-a.jsonl", "all-on-gpu"), ("bench3b-16x2048-a.jsonl", "superoffload"),
    ("bench3b-16x2048-a2.jsonl", "superoffload:clip=0"),
    ("bench3b-16x2048-e.jsonl", M21), ("bench3b-16x2048-e.jsonl", "all-on-gpu"),
    ("bench3b-16x2048-e.jsonl", "twinflow"), ("bench3b-16x2048-e.jsonl", "twinflow:clip=0"),
    ("bench3b-16x2048-e.jsonl", "zero3-offload"), ("bench3b-16x2048-e.jsonl", "zero3-offload:clip=0"),
    ("bench3b-16x2048-e.jsonl", "fsdp2-cpuoffload"), ("bench3b-16x2048-e.jsonl", "fsdp2-cpuoffload:clip=0"),
    ("bench3b-8x2048-f.jsonl", "authors-fixed"), ("bench3b-8x2048-f.jsonl", "authors"),
    ("bench3b-8x2048-f.jsonl", "all-on-gpu"),
    ("bench3b-16x2048-f.jsonl", "authors-fixed"), ("bench3b-16x2048-f.jsonl", "all-on-gpu"),
    ("llama8b-16x2048.jsonl", M24),
    ("llama8b-16x2048.jsonl", M24 + ";clip=0"),
    ("llama8b-16x2048-b.jsonl", M4), ("llama8b-16x2048-c.jsonl", M4),
    ("zenflow-1b-8x2048.jsonl", "all-on-gpu"),
    ("zenflow-1b-8x2048.jsonl", "megatrain arrival-resident:resident_layers=12;compile_layers=true"),
    ("h100b-bench3b-8x2048.jsonl", M24 + ";keep_activations=12"), ("h100b-bench3b-8x2048.jsonl", M24),
    ("h100b-bench3b-8x2048.jsonl", "all-on-gpu"), ("h100b-peers-8x2048.jsonl", "zero3-offload"),
    ("h100b-peers-8x2048.jsonl", "superoffload-adam50"),
    ("h100b-bench3b-16x2048.jsonl", "megatrain arrival-resident:resident_layers=20;compile_layers=true"),
    ("h100b-bench3b-16x2048.jsonl", "all-on-gpu"),
]


def _runs(name: str, config: str) -> list[float]:
    rows = [json.loads(line) for line in (RUNS / name).read_text().splitlines() if line.strip()]
    return [r["tokens_per_s"] for r in rows if r["config"] == config and r.get("tokens_per_s")]


def _figure(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


@pytest.mark.parametrize("name,config", CITED, ids=[f"{n}:{c}" for n, c in CITED])
def test_a_readme_figure_is_its_raw_runs_median(name, config):
    values = _runs(name, config)
    assert len(values) >= 2, f"{name} has {len(values)} finished runs of {config}"
    readme = (ROOT / "README.md").read_text().replace("**", "")
    assert _figure(values) in readme, f"{name} {config}: the raw runs give {_figure(values)}"


def test_zenflows_rows_are_its_result_lines():
    """ZenFlow's rows ran through run_peer directly (8 warm-up steps): the RESULT lines of that call."""
    rows = [json.loads(line[len("RESULT "):]) for line in
            (RUNS / "h200-zenflow3" / "zenflow-w8.txt").read_text().splitlines() if line.startswith("RESULT ")]
    readme = (ROOT / "README.md").read_text()
    for clip in (1.0, 0.0):
        runs = [r for r in rows if r["clip"] == clip]
        assert len(runs) == 3 and all("--warmup 8 --steps 8" in r["command"] for r in runs)
        assert _figure([r["tokens_per_s"] for r in runs]) in readme


def test_zenflows_repaired_and_shipped_rows_are_start_11s_interleaved_result_lines():
    """Start 11 ran ZenFlow with `--zenflow-layout-fix` and as shipped, alternately, 3 runs each: the README's two
    figures are those RESULT lines' medians, and the repaired runs are the ones whose note names the repair."""
    text = "".join((RUNS / "h200-table17" / name).read_text() for name in ("zenflow-fix-w8.txt", "zenflow-fix-w8b.txt"))
    rows = [json.loads(line[len("RESULT "):]) for line in text.splitlines() if line.startswith("RESULT ")]
    repaired = [r for r in rows if "--zenflow-layout-fix" in r["command"]]
    shipped = [r for r in rows if "--zenflow-layout-fix" not in r["command"]]
    assert len(repaired) == len(shipped) == 3
    assert all("ZenFlow layout fix" in r["note"] for r in repaired)
    assert not any("layout fix" in r["note"] for r in shipped)
    readme = (ROOT / "README.md").read_text()
    for runs in (repaired, shipped):
        assert all(r["clip"] == 1.0 and "--warmup 8 --steps 8" in r["command"] for r in runs)
        assert _figure([r["tokens_per_s"] for r in runs]) in readme


def test_zenflows_repaired_curve_starts_where_the_exact_runs_do():
    """The README says the repaired ZenFlow's step 1 is ZeRO-2 offload's bit for bit (same weights, same batch) and
    that as shipped it is not; and gives the repaired curve's mean of steps 151-200."""
    curves = ROOT / "docs" / "runs" / "25-zenflow-curve"
    repaired, exact, shipped = (json.loads((curves / name).read_text())
                                for name in ("zenflow-fixed.json", "zero2-offload.json", "zenflow.json"))
    assert repaired[0]["batch_sha1"] == exact[0]["batch_sha1"] == shipped[0]["batch_sha1"]
    assert repaired[0]["loss"] == exact[0]["loss"]
    assert abs(shipped[0]["loss"] - exact[0]["loss"]) > 0.1
    tail = [r["loss"] for r in repaired if 151 <= r["step"] <= 200]
    assert len(tail) == 50
    assert f"{statistics.mean(tail):.3f} (+296%)" in (ROOT / "README.md").read_text()


def test_the_authors_rows_diverge_as_shipped_and_train_with_the_fix():
    """The README says the authors' trainer as shipped has a non-finite `final_norm` gradient in its first step in
    every run of start 10, and none with the head-gradient fix: the RESULT lines' own record of it."""
    rows = [json.loads(line) for line in (RUNS / "bench3b-8x2048-f.jsonl").read_text().splitlines() if line.strip()]
    shipped = [r for r in rows if r["config"] == "authors"]
    fixed = [r for r in rows if r["config"] == "authors-fixed"]
    assert len(shipped) == len(fixed) == 3
    assert all(r["nonfinite_grads_warmup"] == {"1": ["final_norm"]} for r in shipped)
    assert all(r["nonfinite_grads_warmup"] == {} for r in fixed)


def test_twinflow_at_llama3_8b_failed_every_run_out_of_gpu_memory():
    """The README's 'cannot hold it' rows for Twin-Flow at llama3-8b 16 x 2048 (starts 12-13): every run of the three
    configs is in the results files, none finished, and each failed with CUDA's out-of-memory error."""
    readme = (ROOT / "README.md").read_text()
    for name, config, n in (("llama8b-16x2048-b.jsonl", "twinflow", 3),
                            ("llama8b-16x2048-b.jsonl", "twinflow:clip=0", 3),
                            ("llama8b-16x2048-c.jsonl", "twinflow-expandable", 2)):
        rows = [json.loads(line) for line in (RUNS / name).read_text().splitlines() if line.strip()]
        runs = [r for r in rows if r["config"] == config]
        assert len(runs) == n and all("torch.OutOfMemoryError: CUDA out of memory" in r["error"] for r in runs)
        assert not any(r.get("tokens_per_s") for r in runs)
    assert "6 of 6 runs" in readme and "2 of 2 runs" in readme


def test_zenflow_with_and_without_its_overlap_are_start_14s_interleaved_result_lines():
    """Start 14 alternated zenflow-sync and zenflow, both repaired: the README's two figures are those RESULT lines'
    medians (3 and 2 runs), and the synchronous one is the faster."""
    text = (RUNS / "h200-table18" / "zenflow-sync-speed.txt").read_text()
    rows = [json.loads(line[len("RESULT "):]) for line in text.splitlines() if line.startswith("RESULT ")]
    sync = [r["tokens_per_s"] for r in rows if r["mode"] == "zenflow-sync"]
    overlapped = [r["tokens_per_s"] for r in rows if r["mode"] == "zenflow"]
    assert len(sync) == 3 and len(overlapped) == 2
    assert all("--zenflow-layout-fix" in r["command"] and "--warmup 8 --steps 8" in r["command"] for r in rows)
    assert all(r["step_s_used"] == "mean over whole update intervals" for r in rows)
    readme = (ROOT / "README.md").read_text().replace("**", "")
    assert _figure(sync) in readme and _figure(overlapped) in readme
    assert min(sync) > max(overlapped)


def test_the_zenflow_control_curves_means_are_the_readmes():
    """The two control curves (start 12): the README's means of steps 151-200, recomputed from the raw losses, and
    the same batches as the exact reference step by step."""
    curves = ROOT / "docs" / "runs" / "25-zenflow-curve"
    ref = json.loads((curves / "zero2-offload.json").read_text())
    readme = (ROOT / "README.md").read_text()
    for name, figure in (("zenflow-sync.json", "2.495 (+205%)"), ("zero2-offload-every4.json", "2.584 (+216%)")):
        rows = json.loads((curves / name).read_text())
        assert [r["batch_sha1"] for r in rows] == [r["batch_sha1"] for r in ref]
        tail = [r["loss"] for r in rows if 151 <= r["step"] <= 200]
        assert len(tail) == 50 and f"{statistics.mean(tail):.3f}" == figure.split()[0] and figure in readme
