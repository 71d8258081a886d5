"""Corpora: where documents come from, and the deterministic train / held-out split.

Sources (all local, nothing is downloaded):
- `stdlib`: the running interpreter's own standard-library `.py` sources, found via
  `sysconfig`, one document per file. Directories named `test`, `tests`, `idle_test`,
  `site-packages`, `dist-packages` and `__pycache__` are left out: the test suites
  hold deliberately malformed files (bad encodings, broken syntax) and make up half
  the tree, and site-packages is third-party code, not the standard library.
- `dir`: the text files under `data.path` matching `data.glob`, one document per file.
- `jsonl`: one document per line of a JSONL file, taken from the `data.text_field` key.
- `hf`: a Hugging Face `datasets` dataset saved on local disk (`save_to_disk`), the
  `train` split when it is a DatasetDict (optional extra, imported only here).

Documents are sorted by name so the order never depends on the file system. The
held-out set is chosen by a hash of each document's name, so a document stays on
the same side when others are added or removed. Bad files (unreadable, not UTF-8)
raise a one-line ConfigError, or are skipped with a warning when
`data.skip_bad_files` is set; so are file names that are not UTF-8 (a document's name
is hashed as UTF-8 for the split). A symbolic link that loops is never a document:
it is skipped with a warning line. This module reads text; it does not tokenize.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from moetrain.config.data import DataConfig
from moetrain.errors import ConfigError
from moetrain.logging import get_logger

STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[Document]
    heldout: list[Document]
    source: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> tuple[Path, list[Path]]:
    root = stdlib_root()
    files = []
    # Pruned walk: never entering the excluded trees (site-packages can hold far more files than
    # the library itself) takes milliseconds where rglob-then-filter took over a second.
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in STDLIB_EXCLUDED_DIRS]
        files += [Path(directory, n) for n in names if n.endswith(".py") and Path(directory, n).is_file()]
    return root, sorted(files, key=lambda f: f.relative_to(root).as_posix())


def _read_text(path: Path, name: str, skip_bad: bool) -> str | None:
    """The UTF-8 text of a file, or None (with a warning) for a bad file when skipping."""
    try:
        data = path.read_bytes()
        return data.decode("utf-8")
    except OSError as err:
        problem = f"data file {name!r} is unreadable ({err.strerror or type(err).__name__})"
    except UnicodeDecodeError as err:
        problem = f"data file {name!r} is not UTF-8 text (bad byte at offset {err.start})"
    _skip_or_refuse(problem, "fix or remove it", skip_bad)
    return None


def _skip_or_refuse(problem: str, remedy: str, skip_bad: bool) -> None:
    """Warn and return under data.skip_bad_files; else raise the one-line ConfigError."""
    if skip_bad:
        get_logger("data").warning("skipping %s", problem)
        return
    raise ConfigError(f"{problem}; {remedy}, or set --data.skip_bad_files True to skip such files")


def _printable_name(name: str) -> str:
    """A file name as text even when its bytes are not UTF-8 (undecodable bytes shown as \\xNN)."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def utf8_name(name: str, skip_bad: bool) -> bool:
    """Whether a file name is valid UTF-8; a bad one raises ConfigError or, when skipping, warns."""
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        problem = f"data file name '{_printable_name(name)}' is not valid UTF-8"
    _skip_or_refuse(problem, "rename it", skip_bad)
    return False


