"""The Hugging Face architecture names (config.json's `architectures`) the converter knows, each mapped to
its family; the tests prove each family's output equal to llama.cpp's converter on the same folder."""

from __future__ import annotations

from corral.convert.families.bert import BertFamily
from corral.convert.families.cohere import Cohere2Family, CommandRFamily
from corral.convert.families.deepseek import DeepSeekFamily
from corral.convert.families.gemma import Gemma2Family, Gemma3Family, GemmaFamily
from corral.convert.families.gpt_oss import GptOssFamily
from corral.convert.families.llama import GraniteFamily, GraniteMoeFamily, LlamaFamily, MixtralFamily, SmolLM3Family
from corral.convert.families.olmo import Olmo2Family, OlmoeFamily
from corral.convert.families.phi import Phi2Family, Phi3Family
from corral.convert.families.qwen import Qwen2Family, Qwen2MoeFamily, Qwen3Family, Qwen3MoeFamily
from corral.convert.families.stablelm import StableLMFamily
from corral.convert.families.starcoder2 import Starcoder2Family
from corral.convert.family import TextFamily
from corral.convert.folder import ConvertError, HFFolder

FAMILIES: dict[str, type[TextFamily]] = {
    "LlamaForCausalLM": LlamaFamily,
    "MistralForCausalLM": LlamaFamily,
    "LlavaForConditionalGeneration": LlamaFamily,  # the text model; the vision side: corral.convert.projector
    "MixtralForCausalLM": MixtralFamily,
    "Qwen2MoeForCausalLM": Qwen2MoeFamily,
    "Qwen3MoeForCausalLM": Qwen3MoeFamily,
    "OlmoeForCausalLM": OlmoeFamily,
    "Olmo2ForCausalLM": Olmo2Family,
    "Olmo3ForCausalLM": Olmo2Family,
    "SmolLM3ForCausalLM": SmolLM3Family,
    "GraniteForCausalLM": GraniteFamily,
    "GraniteMoeForCausalLM": GraniteMoeFamily,
    "GraniteMoeSharedForCausalLM": GraniteMoeFamily,
    "Starcoder2ForCausalLM": Starcoder2Family,
    "CohereForCausalLM": CommandRFamily,
    "Cohere2ForCausalLM": Cohere2Family,
    "GemmaForCausalLM": GemmaFamily,
    "Gemma2ForCausalLM": Gemma2Family,
    "StableLmForCausalLM": StableLMFamily,
    "StableLMEpochForCausalLM": StableLMFamily,
    "PhiForCausalLM": Phi2Family,
    "GptOssForCausalLM": GptOssFamily,
    "DeepseekV2ForCausalLM": DeepSeekFamily,
    "DeepseekV3ForCausalLM": DeepSeekFamily,
    "Phi3ForCausalLM": Phi3Family,
    "Qwen2ForCausalLM": Qwen2Family,
    "Qwen2Model": Qwen2Family,
    "Qwen3ForCausalLM": Qwen3Family,
    "Qwen3Model": Qwen3Family,
    "Gemma3ForCausalLM": Gemma3Family,
    "Gemma3ForConditionalGeneration": Gemma3Family,  # the text model; the vision side: corral.convert.projector
    "BertModel": BertFamily,
    "BertForMaskedLM": BertFamily,
}


def family_of(folder: HFFolder) -> TextFamily:
    """The family of config.json's `architectures`; a ConvertError listing the known ones otherwise."""
    names = folder.config.get("architectures") or []
    for name in names:
        if name in FAMILIES:
            return FAMILIES[name](folder)
    given = ", ".join(map(str, names)) or "none"
    raise ConvertError(
        f"{folder.path}: cannot convert architecture {given} (config.json's `architectures`); "
        f"corral converts {', '.join(sorted(FAMILIES))}"
    )
