"""The two sides of benchmarks/ab/torchtitan_compare.py, each run as a child in its own virtualenv.

    python benchmarks/ab/torchtitan_sides.py {moetrain,torchtitan}-child STEPS WARMUP DTYPE

`moetrain-child` runs `moetrain bench train` in this process (this tree's src on PYTHONPATH);
`torchtitan-child` runs torchtitan's own Trainer (torchtitan's virtualenv, only this checkout's
root on PYTHONPATH for benchmarks.issue_shape). Each prints one line: MARKER and a JSON object
(step time, tokens/s, its own peak RSS, parameter counts per group). Only the standard library
and benchmarks.issue_shape are imported at module level: neither side may need the other's packages.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.issue_shape import ARGS as ISSUE_ARGS
from benchmarks.issue_shape import BATCH, SEQ, VOCAB

MARKER = "RESULT "
THREADS = 2
ARGS = [*ISSUE_ARGS, "--train.num_threads", str(THREADS)]
# Parameter groups by name, for the two sides' different module names.
GROUPS = [("embedding", r"tok_embeddings|embed"), ("lm_head", r"^output\.|lm_head|^head\."),
          ("router", r"router|gate\.weight$|\.gate$"), ("experts", r"experts"),
          ("norms", r"norm"), ("attention", r"attention|attn")]


def _group(name: str) -> str:
    return next((group for group, pattern in GROUPS if re.search(pattern, name)), "other")


def _param_groups(named: list[tuple[str, int]]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for name, numel in named:
        out[_group(name)] += numel
    return dict(out)


def _peak_rss_bytes() -> int:
    """This process's own RSS high-water mark (VmHWM), not inherited through exec like ru_maxrss."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def _emit(row: dict) -> None:
    print(MARKER + json.dumps(row), flush=True)


def _time_cpu_of(cls: type, method: str) -> list[float]:
    """Wrap cls.method so that each call appends its process CPU time (all threads) to the list returned.

    On a shared machine the wall clock counts the queue for a core; CPU time counts the work (it does
    count OpenMP's spinning while a thread waits, on both sides alike)."""
    times: list[float] = []
    original = getattr(cls, method)

    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            times.append(time.process_time() - start)
    setattr(cls, method, timed)
    return times


def moetrain_child(argv: list[str]) -> None:
    """`moetrain bench train` in this process, then its numbers, parameter count and peak RSS."""
    steps, warmup, dtype = argv
    import torch

    from moetrain.cli import main
    from moetrain.config.job import parse_job_args
    from moetrain.model.transformer import Transformer
    from moetrain.train.trainer import Trainer

    args = [*ARGS, "--parallel.param_dtype", dtype]
    cpu_times = _time_cpu_of(Trainer, "train_step")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        code = main(["bench", "train", "--steps", steps, "--warmup", warmup, "--json", str(out), *args])
        if code != 0:
            raise SystemExit(code)
        bench = json.loads(out.read_text())
    peak = _peak_rss_bytes()
    with torch.device("meta"):  # no memory: the count only, after the peak was read
        model = Transformer(parse_job_args(args).model)
    named = [(name, p.numel()) for name, p in model.named_parameters()]
    _emit({"side": "moetrain", "dtype": dtype, "step_s": bench["step_s_median"],
           "tokens_per_step": bench["tokens_per_step"], "tokens_per_s": bench["tokens_per_s"],
           "peak_rss_bytes": peak, "threads": bench["threads_per_rank"], "losses": bench["losses"],
           "step_cpu_s": statistics.median(cpu_times[int(warmup):]),
           "params": sum(n for _, n in named), "param_groups": _param_groups(named),
           "loadavg": os.getloadavg()[0]})


class _CpuDeviceModule:
    """What torchtitan asks of its device module (torch.cuda's API), answered for the CPU."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: object) -> None:
        pass

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: object = None):
        from types import SimpleNamespace

        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: object = None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device: object = None) -> None:
        pass


def torchtitan_child(argv: list[str]) -> None:
    """torchtitan's Trainer on its qwen3_moe_debug config at this shape; times its own train_step."""
    steps, warmup, dtype = int(argv[0]), int(argv[1]), argv[2]
    import torch
    import torch._utils

    # torchtitan reads the device type and module once, at import: answer "cpu" before importing it.
    module_of = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda kind=None: _CpuDeviceModule() if kind == "cpu" else module_of(kind)
    torch.set_num_threads(THREADS)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})

    from dataclasses import dataclass

    import torchtitan
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    class StubTokenizer(BaseTokenizer):
        """Nothing is tokenized: the data below are token ids already."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Config, **kwargs: object) -> None:
            super().__init__()

        def encode(self, *args: object, **kwargs: object) -> list[int]:
            raise NotImplementedError

        def decode(self, *args: object, **kwargs: object) -> str:
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return VOCAB

    class RandomTokens(BaseDataLoader):
        """Endless (input, labels) batches of uniform random token ids, one document per row."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config: Config, *, seq_len: int, local_batch_size: int, **kwargs: object) -> None:
            self.seq_len, self.batch = seq_len, local_batch_size
            self.generator = torch.Generator().manual_seed(0)

        def __iter__(self):
            while True:
                ids = torch.randint(0, VOCAB, (self.batch, self.seq_len + 1), generator=self.generator)
                yield {"input": ids[:, :-1].contiguous()}, ids[:, 1:].contiguous()

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    config = qwen3_moe_debug()
    config.training.local_batch_size = BATCH
    config.training.seq_len = SEQ
    config.training.steps = warmup + steps
    config.training.mixed_precision_param = dtype
    config.activation_checkpoint = None
    config.checkpoint.enable = False
    config.tokenizer = StubTokenizer.Config()
    config.dataloader = RandomTokens.Config()
    config.metrics.log_freq = 1
    # Causal SDPA instead of the compiled FlexAttention (without positions: one document per row).
    for _, _, parent, field in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, field, ScaledDotProductAttention.Config())
    with tempfile.TemporaryDirectory() as tmp:
        config.dump_folder = tmp
        trainer = config.build()
        data = trainer.batch_generator(trainer.dataloader)
        times, cpu_times = [], []
        for index in range(warmup + steps):
            trainer.step += 1
            trainer.gc_handler.run(trainer.step)
            start, start_cpu = time.perf_counter(), time.process_time()
            trainer.train_step(data)
            if index >= warmup:
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - start_cpu)
        peak = _peak_rss_bytes()
        named = [(name, p.numel()) for part in trainer.model_parts for name, p in part.named_parameters()]
        trainer.close()
    step_s = statistics.median(times)
    _emit({"side": "torchtitan", "dtype": dtype, "step_s": step_s, "tokens_per_step": BATCH * SEQ,
           "tokens_per_s": BATCH * SEQ / step_s, "peak_rss_bytes": peak,
           "step_cpu_s": statistics.median(cpu_times), "threads": torch.get_num_threads(),
           "params": sum(n for _, n in named), "param_groups": _param_groups(named), "attention": "sdpa",
           "torchtitan_version": torchtitan.__version__, "loadavg": os.getloadavg()[0]})


if __name__ == "__main__":
    {"moetrain-child": moetrain_child, "torchtitan-child": torchtitan_child}[sys.argv[1]](sys.argv[2:])
