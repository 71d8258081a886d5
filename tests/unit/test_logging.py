"""Rank-aware logging: prefixes, rank-0 console, per-rank files."""

import logging

from moetrain.logging import get_logger, print_rank, setup_logging


def test_prefix_and_per_rank_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    setup_logging(log_dir=tmp_path)
    get_logger("t").info("hello from three")
    logging.getLogger("moetrain").handlers[0].flush()
    assert "[rank=3]" in (tmp_path / "rank3.log").read_text()
    assert "hello from three" not in capsys.readouterr().err  # only rank 0 logs to the console
    print_rank("dbg")
    print_rank("hidden", ranks=[0])
    out = capsys.readouterr().out
    assert "[rank=3] dbg" in out and "hidden" not in out


def test_rank_zero_console(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    setup_logging()
    get_logger().warning("visible")
    assert "[rank=0]" in capsys.readouterr().err
