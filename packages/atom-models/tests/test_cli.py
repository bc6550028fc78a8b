from __future__ import annotations

from atom_models.cli import main


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
