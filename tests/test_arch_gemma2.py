"""Gemma 2's chat template: the file's own, or Gemma's turns for a file that carries none."""

from __future__ import annotations

import pytest
from reference_models import SPECS_BY_NAME

pytestmark = pytest.mark.peers  # every test here uses llama.cpp's sources: the fast subset does not even import this module

GEMMA2 = SPECS_BY_NAME["gemma2"]


@pytest.mark.parametrize("spec", [GEMMA2], ids=[f"ref-{GEMMA2.name}"])
def test_a_gemma2_file_without_a_template_chats_in_gemma_turns(spec, converted_references, load_once):
    loaded = load_once(converted_references.gguf(spec))
    assert "tokenizer.chat_template" not in loaded.gguf.metadata
    text = loaded.template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
