"""Dataset inputs of `data prepare` read through `datasets`: local .parquet / .json / .arrow files, directories
saved with `save_to_disk`, and `hf:NAME` datasets of the local Hugging Face cache, reloaded offline.

Each dataset is checked to hold the field a prepare reads. `datasets` is an optional extra, imported where
used, and nothing here reaches the network: a dataset that is not cached is one line naming it. This module
opens datasets; it does not name documents, plan shards or tokenize.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moetrain.errors import ConfigError

# File suffixes read as datasets (a row per document) and the `datasets.load_dataset` builder for each.
DATASET_FILES = {".parquet": "parquet", ".json": "json", ".arrow": "arrow"}


# An input naming a dataset in the local Hugging Face cache (`hf:NAME`), read offline.
HF_PREFIX = "hf:"


def _import_datasets(path: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"--input {path!r} is read with the `datasets` package; install "
                          "the extra `pip install moetrain[hf]`") from None
    # An unreadable file is answered in one line (load_dataset's ConfigError): datasets' own log lines about
    # it would come on top, and its progress bars only help on a terminal.
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL + 1)
    if not sys.stderr.isatty():
        datasets.utils.logging.disable_progress_bar()
    return datasets


@contextmanager
def _hub_offline(datasets: Any) -> Iterator[None]:
    """Offline for the Hub, as HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 make it: `datasets` then resolves a
    name from its local cache and downloads nothing (it checks this flag before any request). The variables
    are read when `datasets` is imported, so in a process that imported it before, its parsed flag is set
    for the duration instead."""
    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def _load_cached(path: str, hf: tuple[str | None, str], streaming: bool = False) -> Any:
    """`hf:NAME`: the dataset of that name in the local Hugging Face cache (HF_HOME / HF_DATASETS_CACHE),
    reloaded offline by `datasets.load_dataset(NAME, CONFIG, split=SPLIT)` as it reloads any cached dataset."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # (for a `datasets` imported from here on)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets = _import_datasets(path)
    name, (config, split) = path[len(HF_PREFIX):], hf
    where = f"--input {path!r}" + (f" (--hf-config {config!r})" if config else "") + f" --hf-split {split!r}"
    if not name or Path(name).exists():
        raise ConfigError(f"{where}: {'no dataset name given' if not name else repr(name) + ' is also a local path'}"
                          "; give hf:NAME of a dataset in the local Hugging Face cache, or the local path itself")
    try:
        with _hub_offline(datasets):
            return datasets.load_dataset(name, config, split=split, streaming=streaming)
    except ConnectionError:  # offline and not cached: what `datasets` raises after looking in the cache
        raise ConfigError(f"{where}: dataset {name!r} is not in the local Hugging Face cache "
                          f"({datasets.config.HF_DATASETS_CACHE}); nothing is downloaded: load it once with "
                          "network access (or set HF_HOME / HF_DATASETS_CACHE to where it is)") from None
    except Exception as err:  # noqa: BLE001 - a wrong config or split, a damaged cache entry: many types
        lines = "; ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
        raise ConfigError(f"{where}: dataset {name!r} cannot be read from the local Hugging Face cache "
                          f"({type(err).__name__}: {lines})") from None


def load_dataset(path: str, text_field: str, hf: tuple[str | None, str] = (None, "train"),
                  streaming: bool = False) -> Any:
    """The dataset of a row input (map-style, memory-mapped Arrow; an IterableDataset when `streaming`),
    checked to hold `text_field`."""
    if path.startswith(HF_PREFIX):
        dataset = _load_cached(path, hf, streaming)
        if text_field not in (dataset.column_names or []):
            raise ConfigError(f"--text-field / --messages-field {text_field!r} is not a column of {path!r} "
                              f"(columns: {dataset.column_names})")
        return dataset
    datasets = _import_datasets(path)
    suffix = Path(path).suffix
    try:
        if streaming and Path(path).is_file() and suffix in DATASET_FILES:
            options: dict[str, Any] = {}
            if suffix == ".parquet":  # no pre-buffering: it keeps each file's column chunks read so far
                import pyarrow.dataset

                options["fragment_scan_options"] = pyarrow.dataset.ParquetFragmentScanOptions(pre_buffer=False)
            dataset = datasets.load_dataset(DATASET_FILES[suffix], data_files=str(path), split="train",
                                            streaming=True, **options)
        elif Path(path).is_file() and suffix in DATASET_FILES:
            dataset = datasets.load_dataset(DATASET_FILES[suffix], data_files=str(path), split="train")
        else:
            dataset = datasets.load_from_disk(path)
    except Exception as err:  # noqa: BLE001 - datasets raises many unrelated types for an unreadable file
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"--input {path!r} is not a readable dataset ({type(err).__name__}: {first})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ConfigError(f"--input {path!r} is a DatasetDict without a 'train' split")
        dataset = dataset["train"]
    if dataset.column_names is not None and text_field not in dataset.column_names:
        raise ConfigError(f"--text-field / --messages-field {text_field!r} is not a column of {path!r} "
                          f"(columns: {dataset.column_names})")
    return dataset
