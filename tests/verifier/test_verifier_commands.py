"""`specfleet verifier`: bad arguments exit with status 2 and a one-line reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from specfleet.cli import main


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        (["--id", "no/slashes"], "invalid device id"),
        (["--broker-url", "http://example"], "scheme must be mqtt"),
        (["--heartbeat-s", "0"], "--heartbeat-s must be > 0"),
        (["--models-dir", "/nonexistent/specfleet-models"], "does not exist"),
        (["--target", "never-built"], "no target 'never-built'"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(
    arguments: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verifier", *arguments]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specfleet verifier: ") and reason in err
    assert "\n" not in err


@pytest.mark.parametrize(
    "flag", ["--max-batch", "--max-sessions", "--threads", "--max-cache-mb", "--steps-per-call"]
)
def test_non_positive_sizes_are_refused_by_the_parser(flag: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["verifier", flag, "0"])
    assert exited.value.code == 2


def test_help_lists_the_batching_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["verifier", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--max-batch", "--batch-window-ms", "--steps-per-call", "--max-sessions", "--id"):
        assert flag in out


def test_cuda_is_refused_where_onnxruntime_has_no_cuda_provider(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has CUDA: there is nothing to refuse")
    assert main(["verifier", "--provider", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specfleet verifier: provider cuda: this onnxruntime has no ")
    assert "CUDAExecutionProvider" in err and "\n" not in err


def test_a_pass_trace_that_cannot_be_written_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["verifier", "--pass-trace", str(blocker / "passes.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"specfleet verifier: --pass-trace {blocker / 'passes.jsonl'}: ")
    assert "\n" not in err
