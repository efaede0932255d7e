"""Load prompt and passthrough datasets from JSONL, Parquet or a saved Hugging Face dataset.

Accepted inputs (chosen by path):
- `*.jsonl` / `*.json`: JSON Lines, one object per line, UTF-8. Whitespace-only lines are skipped.
- `*.parquet`: one Parquet file; only the columns a row kind needs are read, batch by batch.
- a directory of `*.parquet` files (top level only, name order; names starting with `.` or `_`
  are ignored).
- a directory written by `datasets.Dataset.save_to_disk` (state.json + data-*.arrow in Arrow
  IPC stream format), read with pyarrow alone; a `DatasetDict` directory (dataset_dict.json)
  contributes its "train" split.

Row kinds:
- generate: optional `id` (string or int), and either `messages` (non-empty list of
  {role: system|user|assistant, content: str}, ending with a user turn) or `prompt` (a non-empty
  string, which becomes one user message). Not both.
- passthrough: optional `id`, and either `messages` with at least one assistant turn (roles
  system|user|assistant|tool: agentic transcripts carry tool results), or `input_ids`
  (non-negative ints) + `loss_mask` (0/1 or bools, same length, at least one 1).

Message content must be a non-empty string, except that `tool` turns and assistant turns carrying
`tool_calls` or `reasoning_content` may have empty content. Keys besides role/content (name,
tool_calls, reasoning_content, ...) are kept when not null; nulls are dropped, because Arrow
fills keys a row lacks with null and the same row must look the same in every format.

A row without `id` gets `stable_id` of its content: generate rows hash {"messages": [...]} (a
`prompt` row hashes as its one user message, so both spellings of a prompt share an id);
passthrough rows hash {"messages": [...]} or {"input_ids": [...], "loss_mask": [0/1 ...]}.

Ids are strings: an int id 7 becomes "7". Each id names one row. A repeat with the same content
(the same messages, or input_ids + loss_mask; other keys are ignored) is a duplicate: dropped and
counted. A repeat with different content, or an int id meeting the same id as a string (7 and "7"),
is a bad row naming both rows; the first occurrence is kept.

Bad rows raise `DatasetError` naming the file, the line (JSONL) or row (1-based), what is wrong
and what is expected; with `on_bad_row="skip"` they become `Reject`s and loading goes on. A
dataset with no usable row left raises `EmptyDatasetError`.
"""

from tasks.datasets.errors import DatasetError, DatasetNotFoundError, EmptyDatasetError
from tasks.datasets.loader import OnBadRow, iter_rows, load_dataset
from tasks.datasets.rows import (GENERATE_ROLES, PASSTHROUGH_ROLES, BadRow, Kind, LoadedDataset, PassthroughRow,
                                 PromptRow, Reject, build_passthrough, build_prompt, stable_id)

# The package's public names; each concept has its module: rows.py (row rules and ids), errors.py, loader.py (ids
# unique, bad rows raised or rejected), raw.py (what readers yield) and one reader per file format: jsonl.py,
# parquet.py, hf_saved.py.
__all__ = ["GENERATE_ROLES", "PASSTHROUGH_ROLES", "BadRow", "DatasetError", "DatasetNotFoundError", "EmptyDatasetError",
           "Kind", "LoadedDataset", "OnBadRow", "PassthroughRow", "PromptRow", "Reject", "build_passthrough",
           "build_prompt", "iter_rows", "load_dataset", "stable_id"]
