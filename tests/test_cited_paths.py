"""Every repository path the prose cites exists: README, docs/, configs, bench/ and deploy/ notes, docstrings and
comments (and, outside tests/, every string: help texts and error messages send users to files too).

A cited path is a word starting at one of the repository's top-level folders (`models/train/job.py`, `docs/engines.md`,
`deploy/deepspeed/`); one with a wildcard or a placeholder (`deploy/deepspeed/*.json`, `runs/<bench>/`) is not checked.
A path inside someone else's tree is cited with its root (`vllm/model_executor/models/llama_eagle3.py`), so it is
not read as one of ours. The paths a user writes (their own config, data and hostfile) are listed in USER_PATHS.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP = (
    "flows",
    "tasks",
    "models",
    "settings",
    "emulators",
    "bench",
    "tests",
    "docs",
    "deploy",
    "configs",
    "data",
    ".ci",
)
ROOTS = "|".join(re.escape(t) for t in TOP)
CITED = re.compile(rf"(?<![\w./-])((?:{ROOTS})/[\w.*{{}}<>-]+(?:/[\w.*{{}}<>-]+)*/?)")
PROSE = (".md", ".yaml", ".yml", ".sh", ".toml")
# paths the docs tell users to create, not files of this repository: a user's copy of a preset, their data (the
# Kimi preset's datasets, docs/run-a-pipeline.md; FastChat's MT-bench questions, configs/llama-3.1-8b-1gpu.yaml), a
# DeepSpeed hostfile (docs/scale-out.md)
USER_PATHS = {
    "configs/my-kimi.yaml",
    "configs/my-2nodes.yaml",
    "deploy/hostfile",
    "data/kimi/",
    "data/mt_bench/question.jsonl",
}
USER_PREFIXES = ("data/kimi/",)


def tracked() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / name for name in listed.splitlines() if (REPO / name).is_file()]


def python_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment and docstring; outside tests/ of every string literal too."""
    source = path.read_text()
    found = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    tree = ast.parse(source, str(path))
    if path.relative_to(REPO).parts[0] == "tests":
        nodes = [
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        docs = [n.body[0].value for n in nodes if n.body and isinstance(n.body[0], ast.Expr)]
        strings = [d for d in docs if isinstance(d, ast.Constant) and isinstance(d.value, str)]
    else:
        strings = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    for node in strings:
        found += [(node.lineno + i, line) for i, line in enumerate(node.value.splitlines())]
    return found


def prose(path: Path) -> list[tuple[int, str]]:
    if path.suffix == ".py":
        return python_prose(path)
    if path.suffix in PROSE or path.name in ("Makefile", "run"):
        return list(enumerate(path.read_text(errors="replace").splitlines(), 1))
    return []


def cited(text: str) -> list[str]:
    """The repository paths cited in `text`, trailing punctuation dropped; placeholders and wildcards left out."""
    paths = [m.group(1).rstrip(".,:;)'`\"") for m in CITED.finditer(text)]
    return [p for p in paths if not any(c in p for c in "*{}<>")]


def missing() -> list[str]:
    stale = []
    for path in tracked():
        for line, text in prose(path):
            for cite in cited(text):
                if cite in USER_PATHS or cite.startswith(USER_PREFIXES) or (REPO / cite).exists():
                    continue
                stale.append(f"{path.relative_to(REPO)}:{line}: {cite}")
    return sorted(set(stale))


def test_every_cited_repository_path_exists():
    assert missing() == []


def test_the_scan_reads_each_kind_of_citation():
    # an independent list: paths written by hand from a module docstring, a comment, a doc page and a string
    assert cited("see models/capture/shards.py `read_sample`, and docs/engines.md.") == [
        "models/capture/shards.py",
        "docs/engines.md",
    ]
    assert cited("vllm/model_executor/models/llama_eagle3.py and RUN_DIR/draft/final") == []
    assert cited("deploy/deepspeed/*.json, runs/<bench>/ and tests/engines/test_real_vllm.py") == [
        "tests/engines/test_real_vllm.py"
    ]
    seen = {cite for path in tracked() for _, text in prose(path) for cite in cited(text)}
    assert {"docs/engines.md", "models/capture/shards.py", "deploy/sglang-cpu/", "tests/conftest.py"} <= seen
