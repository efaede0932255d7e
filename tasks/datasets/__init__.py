"""Load prompt and passthrough datasets from JSONL, Parquet, a saved Hugging Face dataset or the Hugging Face Hub.

Accepted inputs (chosen by path):
- `*.jsonl` / `*.json`: JSON Lines, one object per line, UTF-8. Whitespace-only lines are skipped.
- `*.parquet`: one Parquet file; only the columns the dataset's row format needs are read, batch by batch.
- a directory of `*.parquet` files (top level only, name order; names starting with `.` or `_`
  are ignored).
- a directory written by `datasets.Dataset.save_to_disk` (state.json + data-*.arrow in Arrow
  IPC stream format), read with pyarrow alone; a `DatasetDict` directory (dataset_dict.json)
  contributes its "train" split.
- `hf:ORG/NAME`: a Hugging Face Hub dataset (hub.py: a HubDataset carries its split, config, revision and the run's
  record of the commit read), fetched with huggingface_hub into the Hub cache, or found there with HF_HUB_OFFLINE=1,
  and read with `datasets`.

Row formats (the dataset's `format`, formats.py; any file type): each row is read into the canonical row below.
- messages: the canonical row itself; role names other than the four are renamed through ROLE_ALIASES (human ->
  user, gpt -> assistant, ...) and the dataset's `roles`.
- sharegpt: `conversations` [{from, value}], `from` renamed the same way.
- alpaca: `instruction`, optional `input` (appended to the instruction after a blank line), optional `output`
  (the assistant turn; needed for passthrough).
- columns: `system_field` (optional), `prompt_field`, `response_field` (passthrough), one turn each.
- ultrachat: `data`, strings alternating user, assistant, ...
- glaive: `system` + `chat` (glaive-function-calling-v2): `chat` split on the role markers opening its lines (USER:,
  ASSISTANT:, FUNCTION RESPONSE: -> user, assistant, tool), `<|endoftext|>` removed; `system` minus `SYSTEM:` is the
  system turn. A `<functioncall> {...}` in an assistant turn stays text.
- auto (the default): detected once per dataset, from the columns (Parquet, Arrow) or the first row that fits a
  format (JSONL); keys that fit no format or several are a bad row (a file error for a column reader) that names
  them and the config line that reads them (detect.py has the rules).
The id comes from `id_field` (default `id`). A converted row keeps role and content of each turn only, so it is
the same row, with the same id, as the conversation written as `messages`.

Row kinds:
- generate: optional `id` (string or int), and either `messages` (non-empty list of
  {role: system|user|assistant, content: str}, ending with a user turn) or `prompt` (a non-empty
  string, which becomes one user message). Not both, except that a `prompt` equal to the content of the first
  user turn of `messages` (ultrachat_200k: prompt, prompt_id, messages) is ignored and `messages` read.
  A conversation that ends with an assistant turn is cut after its last user turn (rows.prompt_length), in
  every format, and the cut turns are not checked.
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

Bad rows raise `DatasetError` naming the file, the line (JSONL) or row (1-based), what is wrong (in the row's
own fields: 'conversations[2].value' is missing) and what is expected; with `on_bad_row="skip"` they become
`Reject`s and loading goes on. A dataset with no usable row left raises `EmptyDatasetError`.
"""

from tasks.datasets.errors import DatasetError, DatasetNotFoundError, EmptyDatasetError
from tasks.datasets.formats import ROLE_ALIASES, Shape
from tasks.datasets.hub import HubDataset
from tasks.datasets.loader import DatasetStream, OnBadRow, iter_rows, load_dataset, stream_dataset
from tasks.datasets.rows import (
    GENERATE_ROLES,
    PASSTHROUGH_ROLES,
    BadRow,
    Kind,
    LoadedDataset,
    PassthroughRow,
    PromptRow,
    Reject,
    build_passthrough,
    build_prompt,
    stable_id,
)

# The package's public names; each concept has its module: rows.py (row rules and ids), errors.py, loader.py (ids
# unique, bad rows raised or rejected), formats.py (row formats -> canonical rows), detect.py (format auto), raw.py
# (what readers yield) and one reader per file type: jsonl.py, parquet.py, hf_saved.py, and hub.py for `hf:` paths.
__all__ = [
    "GENERATE_ROLES",
    "PASSTHROUGH_ROLES",
    "ROLE_ALIASES",
    "BadRow",
    "DatasetError",
    "DatasetNotFoundError",
    "DatasetStream",
    "EmptyDatasetError",
    "HubDataset",
    "Kind",
    "LoadedDataset",
    "OnBadRow",
    "PassthroughRow",
    "PromptRow",
    "Reject",
    "Shape",
    "build_passthrough",
    "build_prompt",
    "iter_rows",
    "load_dataset",
    "stable_id",
    "stream_dataset",
]
