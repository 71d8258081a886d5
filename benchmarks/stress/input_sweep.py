"""Every subcommand x bad inputs: none may end in a traceback (issue 28's sweep).

`python benchmarks/stress/input_sweep.py [--only PREFIX] [--json PATH] [--timeout-s 60]`: builds fixtures in a
temporary directory (a 2-step tiny training run, a prepared token directory, a FIFO, a binary file,
a directory where a file is expected, deeply nested JSON, ...), then runs `moetrain.cli.main(argv)` in
this process for each (command, input) case with file descriptor 2 captured and an alarm as a time
limit. A case FAILS when an exception escapes `main` (the console script would print a traceback),
when "Traceback" appears on stderr, or when it outlives the time limit. Exit status 0 means every
case answered (exit 0, or a one-line error with exit 2, or tyro's usage error). Prints one line per
case and the count; `--json` writes them.

In one process, not one per case: importing torch costs seconds per case, and the cases are
refusals that take milliseconds. Cases are chosen so that none trains for long: every train case
is refused before the first step or runs 1 step of the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from moetrain import cli  # noqa: E402

TINY = str(REPO / "configs" / "tiny_moe.toml")
NUMBERS = ["nan", "inf", "-inf", "-1", "0", "1e30", "99999999999999999999", "abc", ""]


class _Timeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Timeout


def build_fixtures(root: Path) -> dict[str, str]:
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"doc{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 40)
    fifo = root / "fifo"
    os.mkfifo(fifo)
    (root / "binary").write_bytes(bytes(range(256)) * 8)
    (root / "file").write_text("a file\n")
    (root / "empty_dir").mkdir()
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "bad.toml").write_text("[train\nsteps = = 3\n")
    (root / "list.json").write_text("[1, 2]")
    (root / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n{"text": 5}\n[1]\n')
    run = root / "run"
    base = ["train", "--config", TINY, "--data.source", "dir", "--data.path", str(corpus), "--data.glob", "*.py",
            "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "2", "--model.ffn_hidden", "64",
            "--model.max_seq_len", "32", "--model.moe.n_experts", "4", "--model.moe.top_k", "2",
            "--model.moe.expert_hidden", "16", "--data.seq_len", "32", "--train.microbatch_size", "2",
            "--train.eval_every", "0", "--train.sample_tokens", "0", "--logging.progress_bar", "False",
            "--checkpoint.every", "2", "--train.steps", "2", "--train.warmup_steps", "1"]
    code = cli.main([*base, "--logging.run_dir", str(run)])
    base = [*base, "--train.stop_at_step", "1"]  # a case whose values are valid trains one step, not train.steps
    assert code == 0, "the fixture run failed"
    tokens = root / "tokens"
    assert cli.main(["data", "prepare", "--quiet", "--input", str(corpus), "--out", str(tokens)]) == 0
    # A metrics file with odd records: a string loss, a list line, a truncated middle line.
    odd = root / "odd_run"
    odd.mkdir()
    (odd / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": "x", "tokens_per_s": 1}\n[1]\n'
                                       '{"kind": "train", "step": "two", "loss": 1.0}\n{"kind": "tra\n'
                                       '{"kind": "train", "step": 3, "loss": 1.0}\n')
    bin_run = root / "bin_run"
    bin_run.mkdir()
    (bin_run / "metrics.jsonl").write_bytes(b"\xff\xfe\x00" * 100)
    fifo_run = root / "fifo_run"
    fifo_run.mkdir()
    os.mkfifo(fifo_run / "metrics.jsonl")
    cfg_list = root / "cfg_list_run"
    cfg_list.mkdir()
    (cfg_list / "config.json").write_text("[1, 2]")
    return {"root": str(root), "corpus": str(corpus), "fifo": str(fifo), "binary": str(root / "binary"),
            "file": str(root / "file"), "empty_dir": str(root / "empty_dir"), "deep": str(root / "deep.json"),
            "bad_toml": str(root / "bad.toml"), "list_json": str(root / "list.json"),
            "bad_jsonl": str(root / "bad.jsonl"), "run": str(run), "tokens": str(tokens), "odd_run": str(odd),
            "bin_run": str(bin_run), "fifo_run": str(fifo_run), "cfg_list_run": str(cfg_list), "base": base}


def cases(f: dict) -> list[tuple[str, list[str]]]:
    root, base = f["root"], f["base"]
    out: list[tuple[str, list[str]]] = []

    def new(name: str) -> str:
        return str(Path(root) / "outs" / name)

    # ---- train: files and directories
    for label, value in [("missing", "/nonexistent.toml"), ("dir", f["empty_dir"]), ("fifo", f["fifo"]),
                         ("dev-null", "/dev/null"), ("binary", f["binary"]), ("bad toml", f["bad_toml"]),
                         ("deep json", f["deep"])]:
        out.append((f"train --config {label}", ["train", "--config", value, "--train.steps", "1"]))
    train_fields = ["train.steps", "train.lr", "train.microbatch_size", "train.grad_accum", "train.warmup_steps",
                    "data.seq_len", "model.dim", "model.n_layers", "model.moe.n_experts", "model.moe.top_k",
                    "checkpoint.every", "checkpoint.keep_last", "data.heldout_fraction", "train.stop_at_step",
                    "parallel.collective_timeout_s", "train.eval_every", "logging.log_every", "data.token_budget",
                    "train.num_threads", "train.max_grad_norm", "train.weight_decay"]
    for name in train_fields:
        for value in NUMBERS:
            out.append((f"train --{name} {value!r}", [*base, f"--{name}", value, "--logging.run_dir",
                                                       new(f"train-{name}-{value}")]))
    for label, value in [("a file", f["file"]), ("below a file", f["file"] + "/run"), ("/proc", "/proc/x"),
                         ("/proc/self", "/proc/self/run"), ("/dev/null", "/dev/null")]:
        out.append((f"train --logging.run_dir {label}", [*base, "--logging.run_dir", value]))
    for label, value in [("missing", "/nonexistent"), ("file", f["file"]), ("fifo", f["fifo"]),
                         ("empty dir", f["empty_dir"]), ("binary", f["binary"])]:
        out.append((f"train --data.path {label}", [*base, "--data.path", value, "--logging.run_dir",
                                                    new(f"train-data-{label}")]))
        out.append((f"train --data.tokenizer {label}", [*base, "--data.tokenizer", value, "--logging.run_dir",
                                                         new(f"train-tok-{label}")]))
        out.append((f"train --model.init_from hf:{label}", [*base, "--model.init_from", f"hf:{value}",
                                                             "--logging.run_dir", new(f"train-hf-{label}")]))
    out.append(("train tokens dir, other tokenizer", [*base, "--data.source", "tokens", "--data.path", f["tokens"],
                                                      "--data.tokenizer", f["binary"], "--logging.run_dir",
                                                      new("train-tokens-tok")]))
    out.append(("train --checkpoint.resume True, none", [*base, "--checkpoint.resume", "True", "--logging.run_dir",
                                                         new("train-resume-none")]))
    out.append(("train unknown flag", [*base, "--train.nope", "1"]))
    # ---- sample
    for label, value in [("missing", "/nonexistent"), ("file", f["file"]), ("empty dir", f["empty_dir"]),
                         ("fifo", f["fifo"]), ("config list", f["cfg_list_run"])]:
        out.append((f"sample --run {label}", ["sample", "--run", value]))
    for name in ["max-tokens", "temperature", "top-p", "seed"]:
        for value in NUMBERS:
            out.append((f"sample --{name} {value!r}", ["sample", "--run", f["run"], f"--{name}", value]))
    out.append(("sample --prompt binary-ish", ["sample", "--run", f["run"], "--prompt", "\udcff\x00",
                                               "--max-tokens", "2"]))
    # ---- plot
    for label, value in [("missing", "/nonexistent"), ("file", f["file"]), ("empty dir", f["empty_dir"]),
                         ("odd records", f["odd_run"]), ("binary metrics", f["bin_run"]),
                         ("fifo metrics", f["fifo_run"])]:
        out.append((f"plot {label}", ["plot", value, "--out", new(f"plot-{label}.png")]))
    for label, value in [("/proc", "/proc/x.png"), ("below a file", f["file"] + "/x.png"), ("dir", f["empty_dir"]),
                         ("no format", new("plot.nope")), ("/dev/null", "/dev/null")]:
        out.append((f"plot --out {label}", ["plot", f["run"], "--out", value]))
    # ---- export-hf
    for label, value in [("missing", "/nonexistent"), ("file", f["file"]), ("empty dir", f["empty_dir"]),
                         ("config list", f["cfg_list_run"]), ("not exportable", f["run"])]:
        out.append((f"export-hf --run {label}", ["export-hf", "--run", value, "--out", new(f"export-{label}")]))
    for value in NUMBERS:
        out.append((f"export-hf --step {value!r}", ["export-hf", "--run", f["run"], "--step", value, "--out",
                                                    new(f"export-step-{value}")]))
    for label, value in [("/proc", "/proc/x"), ("below a file", f["file"] + "/x"), ("a file", f["file"]),
                         ("bad dtype", "x")]:
        argv = ["export-hf", "--run", f["run"], "--out", value]
        out.append((f"export-hf --out {label}", argv + (["--dtype", "int8"] if label == "bad dtype" else [])))
    # ---- data prepare
    for label, value in [("missing", "/nonexistent"), ("fifo", f["fifo"]), ("dev-null", "/dev/null"),
                         ("binary", f["binary"]), ("empty dir", f["empty_dir"]), ("bad jsonl", f["bad_jsonl"]),
                         ("deep json as text", f["deep"])]:
        out.append((f"data prepare --input {label}", ["data", "prepare", "--quiet", "--input", value, "--out",
                                                      new(f"prep-{label}")]))
    for name in ["workers", "shard-mb", "heldout-fraction"]:
        for value in NUMBERS:
            out.append((f"data prepare --{name} {value!r}", ["data", "prepare", "--quiet", "--input", f["corpus"],
                                                             f"--{name}", value, "--out", new(f"prep-{name}-{value}")]))
    for label, value in [("missing", "/nonexistent.json"), ("fifo", f["fifo"]), ("binary", f["binary"]),
                         ("dir", f["empty_dir"]), ("list json", f["list_json"]), ("deep json", f["deep"])]:
        out.append((f"data prepare --tokenizer {label}", ["data", "prepare", "--quiet", "--input", f["corpus"],
                                                          "--tokenizer", value, "--out", new(f"prep-tok-{label}")]))
    for label, value in [("checkpoint dir", f["run"] + "/checkpoints/step_00000002"), ("input dir", f["corpus"]),
                         ("a file", f["file"]), ("below a file", f["file"] + "/x"), ("/proc", "/proc/x"),
                         ("run dir", f["run"])]:
        out.append((f"data prepare --out {label}", ["data", "prepare", "--quiet", "--input", f["corpus"], "--out",
                                                    value]))
    out.append(("data prepare --glob absolute", ["data", "prepare", "--quiet", "--input", f["corpus"], "--glob",
                                                 "/etc/*", "--out", new("prep-glob-abs")]))
    out.append(("data unknown", ["data", "nope"]))
    # ---- init-report, simulate, bench
    for label, value in [("missing", "/nonexistent.toml"), ("fifo", f["fifo"]), ("binary", f["binary"]),
                         ("bad toml", f["bad_toml"])]:
        out.append((f"init-report --config {label}", ["init-report", "--config", value]))
    out.append(("init-report --scheme nope", ["init-report", "--scheme", "nope"]))
    for value in NUMBERS:
        out.append((f"init-report --seed {value!r}", ["init-report", "--seed", value]))
    for name in ["replicate", "shard", "accum", "samples"]:
        for value in NUMBERS:
            out.append((f"simulate --{name} {value!r}", ["simulate", f"--{name}", value, "--samples", "20"]
                        if name != "samples" else ["simulate", "--samples", value]))
    for label, value in [("missing", "/nonexistent.json"), ("fifo", f["fifo"]), ("binary", f["binary"]),
                         ("list json", f["list_json"]), ("deep json", f["deep"])]:
        out.append((f"simulate --trace {label}", ["simulate", "--trace", value, "--samples", "20"]))
    out.append(("bench unknown", ["bench", "nope"]))
    out.append(("unknown command", ["nope"]))
    return out


def run_case(argv: list[str], timeout_s: float, log_dir: Path, index: int) -> dict:
    err_path = log_dir / f"case{index:04d}.stderr"
    saved_fd, saved_stderr = os.dup(2), sys.stderr
    with open(err_path, "w", buffering=1, errors="replace") as err_file:
        os.dup2(err_file.fileno(), 2)  # C-level writes and handlers on fd 2
        sys.stderr = err_file  # where sys.stderr is not fd 2 (pytest's capture)
        start = time.perf_counter()
        outcome, code = "", None
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            code = cli.main(list(argv))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 2
        except _Timeout:
            outcome = "timeout"
        except BaseException:  # noqa: BLE001 - what the console script would print as a traceback
            traceback.print_exc()
            outcome = "exception"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stderr.flush()
            sys.stderr = saved_stderr
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
    err = err_path.read_text(errors="replace")
    if not outcome and "Traceback" in err:
        outcome = "traceback on stderr"
    error_lines = [line for line in err.splitlines() if line.startswith("moetrain: error:")]
    return {"argv": argv, "code": code, "seconds": round(time.perf_counter() - start, 2),
            "ok": not outcome and code in (0, 1, 2, 3), "outcome": outcome or f"exit {code}",
            "answer": error_lines[0][:300] if error_lines else err.strip().splitlines()[-1][:300] if err.strip()
            else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the cases whose name starts with one of these "
                                                  "(comma-separated)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moetrain-sweep-") as tmp:
        root = Path(tmp)
        fixtures = build_fixtures(root)
        log_dir = root / "stderr"
        log_dir.mkdir()
        results = []
        for index, (name, argv) in enumerate(cases(fixtures)):
            if not name.startswith(tuple(opts.only.split(","))):
                continue
            result = {"case": name, **run_case(argv, opts.timeout_s, log_dir, index)}
            results.append(result)
            print(f"{'ok  ' if result['ok'] else 'FAIL'} {name:55s} {result['outcome']:20s} {result['answer'][:150]}",
                  flush=True)
    failed = [r for r in results if not r["ok"]]
    commands = sorted({r["argv"][0] + (" " + r["argv"][1] if r["argv"][0] in ("data", "bench") and len(r["argv"]) > 1
                                         else "") for r in results})
    print(f"{len(results)} cases over {len(commands)} commands ({', '.join(commands)}): "
          f"{len(results) - len(failed)} answered, {len(failed)} tracebacks or timeouts")
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
