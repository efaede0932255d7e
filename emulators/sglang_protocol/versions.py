"""Which SGLang a server follows: `SGLangVersion`, "0.5" (SGLang 0.5.23, the default) or "0.4" (0.4.x).

Every rule in this package follows SGLang 0.5.23 (read in its wheel; files are named relative to the
``sglang`` package). A server started with ``sglang_version="0.4"`` follows SGLang 0.4.x (read in
0.4.10.post2) where the two differ -- `SGLangVersion` lists each difference with its source.
"""

from __future__ import annotations

import dataclasses

SGLANG_VERSIONS = ("0.5", "0.4")


@dataclasses.dataclass(frozen=True)
class SGLangVersion:
    """The SGLang a server follows: "0.5" (0.5.23, the default) or "0.4" (0.4.x, read in 0.4.10.post2).

    Only the differences verified in both sources; everything else is 0.5.23's in both.
    """

    name: str = "0.5"

    def __post_init__(self):
        if self.name not in SGLANG_VERSIONS:
            raise ValueError(f"sglang_version must be one of {SGLANG_VERSIONS}, got {self.name!r}")

    @classmethod
    def of(cls, value: str | SGLangVersion) -> SGLangVersion:
        return value if isinstance(value, SGLangVersion) else cls(str(value))

    @property
    def is_04(self) -> bool:
        return self.name == "0.4"

    @property
    def stop_before_length(self) -> bool:
        """0.5.23 schedule_batch.py `update_finish_state` checks stop tokens first; 0.4.10 `check_finished` length."""
        return not self.is_04

    @property
    def refuses_duplicate_rids(self) -> bool:
        """0.5.23 `_init_req_state` refuses a held rid; 0.4.10 `_send_one_request` just overwrites rid_to_state[rid]."""
        return not self.is_04

    @property
    def contract_gate(self) -> bool:
        """0.5.23 http_server.py `generate_request` runs `generate_contract_error`; 0.4.10 has no such gate."""
        return not self.is_04

    @property
    def reserves_draft_tokens(self) -> bool:
        """0.5.23 `_validate_one_request` adds compute_num_reserved_tokens(); 0.4.10 adds nothing."""
        return not self.is_04

    @property
    def total_tokens_refused_at_context(self) -> bool:
        """0.4.10 refuses prompt + max_new_tokens >= context; 0.5.23 only > context."""
        return self.is_04

    @property
    def reads_eagle31_keys(self) -> bool:
        """0.5.23 srt/models/llama_eagle3.py builds `fc_norm` (config fc_norm or use_aux_norm) and, with
        `norm_output`, hands the next draft step the post-norm state; 0.4.10's reads neither key, and its
        `load_weights` drops the fc_norm.* tensors unread (no such parameter): an EAGLE-3.1 draft is served as
        EAGLE-3."""
        return not self.is_04

    @property
    def has_admin_api_key(self) -> bool:
        """--admin-api-key exists from 0.5 (utils/auth.py); 0.4.10 only --api-key (utils.py add_api_key_middleware)."""
        return not self.is_04


V05 = SGLangVersion("0.5")
