"""The GPU check script's CPU-safe parts: every code path on a tiny model, and the shell wrapper.

The GPU numbers themselves need a GPU; here the script runs with ``--device cpu --tiny`` (the
memory check reports that it needs CUDA) and the wrapper is checked for its refusal without a
GPU and for forwarding its arguments.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import attention_gpu, cost_probe, gpu_check

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _run_wrapper(
    *args: str, path: str | None = None, python: str = sys.executable
) -> subprocess.CompletedProcess[str]:
    """``bash gpu_check.sh ARGS`` with ``python`` as $PYTHON (and ``path`` as PATH)."""
    env = {**os.environ, "PYTHON": python}
    if path is not None:
        env["PATH"] = path
    bash = shutil.which("bash")
    assert bash is not None
    return subprocess.run(
        [bash, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_tiny_cpu_run_reports_every_check(tmp_path: Path, capsys) -> None:
    out = tmp_path / "gpu_check.json"
    status = gpu_check.main(["--device", "cpu", "--tiny", "--steps", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert report["passed"] is True
    # flash-attn needs CUDA: the comparison is skipped (None), never reported as passed.
    assert report["backends"]["flash_vs_sdpa_ok"] is None
    # The Skrull loss equals the plain HF loss (float32 on CPU, relative tolerance 1e-5).
    backends = report["backends"]
    assert backends["sdpa_loss_ok"] is True
    assert backends["sdpa_loss"] == pytest.approx(backends["reference_loss"], rel=1e-5)
    for name, cell in report["throughput"]["datasets"].items():
        for policy in ("skrull", "static"):
            assert cell[policy]["steps"] == 1, (name, policy)
            assert cell[policy]["median_tokens_per_s"] > 0
        assert cell["skrull_speedup"] > 0
    # the measured steps of both policies (1 per policy and set) fit the cost model's constants
    fit = report["throughput"]["cost_model_fit"]
    assert fit["steps"] == 4 and len(fit["relative_errors"]) == 4
    assert fit["achieved_flops"] > 0 and fit["micro_batch_overhead_s"] >= 0
    assert "cost model fit (4 steps)" in printed
    assert "CUDA" in report["memory"]["skipped"]
    assert "===== lightning-skrull GPU check =====" in printed
    assert "passed: True" in printed
    assert "partial" not in report  # the final report, not one written after a check
    _assert_new_sections(report, printed)
    _assert_fused_kernels(report, printed)
    _assert_host_overhead(report, printed)


def _assert_new_sections(report: dict, printed: str) -> None:
    """The chunked-loss, bf16-at-CP and FSDP sections of a tiny CPU run are complete."""
    import torch.distributed as dist

    # 4. chunked loss: both lines, the analytical estimate beside each, memory n/a on CPU
    c = report["chunked_loss"]
    assert c["loss_kernel"] == "chunked"  # "auto" on CPU is the pure-PyTorch path
    assert set(c["lines"]) == {"dense", "chunked"}
    for line in c["lines"].values():
        assert "skipped" not in line and line["probe_peak_bytes"].startswith("n/a")
        assert line["estimate_bytes_per_token"] == pytest.approx(
            line["estimate_layers_bytes_per_token"] + line["estimate_head_bytes_per_token"]
        )
    # the dense head keeps [tokens, vocab] logits, the chunked one does not
    assert (c["lines"]["dense"]["estimate_head_bytes_per_token"]
            > c["lines"]["chunked"]["estimate_head_bytes_per_token"])  # fmt: skip
    assert "chunked loss (chunked kernel) vs dense" in printed
    # 5. bf16 at emulated CP: both runs timed on the same micro-batches, a distributed path
    # exercised, the outputs compared (the same kernel on CPU: equal)
    cp = report["cp_bf16"]
    assert cp["cp_size"] == 2 and cp["compute_dtype"] == "torch.bfloat16"
    assert cp["auto_backend"] == "sdpa" and cp["distributed_sequences"] >= 1
    assert cp["outputs_agree"] is True
    runs = list(cp["runs"].values())
    assert len(runs) == 2
    for run in runs:
        assert run["micro_batches_timed"] == cp["micro_batches"] >= 1
        assert run["tokens_per_s_per_gpu"] > 0 and run["tokens_per_s_cp_group"] > 0
    assert cp["speedup"] > 0
    assert "emulated CP=2" in printed
    # 6. FSDP2 through a Trainer on one CPU process: mesh (1, 1), every step ran, finite losses,
    # the parameter count of the estimate equals the model's, and the process group Lightning
    # made for the run is gone afterwards
    f = report["fsdp"]
    assert f["ok"] is True and f["steps"] == 3 and f["mesh"] == [1, 1]
    assert len(f["losses"]) == 3 and all(math.isfinite(x) for x in f["losses"])
    assert f["parameter_count_matches"] is True
    assert f["peak_bytes"].startswith("n/a")
    assert 0 < f["estimate_model_state_bytes_tied"] < f["estimate_model_state_bytes"]
    assert f["estimate_peak_bytes"] > f["estimate_model_state_bytes_tied"]
    assert not dist.is_initialized()
    assert "FSDP2 on one device, mesh (1, 1), bf16-mixed" in printed


def _assert_fused_kernels(report: dict, printed: str) -> None:
    """The fused-kernels section of a tiny CPU run: what is installed, what "auto" picks (the
    chunked path off CUDA), every fused kernel reported as needing CUDA, the chunked path
    against the float64 reference, and the dense and chunked paths timed."""
    from lightning_skrull.models.loss_kernels import installed_fused_kernels

    f = report["fused_kernels"]
    assert f["ok"] is True
    assert f["installed"] == list(installed_fused_kernels())
    assert f["auto_kernel"] == "chunked" and f["compute_dtype"] == "torch.bfloat16"
    assert set(f["kernels"]) == {"liger", "cce"}
    for name, cell in f["kernels"].items():
        assert cell == {"installed": name in f["installed"], "skipped": "needs CUDA"}, name
    # 256 tokens: the first 32 (a prompt) and every fifth after them are -100
    assert f["tokens"] == 256 and f["ignored_tokens"] == 32 + len(range(35, 256, 5))
    # the chunked path in bf16 against float64: measured 3.1e-5 absolute on a loss of 5.66 and
    # 2.6e-3 norm-relative on both gradients (about one bf16 unit roundoff, 2^-9); the bounds
    # are one bf16 rounding of the loss (2^-8 relative) and 2^-6 on the gradients
    c = f["chunked"]
    assert c["ok"] is True
    assert c["loss_abs_err"] <= 2**-8 * f["reference_loss"]
    assert 0 < c["grad_hidden_rel_err"] <= 2**-6 and 0 < c["grad_weight_rel_err"] <= 2**-6
    assert list(f["timing"]) == ["dense", "chunked"]  # no fused kernel runs on CPU
    for cell in f["timing"].values():
        assert math.isfinite(cell["ms"]) and cell["ms"] > 0
        assert cell["peak_bytes"].startswith("n/a")
    dense = f["timing"]["dense"]
    assert dense["time_over_chunked"] == pytest.approx(dense["ms"] / f["timing"]["chunked"]["ms"])
    assert "fused loss kernels: installed " in printed
    assert "  liger: needs CUDA" in printed and "  cce: needs CUDA" in printed
    assert "| dense | " in printed and "| chunked | " in printed


def _assert_host_overhead(report: dict, printed: str) -> None:
    """The host-overhead section of a tiny CPU run: every micro-batch timed through both paths
    with positive, finite times, both paths computing the same loss, and the compiled-layers run
    (dynamo's eager backend on CPU) complete, with the registered attention restored after it."""
    from transformers import AttentionInterface

    from lightning_skrull.attention.dispatch import skrull_attention_forward

    h = report["host_overhead"]
    assert h["ok"] is True
    assert h["runs"] == ["plain HF", "Skrull sdpa"]  # flash needs CUDA
    assert h["goal_ms"] is None  # the 10 ms goal is for Qwen2.5-0.5B's shape, not the tiny model
    assert list(h["micro_batches"]) == ["1 x 128", "4 x 32", "16 x 16", "64 x 4"]
    for key, cell in h["micro_batches"].items():
        sequences, length = map(int, key.split(" x "))
        assert cell["tokens"] == sequences * length
        plain, skrull = cell["plain HF"], cell["Skrull sdpa"]
        for name, c in cell.items():
            if name == "tokens":
                continue
            for k in ("host_ms", "thread_cpu_ms", "process_cpu_ms", "wall_ms"):
                assert math.isfinite(c[k]) and c[k] > 0, (key, name, k)
            assert c["wall_ms"] >= c["host_ms"]  # the same start; the sync comes after
            assert c["kernel_ms"] is None, (key, name)  # profiled on CUDA only
        # The same computation: float32, both paths sum the same per-token losses in another
        # order (attention per sequence against a block-diagonal mask, the chunked loss against
        # the dense one); measured up to 2.6e-7 relative, tolerance FP32_LOSS_RTOL = 1e-5.
        assert skrull["loss"] == pytest.approx(plain["loss"], rel=gpu_check.FP32_LOSS_RTOL), key
        assert skrull["loss_rel_diff"] <= gpu_check.FP32_LOSS_RTOL
        assert skrull["own_host_ms"] == pytest.approx(skrull["host_ms"] - plain["host_ms"])
        assert skrull["goal_met"] is None
    c = h["compiled"]
    assert c["compiler"] == "eager" and c["layers"] == 2 and c["attention_backend"] == "sdpa"
    assert c["first_call_s"] > 0
    assert c["graphs"] >= c["graphs_after_first_call"] >= 1
    assert c["recompiles"] == c["graphs"] - c["graphs_after_first_call"]
    assert c["graph_breaks"] >= 1  # at the excluded attention
    assert list(c["micro_batches"]) == list(h["micro_batches"])
    for key, m in c["micro_batches"].items():
        assert math.isfinite(m["host_ms"]) and m["host_ms"] > 0 and m["kernel_ms"] is None
        # the compiled layers run the same operations (dynamo's eager backend): the same loss
        eager = h["micro_batches"][key]["Skrull sdpa"]["loss"]
        assert m["loss"] == pytest.approx(eager, rel=gpu_check.FP32_LOSS_RTOL), key
    assert AttentionInterface._global_mapping["skrull"] is skrull_attention_forward
    assert "host overhead per micro-batch at CP=1" in printed
    assert "| 64 x 4 | sdpa | " in printed
    assert "compiled decoder layers (eager, 2 layers, sdpa attention outside)" in printed


def test_kernel_ms_sums_the_device_activities_only() -> None:
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(device: DeviceType, us: float, annotation: bool = False) -> SimpleNamespace:
        return SimpleNamespace(
            device_type=device, self_device_time_total=us, is_user_annotation=annotation
        )

    events = [
        event(DeviceType.CUDA, 1500.0),
        event(DeviceType.CUDA, 250.0),
        event(DeviceType.CPU, 9000.0),  # a CPU op's time is host time, not a kernel's
        event(DeviceType.CUDA, 4000.0, annotation=True),  # a range around kernels, not one
    ]
    assert gpu_check.kernel_ms(events) == pytest.approx(1.75)
    assert gpu_check.kernel_ms(events[2:]) is None  # no kernel recorded: n/a, not 0 ms


def test_host_overhead_summary_reports_the_goal() -> None:
    def times(host: float, kernels: float, **extra: object) -> dict:
        return {"host_ms": host, "kernel_ms": kernels, "wall_ms": host + 1.0, **extra}

    cell = {
        "tokens": 128,
        "plain HF": times(8.0, 3.0),
        "Skrull sdpa": times(12.5, 3.1, own_host_ms=4.5, goal_met=False),
        "Skrull flash": times(9.5, 2.9, own_host_ms=1.5, goal_met=True),
    }
    h = {
        "warmup": 2,
        "reps": 5,
        "runs": ["plain HF", "Skrull sdpa", "Skrull flash"],
        "loss_kernel": "chunked",
        "goal_ms": 10.0,
        "micro_batches": {"1 x 128": cell, "64 x 4": {"skipped": "deadline"}},
        "compiled": {
            "compiler": "inductor", "attention_backend": "flash", "layers": 24,
            "first_call_s": 41.0, "graphs": 5, "recompiles": 1, "graph_breaks": 5,
            "micro_batches": {"1 x 128": times(6.0, 2.0)},
        },
        "ok": True,
    }  # fmt: skip
    text = "\n".join(gpu_check._summary_host_overhead(h))
    assert "goal 10 ms" in text
    assert "| 1 x 128 | sdpa | 8.00 | 12.50 | +4.50 | 3.00 / 3.10 | 9.00 / 13.50 | missed |" in text
    assert "| 1 x 128 | flash | 8.00 | 9.50 | +1.50 | 3.00 / 2.90 | 9.00 / 10.50 | met |" in text
    assert "| 64 x 4 | skipped (deadline) |" in text
    assert "first call 41.0 s, 5 graphs, 1 after the first call" in text
    assert "| 1 x 128 | 6.00 / 9.50 | 2.00 / 2.90 | 7.00 / 10.50 |" in text  # against eager flash
    h["compiled"] = {"skipped": "deadline: 20 s of --budget-s left, a first compile needs about 60"}
    text = "\n".join(gpu_check._summary_host_overhead(h))
    assert "compiled decoder layers: skipped (deadline: 20 s" in text


def _fused_report() -> dict:
    """A fused-kernels section as a GPU with Liger Kernel installed would report it."""
    mib = 2**20
    return {
        "installed": ["liger"], "compute_dtype": "torch.bfloat16", "auto_kernel": "liger",
        "tokens": 4096, "vocab": 151_936, "hidden": 896, "ignored_tokens": 1229, "reps": 5,
        "reference_loss": 12.5,
        "chunked": {"loss": 12.5001, "loss_abs_err": 1e-4, "grad_hidden_rel_err": 2e-3,
                    "grad_weight_rel_err": 2.5e-3, "ok": True},
        "kernels": {
            "liger": {"installed": True, "loss": 12.5002, "loss_abs_err": 2e-4,
                      "grad_hidden_rel_err": 3e-3, "grad_weight_rel_err": 9e-3},
            "cce": {"installed": False, "skipped": "not installed (no module 'cut_cross_entropy')"},
        },
        "timing": {
            "dense": {"ms": 20.0, "peak_bytes": 8000 * mib, "time_over_chunked": 0.8,
                      "peak_over_chunked": 10.0},
            "chunked": {"ms": 25.0, "peak_bytes": 800 * mib},
            "liger": {"skipped": "deadline"},
        },
        "ok": False,
    }  # fmt: skip


def test_fused_kernels_summary_reports_each_kernel() -> None:
    f = _fused_report()
    # the head's gradient past its tolerance (2 x 2.5e-3 + 2^-8 = 8.9e-3) fails the kernel; the
    # loss and the hidden states' gradient are within theirs (2 x 1e-4 + 2^-8 x 12.5, and
    # 2 x 2e-3 + 2^-8)
    liger = f["kernels"]["liger"]
    verdict = gpu_check.judge_fused_kernel(liger, f["chunked"], f["reference_loss"])
    assert verdict["loss_tolerance"] == pytest.approx(2e-4 + 12.5 / 256)
    assert verdict["grad_hidden_tolerance"] == pytest.approx(4e-3 + 1 / 256)
    assert verdict["grad_weight_tolerance"] == pytest.approx(5e-3 + 1 / 256)
    assert verdict["ok"] is False
    liger.update(verdict)
    assert gpu_check.judge_fused_kernel(
        liger | {"grad_weight_rel_err": 8.8e-3}, f["chunked"], f["reference_loss"]
    )["ok"]
    text = "\n".join(gpu_check._summary_fused_kernels(f))
    assert 'installed liger; "auto" in bf16 here: liger; 4096 tokens (1229 labels -100)' in text
    assert "vocab 151,936 x hidden 896" in text
    assert "  chunked: loss 1.00e-04, grad hidden 2.00e-03, grad weight 2.50e-03" in text
    assert ("  liger: loss 2.00e-04 (tolerance 4.90e-02), grad hidden 3.00e-03 (7.91e-03), "
            "grad weight 9.00e-03 (8.91e-03): MISMATCH") in text  # fmt: skip
    assert "  cce: not installed (no module 'cut_cross_entropy')" in text
    assert "median of 5 after 1" in text
    assert "  | dense | 20.00 | 8000.000 MiB | 0.80x | 10.00x |" in text
    assert "  | chunked | 25.00 | 800.000 MiB | 1 | 1 |" in text
    assert "  | liger | skipped (deadline) |" in text
    # a failed comparison fails the run; a kernel that is not installed does not
    report = {name: {} for name in gpu_check.SECTIONS} | {
        "backends": {"flash_vs_sdpa_ok": None, "sdpa_loss_ok": True},
        "fused_kernels": f,
    }
    assert gpu_check.passed(report) is False
    f["kernels"]["liger"] = {"installed": False, "skipped": "not installed (no module 'x')"}
    f["timing"].pop("liger")
    f["ok"] = True
    assert gpu_check.passed(report) is True
    assert "  liger: not installed" in "\n".join(gpu_check._summary_fused_kernels(f))


def test_summary_flags_a_mismatch() -> None:
    report: dict = {
        "device_name": "test",
        "backends": {
            "flash_vs_sdpa_ok": False,
            "flash_vs_sdpa_max_abs_diff": 0.5,
            "flash_vs_sdpa_max_rel_grad_diff": 0.1,
            "sdpa_loss": 2.0,
            "sdpa_loss_ok": False,
            "reference_loss": 1.0,
        },
        "throughput": {"bucket_size": 8, "attention_backend": "flash", "datasets": {}},
        "memory": {"skipped": "no"},
        "chunked_loss": {"error": "RuntimeError: out of memory"},
        "cp_bf16": {"skipped": "deadline: 3 s of --budget-s left, 15 needed"},
        "fsdp": {"error": "ValueError: x"},
        "fused_kernels": {"skipped": "deadline: 9 s of --budget-s left, 15 needed"},
        "host_overhead": {"skipped": "deadline: 5 s of --budget-s left, 20 needed"},
        "passed": False,
        "wall_s": 1.0,
    }
    text = gpu_check.summary(report)
    assert "vs sdpa: MISMATCH" in text
    assert "skrull loss (sdpa) vs plain HF: MISMATCH" in text
    assert "chunked_loss: ERROR (RuntimeError: out of memory)" in text
    assert "cp_bf16: skipped (deadline" in text
    assert "fused_kernels: skipped (deadline" in text
    assert "host_overhead: skipped (deadline" in text
    assert "passed: False" in text
    # a check that failed with an error fails the run; one skipped at the deadline does not
    report["backends"] = {"flash_vs_sdpa_ok": None, "sdpa_loss_ok": True}
    assert gpu_check.passed(report) is False
    report["chunked_loss"] = report["fsdp"] = {"skipped": "deadline"}
    assert gpu_check.passed(report) is True
    # the host-overhead goal is reported, not enforced; a non-finite number fails the run
    report["host_overhead"] = {"ok": False}
    assert gpu_check.passed(report) is False


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_wrapper_refuses_without_cuda() -> None:
    proc = _run_wrapper()
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr


def test_wrapper_runs_the_interpreter_it_is_given(tmp_path: Path, capsys) -> None:
    # A PATH with the tools the script needs but no python at all (an environment that is not
    # activated): it must run $PYTHON, not whatever python PATH would find. $PYTHON is a
    # stand-in that records each call and what it reads, so the wrapper's own behaviour is what
    # is checked, without two interpreters importing torch and Lightning (18 s on two cores).
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("dirname", "timeout", "cat"):
        found = shutil.which(tool)
        assert found is not None, tool
        (tools / tool).symlink_to(found)
    assert shutil.which("python", path=str(tools)) is None
    assert shutil.which("python3", path=str(tools)) is None
    log = tmp_path / "calls.log"
    stand_in = tmp_path / "python"
    stand_in.write_text(
        f'#!/bin/sh\nprintf "call: %s\\n" "$*" >> {log}\nif [ "$1" = - ]; then cat >> {log}; fi\n'
    )
    stand_in.chmod(0o755)
    proc = _run_wrapper("--device", "cpu", "--help", path=str(tools), python=str(stand_in))
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text()
    # the version line's script on stdin, then gpu_check with the arguments as given
    assert calls.startswith("call: -\n"), calls
    assert calls.rstrip().endswith("call: -m benchmarks.gpu_check --device cpu --help"), calls
    # The version line's script itself, run here (its imports are this process's already)
    script = calls.split("call: -\n", 1)[1].rsplit("call: -m", 1)[0]
    exec(compile(script, "gpu_check.sh version line", "exec"), {})
    printed = capsys.readouterr().out
    assert "| lightning-skrull " in printed and "| flash kernel:" in printed, printed


def test_attention_benchmark_runs_every_row_on_cpu(tmp_path: Path, capsys) -> None:
    # benchmarks/attention_gpu.py's code paths with short sequences on CPU: every row reports a
    # time or the reason its SDPA kernel refused ("n/a"), and the table has a line per row.
    out = tmp_path / "attention_gpu.json"
    argv = ["--device", "cpu", "--tiny", "--reps", "1", "--json", str(out)]
    assert attention_gpu.main(argv) == 0
    report = json.loads(out.read_text())
    rows = report["ms_per_layer"]
    assert {"sdpa", "sdpa, PyTorch's choice", "sdpa, K/V repeated"} <= set(rows)
    for label, cells in rows.items():
        assert len(cells) == 4, label  # two batches, local and distributed
        for cell in cells.values():
            assert (isinstance(cell, float) and cell > 0) or cell.startswith("n/a"), (label, cell)
    assert all(isinstance(c, float) for c in rows["sdpa"].values())
    assert "| sdpa | " in capsys.readouterr().out


def test_attention_benchmark_runs_only_the_rows_asked_for(tmp_path: Path) -> None:
    out = tmp_path / "attention_gpu.json"
    argv = ["--device", "cpu", "--tiny", "--reps", "1", "--rows", "sdpa,flash", "--json", str(out)]
    assert attention_gpu.main(argv) == 0
    # "sdpa" names that row only, not "sdpa, PyTorch's choice"; no flash kernel on CPU
    assert list(json.loads(out.read_text())["ms_per_layer"]) == ["sdpa"]


def test_cost_probe_tiny_cpu_run_fits_every_model(tmp_path: Path, capsys) -> None:
    # benchmarks/cost_probe.py on a tiny model: every micro-batch timed through the package's
    # path and the plain model, the constants fitted at two depths and extrapolated.
    out = tmp_path / "cost_probe.json"
    assert cost_probe.main(["--device", "cpu", "--tiny", "--reps", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["models"]) == {"Qwen2.5-0.5B", "Qwen2.5-7B"}
    for m in report["models"].values():
        assert [f["layers"] for f in m["fits"]] == [1, 2]
        for fit in m["fits"]:
            assert fit["achieved_flops"] > 0 and fit["micro_batch_overhead_s"] >= 0
            assert fit["plain_hf_smallest_seconds"] > 0
            assert len(fit["micro_batches"]) == 10
            for row in fit["micro_batches"]:
                # a fitted error per micro-batch exists; how small it is depends on the machine's
                # load during one timing each (--reps 1), which is the benchmark's to report,
                # not a test's to assert (it ranged over 0.1-85x on this shared 2-core machine)
                assert row["seconds"] > 0 and math.isfinite(row["fit_error"])
        assert m["full_model"]["layers"] == 4
    assert "fixed ms per micro-batch" in capsys.readouterr().out


def test_cost_probe_extrapolates_the_fixed_cost_linearly_in_depth() -> None:
    fits = [
        {"layers": 4, "achieved_flops": 5e14, "micro_batch_overhead_s": 0.009},
        {"layers": 2, "achieved_flops": 4e14, "micro_batch_overhead_s": 0.005},
    ]
    full = cost_probe.extrapolate("m", 28, fits)
    assert full["overhead_per_layer_s"] == pytest.approx(0.002)
    assert full["micro_batch_overhead_s"] == pytest.approx(0.009 + 24 * 0.002)
    assert full["achieved_flops"] == 5e14  # from the deeper cut
    whole = cost_probe.extrapolate("m", 24, [{"layers": 24, "achieved_flops": 3e14,
                                         "micro_batch_overhead_s": 0.05}])  # fmt: skip
    assert whole["micro_batch_overhead_s"] == 0.05 and whole["overhead_per_layer_s"] is None
