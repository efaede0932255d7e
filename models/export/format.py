"""The names an exported draft is written with, shared by every module that writes, checks or converts one.

Our export (models/export/eagle3.py) is SGLang's and vLLM's `LlamaForCausalLMEagle3` directory (an MLA draft's:
`Eagle3DeepseekV2ForCausalLM`); the speculators
format (models/export/speculators.py) holds the same tensors under other names. Torch-free.
"""

from __future__ import annotations

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's class name; vLLM's registry maps it to Eagle3LlamaForCausalLM
# The MLA draft (draft_arch mla): SGLang 0.5.23's class in srt/models/kimi_k25_eagle3.py, and one of the two names vLLM
# 0.32's registry maps to deepseek_eagle3.py's Eagle3DeepseekV2ForCausalLM; model_type deepseek_v2 (vLLM rewrites a
# deepseek_v3 config into its MTP draft)
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MLA_MODEL_TYPE = "deepseek_v2"
VLLM_AUX_KEY = "eagle_aux_hidden_state_layer_ids"  # top level for vLLM, inside eagle_config for SGLang
EMBED = "embed_tokens.weight"
INPUT_NORM = "input_norm.weight"  # Eagle3Config.norm_before_fc's RMSNorm over all aux features, as both engines name it


def vllm_aux_ids(aux_layers: list[int]) -> list[int]:
    """vLLM's ids for our aux layers: capture index = the state entering layer a + 1 (models/export/sglang.py)."""
    return [a + 1 for a in aux_layers]