def _is_symlink_loop(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as err:
        return err.errno == errno.ELOOP
    return False


def files_under(root: Path, pattern: str) -> list[Path]:
    """The regular files under `root` matching `pattern`; symbolic-link loops and dangling links skipped with a
    warning (a link whose target is gone is most likely a document the user meant to include)."""
    files = []
    try:
        matches = list(root.glob(pattern))
    except (NotImplementedError, ValueError) as err:  # an absolute or empty pattern
        raise ConfigError(f"glob pattern {pattern!r} is invalid ({err}); use a pattern relative to {str(root)!r}, "
                          "e.g. '**/*.txt'") from None
    for path in matches:
        if path.is_file():
            files.append(path)
        elif path.is_symlink():
            why = "a symbolic link loop" if _is_symlink_loop(path) else (
                "a dangling symbolic link (its target does not exist)" if not path.exists() else "")
            if why:
                get_logger("data").warning("skipping data file '%s': it is %s",
                                           _printable_name(path.relative_to(root).as_posix()), why)
    return files


def _file_documents(root: Path, files: list[Path], skip_bad: bool) -> list[Document]:
    documents = []
    for path in files:
        name = path.relative_to(root).as_posix()
        if not utf8_name(name, skip_bad):
            continue
        text = _read_text(path, name, skip_bad)
        if text is not None:
            documents.append(Document(name, text))
    return documents


def stdlib_documents(cfg: DataConfig) -> list[Document]:
    root, files = stdlib_files()
    if not files:
        raise ConfigError(f"data.source = 'stdlib' found no .py files under {str(root)!r}; "
                          "use data.source = 'dir' with a data.path")
    return _file_documents(root, files, cfg.skip_bad_files)


def directory_documents(cfg: DataConfig) -> list[Document]:
    root = Path(cfg.path or "")
    if not root.is_dir():
        raise ConfigError(f"data.path = {cfg.path!r} is not a directory (data.source = 'dir')")
    files = sorted(files_under(root, cfg.glob), key=lambda f: f.relative_to(root).as_posix())
    if not files:
        raise ConfigError(f"data.path = {cfg.path!r} has no files matching data.glob = {cfg.glob!r}")
    return _file_documents(root, files, cfg.skip_bad_files)


def jsonl_documents(cfg: DataConfig) -> list[Document]:
    path = Path(cfg.path or "")
    if not path.is_file():
        raise ConfigError(f"data.path = {cfg.path!r} is not a file (data.source = 'jsonl')")
    text = _read_text(path, str(path), skip_bad=False)
    assert text is not None
    documents = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            value = record[cfg.text_field]
            if not isinstance(value, str):
                raise TypeError(f"{cfg.text_field!r} is {type(value).__name__}, not a string")
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            problem = (f"{cfg.path}:{line_no} is not a JSON object with a string field "
                       f"data.text_field = {cfg.text_field!r} ({type(err).__name__})")
            if cfg.skip_bad_files:
                get_logger("data").warning("skipping line %s", problem)
                continue
            raise ConfigError(f"{problem}; fix the line or set --data.skip_bad_files True") from None
        # Zero-padded so sorting by name keeps the file's line order.
        documents.append(Document(f"{path.name}:{line_no:09d}", value))
    return documents


def hf_documents(cfg: DataConfig) -> list[Document]:
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.source = 'hf' needs the `datasets` package, which is not installed; "
                          "install the extra `pip install moetrain[hf]`") from None
    try:
        dataset = datasets.load_from_disk(cfg.path)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"data.path = {cfg.path!r} is not a dataset saved with save_to_disk: "
                          f"{str(err).splitlines()[0]}") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ConfigError(f"data.path = {cfg.path!r} is a DatasetDict without a 'train' split "
                              f"(splits: {sorted(dataset)})")
        dataset = dataset["train"]
    if cfg.text_field not in dataset.column_names:
        raise ConfigError(f"data.text_field = {cfg.text_field!r} is not a column of {cfg.path!r} "
                          f"(columns: {dataset.column_names})")
    return [Document(f"{i:012d}", text) for i, text in enumerate(dataset[cfg.text_field]) if isinstance(text, str)]


SOURCES = {"stdlib": stdlib_documents, "dir": directory_documents, "jsonl": jsonl_documents, "hf": hf_documents}


def is_heldout(name: str, heldout_fraction: float) -> bool:
    """Stable per-document choice: the first 8 bytes of SHA-256(name) as a fraction of 2**64."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read the configured source, drop empty documents, split into train and held-out."""
    if cfg.source not in SOURCES:
        raise ConfigError(f"data.source = {cfg.source!r} is invalid: one of {sorted(SOURCES)}")
    documents = sorted((d for d in SOURCES[cfg.source](cfg) if d.text), key=lambda d: d.name)
    if cfg.max_documents is not None:
        documents = documents[: cfg.max_documents]
    where = cfg.path if cfg.source != "stdlib" else str(stdlib_root())
    if not documents:
        raise ConfigError(f"data source {cfg.source!r} at {where!r} has no non-empty documents")
    heldout = [d for d in documents if is_heldout(d.name, cfg.heldout_fraction)]
    train = [d for d in documents if not is_heldout(d.name, cfg.heldout_fraction)]
    if not train:
        raise ConfigError(f"data.heldout_fraction = {cfg.heldout_fraction} leaves no training documents "
                          f"out of {len(documents)}; lower it")
    if cfg.heldout_fraction > 0 and not heldout:
        # Tiny corpora may hash every document to the train side; hold out the last
        # one so held-out loss is still measured on unseen text.
        heldout, train = train[-1:], train[:-1]
        if not train:
            raise ConfigError(f"data source {cfg.source!r} at {where!r} has only one document; a held-out "
                              "split needs at least two (or set data.heldout_fraction = 0)")
    return Corpus(train=train, heldout=heldout, source=cfg.source)
