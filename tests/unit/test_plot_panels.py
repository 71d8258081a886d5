"""`moetrain plot`'s curves: learning-rate and gradient-norm panels draw the records' values, and every
panel marks the steps the run resumed at (a metrics file written by hand, so the expectation is known)."""

from __future__ import annotations

import json

from moetrain.observe.plot import curve_figure, plot_run, read_records


def _records() -> list[dict]:
    rows = [{"kind": "event", "event": "start", "step": 0}]
    for step in range(1, 7):
        rows.append({"kind": "train", "step": step, "loss": 3.0 - 0.1 * step, "tokens_per_s": 100.0 + step,
                     "lr": 1e-3 * step, "grad_norm": 2.0 / step})
        if step == 3:
            rows.append({"kind": "event", "event": "resume", "step": 3})
    return rows


def test_lr_and_grad_norm_panels_and_resume_marks(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    fig = curve_figure(read_records(run_dir / "metrics.jsonl"), {}, "t")
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert {"learning rate", "gradient norm"} <= set(axes)
    lr_line = axes["learning rate"].lines[0]
    assert list(lr_line.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert list(lr_line.get_ydata()) == [1e-3 * s for s in range(1, 7)]
    assert list(axes["gradient norm"].lines[0].get_ydata()) == [2.0 / s for s in range(1, 7)]
    for ax in fig.axes:  # one vertical line at the resume step in every panel
        marks = [line for line in ax.lines if line.get_linestyle() == "--"]
        assert [list(m.get_xdata()) for m in marks] == [[3, 3]], ax.get_title()
    assert plot_run(run_dir)[0].is_file()


def test_a_run_without_resumes_has_no_marks(tmp_path):
    records = [r for r in _records() if r.get("event") != "resume"]
    fig = curve_figure(records, {}, "t")
    assert all(line.get_linestyle() != "--" for ax in fig.axes for line in ax.lines)
