from __future__ import annotations

from atom_models.cli import build_parser, main


def test_atom_generate_runs_with_mtp(model_dir, capsys):
    rc = main(
        [
            "--model",
            str(model_dir),
            "--prompt",
            "import os\ndef main(",
            "--max-tokens",
            "12",
            "--speculative-tokens",
            "2",
            "--ignore-eos",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- 12 tokens" in out
    assert "MTP k=2: drafts" in out and "mean acceptance length" in out


def test_cuda_graphs_flag():
    """--cuda-graphs / --no-cuda-graphs set EngineConfig.cuda_graphs; absent: None (on for CUDA only)."""
    base = ["--prompt", "x"]
    assert build_parser().parse_args(base).cuda_graphs is None
    assert build_parser().parse_args([*base, "--cuda-graphs"]).cuda_graphs is True
    assert build_parser().parse_args([*base, "--no-cuda-graphs"]).cuda_graphs is False
