"""The SGLang command-line flags both servers take (`add_server_flags`): SGLang 0.5.23's names.

``--api-key`` and ``--admin-api-key`` (auth.py), ``--sglang-version`` (versions.py) and
``--disconnect-poll-s`` (SGLang's ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT``, disconnect.py).
"""

from __future__ import annotations

import argparse

from emulators.sglang_protocol.disconnect import DISCONNECT_POLL_S
from emulators.sglang_protocol.versions import SGLANG_VERSIONS


def add_server_flags(
    ap: argparse.ArgumentParser, *, sglang_version: str = "0.5", disconnect_poll_s: float = DISCONNECT_POLL_S
) -> None:
    """The SGLang flags both servers' CLIs take: --api-key, --admin-api-key, --sglang-version, --disconnect-poll-s.

    `sglang_version` and `disconnect_poll_s` are the defaults of the last two.
    """
    ap.add_argument("--api-key", default=None, help="SGLang's --api-key: required on every endpoint but /health*")
    ap.add_argument(
        "--admin-api-key",
        default=None,
        help="SGLang's --admin-api-key: the only key /abort_request and /flush_cache take",
    )
    ap.add_argument(
        "--sglang-version",
        default=sglang_version,
        choices=list(SGLANG_VERSIONS),
        help="follow SGLang 0.5.23 (default) or 0.4.x where they differ",
    )
    ap.add_argument(
        "--disconnect-poll-s",
        type=float,
        default=disconnect_poll_s,
        help="how often a disconnected client is noticed (SGLang's SGLANG_REQUEST_STATE_WAIT_TIMEOUT)",
    )
