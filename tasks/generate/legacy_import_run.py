"""`eagle3 import-jsonl` below its arguments: the lock, the tokenizer, the import, and each failure as the exit status
and message the command prints (the import itself: tasks/generate/legacy_import.py)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Literal

from models.common.file_errors import WriteFailed
from settings.layout import RunLayout
from tasks.datasets import DatasetError
from tasks.generate.legacy_import import ImportReport, import_jsonl
from tasks.responses.parquet_io import DamagedPart
from tasks.runtime.run_lock import RunDirLocked, run_lock


class ImportFailed(Exception):
    """The import stopped, nothing of the file imported: `code` 2 for bad input (the file, a line, the tokenizer),
    1 for the run directory (another writer holds it, a write failed, a part there is damaged); `label` is how the
    command labels the message ("refused" for a held lock)."""

    def __init__(self, message: str, code: int, label: str = "error") -> None:
        super().__init__(message)
        self.code, self.label = code, label


def import_legacy_file(
    run_dir: Path,
    dataset: str,
    file: Path,
    *,
    target: str,
    trust_remote_code: bool,
    on_bad_line: Literal["fail", "skip"],
) -> ImportReport:
    """Import `file` into RUN_DIR/responses/DATASET/ with the target's tokenizer; ImportFailed says why not.

    RUN_DIR's write lock is taken before the tokenizer loads, so a second writer is refused at once, not after it.
    """
    layout = RunLayout(run_dir)
    with ExitStack() as stack:
        try:
            stack.enter_context(run_lock(run_dir, f"import-jsonl {dataset}"))
        except RunDirLocked as exc:
            raise ImportFailed(str(exc), 1, "refused") from None
        except OSError as exc:
            raise ImportFailed(str(WriteFailed(layout.lock, exc, kept="nothing was imported")), 1) from None
        from models.target.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(target, trust_remote_code)
        except Exception as exc:  # a wrong path, a Hub id while offline, a broken tokenizer.json
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ImportFailed(
                f"cannot load the target tokenizer from {target}: {reason}. Pass --target PATH.", 2
            ) from None
        try:
            return import_jsonl(run_dir, dataset, file, tokenizer=tokenizer, on_bad_line=on_bad_line)
        except (WriteFailed, DamagedPart) as exc:  # the run directory's fault: the message says what to do
            raise ImportFailed(str(exc), 1) from None
        except DatasetError as exc:
            if exc.row is None:  # FILE or RUN_DIR, changed since the command's checks
                raise ImportFailed(str(exc), 2) from None
            raise ImportFailed(
                f"{exc}. Nothing of this file was imported: fix or delete that line and run the import again, or pass "
                f"--on-bad-line skip to import the other lines and list the bad ones in {layout.rejects(dataset)}/.",
                2,
            ) from None
        except OSError as exc:  # writes fail as WriteFailed: this is a read (FILE or a part) the OS refused
            raise ImportFailed(f"cannot read {exc.filename or file}: {exc.strerror or exc}", 1) from None
