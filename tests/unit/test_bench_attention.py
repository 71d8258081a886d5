"""`moetrain bench attention` on a tiny shape: files written, report consistent with the layout, user errors."""

import json

import pytest
import torch

from moetrain.bench import attention as bench_attention
from moetrain.cli import main as cli_main
from moetrain.errors import ConfigError
from moetrain.model.attention import block_layout, segment_layout

TINY = ["--rows", "2", "--seq", "96", "--heads", "2", "--kv_heads", "1", "--head_dim", "8", "--warmup", "0",
        "--repeats", "2", "--mean_doc_lengths", "8", "96", "--tiles", "1", "16",
        "--blocks", "32", "64"]


def test_packed_document_ids_are_contiguous_runs_from_zero_with_the_requested_mean():
    ids = bench_attention.packed_document_ids(8, 1024, 64, torch.Generator().manual_seed(0))
    assert ids.shape == (8, 1024) and (ids[:, 0] == 0).all()
    steps = ids[:, 1:] - ids[:, :-1]
    assert ((steps == 0) | (steps == 1)).all()  # each id one run, counting up
    starts = int((steps == 1).sum()) + 8  # documents, counting the cut ones once per row
    assert 50 < ids.numel() / starts < 70  # mean length 64 (+1/2 from rounding up), less the cuts


def test_bench_writes_json_table_and_plot_consistent_with_the_layout(tmp_path, capsys):
    assert bench_attention.main([*TINY, "--out_dir", str(tmp_path), "--name", "b"]) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert (tmp_path / "b.txt").read_text().startswith("mix (mean doc len)")
    assert (tmp_path / "b.png").stat().st_size > 0
    short, long_ = report["mixes"]
    # --tiles 16 and --blocks 64 are the defaults, so they are not timed twice
    assert list(short["methods"]) == ["dense", "segments", "segments/tile=1", "blocks", "blocks/block=32", "auto"]
    assert short["methods"]["dense"]["speedup_vs_dense"]["median"] == 1.0
    assert all(len(r["seconds"]) == 2 and min(r["seconds"]) > 0 for r in short["methods"].values())
    ids = bench_attention.packed_document_ids(2, 96, 8, torch.Generator().manual_seed(0))
    assert short["segment_work_vs_dense"] == segment_layout(ids).padded_work() / (2 * 96 ** 2)
    assert short["block_work_vs_dense"] == block_layout(ids).work() / (2 * 96 ** 2)
    assert short["auto_resolves_to"] == "segments"
    assert long_["documents"] <= 4  # mean 96 in 96-token rows: one or two documents a row


def test_bench_bad_options_exit_2_and_write_nothing(tmp_path, capsys):
    with pytest.raises(ConfigError, match="--blocks = \\(0,\\) is invalid"):
        bench_attention.main(["--blocks", "0", "--out_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="--kv_heads = 3 is invalid"):
        bench_attention.main(["--heads", "4", "--kv_heads", "3", "--out_dir", str(tmp_path)])
    assert cli_main(["bench", "attention", "--rows", "0", "--out_dir", str(tmp_path)]) == 2
    assert "--rows = 0 is invalid" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
