"""Chat templates render the model's own format, or a built-in one, and never start with BOS text."""

from __future__ import annotations

import pytest

from corral.gguf import GGUFFile
from corral.plugins.architectures.gemma3 import Gemma3Model
from corral.template import CHATML, ChatTemplate, TemplateError

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


def read_metadata(path) -> dict:
    gguf = GGUFFile.open(path)
    try:
        return gguf.metadata
    finally:
        gguf.close()


@pytest.fixture(scope="module")
def smollm2_metadata(smollm2_path):
    return read_metadata(smollm2_path)


@pytest.fixture(scope="module")
def gemma3_metadata(gemma3_path):
    return read_metadata(gemma3_path)


def test_smollm2_template_adds_its_default_system_turn(smollm2_metadata):
    template = ChatTemplate.from_metadata(smollm2_metadata)
    assert template.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_template_renders_a_conversation(smollm2_metadata):
    template = ChatTemplate.from_metadata(smollm2_metadata)
    assert template.render(CONVERSATION, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )


def test_gemma_builtin_folds_system_into_first_user_turn(gemma3_metadata):
    template = ChatTemplate.from_metadata(gemma3_metadata, Gemma3Model.default_chat_template())
    assert template.render(CONVERSATION) == (
        "<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_gemma_builtin_renders_text_parts_and_trims_content(gemma3_metadata):
    template = ChatTemplate.from_metadata(gemma3_metadata, Gemma3Model.default_chat_template())
    content = [{"type": "text", "text": " look: "}, {"type": "image"}, {"type": "text", "text": "this "}]
    assert template.render([{"role": "user", "content": content}], add_generation_prompt=False) == (
        "<start_of_turn>user\nlook: this<end_of_turn>\n"
    )


def test_model_without_template_or_known_family_gets_chatml():
    template = ChatTemplate.from_metadata({})
    assert template.source == CHATML
    assert template.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def bos_metadata(add_bos: bool) -> dict:
    return {
        "tokenizer.chat_template": "{{ bos_token }}[{{ messages[0]['content'] }}]",
        "tokenizer.ggml.tokens": ["<s>", "</s>"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": add_bos,
    }


@pytest.mark.parametrize(("add_bos", "expected"), [(True, "[x]"), (False, "<s>[x]")])
def test_leading_bos_text_is_cut_only_when_the_tokenizer_adds_bos(add_bos, expected):
    template = ChatTemplate.from_metadata(bos_metadata(add_bos))
    assert template.render([{"role": "user", "content": "x"}]) == expected


def test_raise_exception_in_a_template_is_a_template_error():
    with pytest.raises(TemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render([])


def test_template_that_does_not_compile_is_a_template_error():
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for message in messages %}")


def test_template_cannot_mutate_its_inputs():
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(TemplateError, match="unsafe"):
        ChatTemplate("{{ messages.append(1) }}").render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_type_errors_while_rendering_are_template_errors():
    with pytest.raises(TemplateError, match="TypeError"):
        ChatTemplate("{{ 'a' + messages[0]['content'] }}").render([{"role": "user", "content": ["part"]}])


def test_tojson_does_not_html_escape_and_tools_reach_the_template():
    template = ChatTemplate("{{ tools | tojson }}")
    assert template.render([], tools=[{"name": "<é&>"}]) == '[{"name": "<é&>"}]'


def test_generation_blocks_and_extra_variables_render():
    template = ChatTemplate(
        "{% generation %}{{ greeting }}{% endgeneration %}{% for x in [1, 2] %}{% break %}{% endfor %}"
    )
    assert template.render([], greeting="hey") == "hey"


def test_trim_and_lstrip_blocks_match_hugging_face():
    template = ChatTemplate(
        "{% for m in messages %}\n    {% if true %}\n{{ m['content'] }}\n    {% endif %}\n{% endfor %}"
    )
    assert template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"
