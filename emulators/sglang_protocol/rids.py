"""Request ids: the rids a server holds (`HeldRids`) and which requests an /abort_request reaches (`abort_matcher`).

- A /generate whose rid (or one rid of a batch, or a rid repeated inside the batch) the
  server still holds is refused, 400 ``Duplicate request ID detected: <rid>``
  (SGLang 0.5.23 tokenizer_manager.py ``_init_req_state``, after the body is normalised and before any prompt
  is checked). A rid is held from then until its request's final output is processed; a prompt
  that fails its checks frees its batch's rids (``_release_req_states_on_failure``).
- ``POST /abort_request`` ``{"rid": ...}`` or ``{"abort_all": true}`` -- answered 200 with no body.
  tokenizer_manager.py ``abort_request`` ignores an empty rid without abort_all and a rid it does
  not hold exactly; srt/managers/scheduler.py ``abort_request`` then aborts every waiting and running
  request whose rid STARTS WITH the given rid (`abort_matcher`). How the aborted requests are
  answered: results.py.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Sequence

from emulators.sglang_protocol.errors import BadRequest
from emulators.sglang_protocol.versions import V05, SGLangVersion

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # srt/constants.py


class HeldRids:
    """The rids a server holds: SGLang's TokenizerManager.rid_to_state (event-loop only).

    A 0.5 server refuses a held rid (`claim`); a 0.4 one admits it again (counted, so an abort of
    that rid still finds it held).
    """

    def __init__(self, version: SGLangVersion = V05):
        self.version = version
        self._held: Counter[str] = Counter()

    def claim(self, rids: Sequence[str]) -> None:
        """0.5.23: BadRequest for a rid repeated inside the batch (managers/io_struct.py `GenerateReqInput`'s
        batch check, first, as the real server answered) or a held one (tokenizer_manager.py `_init_req_state`);
        else hold all."""
        if self.version.refuses_duplicate_rids:
            repeated = [rid for rid, n in Counter(rids).items() if n > 1]
            if repeated:
                raise BadRequest(f"Duplicate request IDs detected within the request: {repeated}")
            for rid in rids:
                if rid in self._held:
                    raise BadRequest(f"Duplicate request ID detected: {rid}")
        self._held.update(rids)

    def release(self, rid: str) -> None:
        """The request's final output was processed (or it never got to the scheduler)."""
        if self._held[rid] <= 1:
            self._held.pop(rid, None)
        else:
            self._held[rid] -= 1

    def __contains__(self, rid: str) -> bool:
        return rid in self._held

    def __len__(self) -> int:
        return sum(self._held.values())


def abort_matcher(rid: str, abort_all: bool, held: HeldRids | Callable[[str], bool]) -> Callable[[str], bool] | None:
    """Which requests an /abort_request reaches; None: it is ignored.

    tokenizer_manager.py `abort_request` (0.5.23; 0.4.10 the same in effect): an empty rid without
    abort_all is ignored, and so is a rid the server does not hold exactly (one tokenizer worker);
    scheduler.py `abort_request` then aborts every waiting and running request whose rid starts
    with the given one (abort_all: every request).
    """
    if abort_all:
        return lambda _rid: True
    if not rid or not (rid in held if isinstance(held, HeldRids) else held(rid)):
        return None
    return lambda other: other.startswith(rid)


def health_check_rid() -> str:
    """http_server.py `health_generate`'s probe rid (0.5.23: the prefix and a uuid)."""
    return f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
