"""What `LLM.chat` takes (issue #34): a conversation (a list of {"role", "content"}
messages) or a list of conversations; anything else is a ValueError that says so, not one
conversation per character of a string or a KeyError. Message content may be OpenAI's
content parts, as the server takes them (one function flattens them for both)."""
from __future__ import annotations

import pytest

from helpers.engine import assert_all_blocks_free
from llmlab import SamplingParams
from llmlab.model.tokenizer import template_message
from llmlab.server.protocol import ChatMessage

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
TAKES = r"chat takes a conversation \(a list of \{\"role\", \"content\"\} messages\) or a list of conversations"


@pytest.mark.parametrize("conversations", [
    "hello",                                        # was five conversations, one per character
    {"role": "user", "content": "hello"},           # was KeyError: 0
    ["hello", "there"],                             # was two raw prompts, no chat template
    [[{"role": "user", "content": "hi"}], "hello"],
    [[]],
    42,
], ids=["str", "dict", "list of str", "mixed", "empty conversation", "int"])
def test_what_is_no_conversation_is_a_value_error_saying_what_chat_takes(llm, conversations):
    with pytest.raises(ValueError, match=TAKES):
        llm.chat(conversations, ONE_TOKEN)
    assert_all_blocks_free(llm.engine)


def test_content_parts_are_the_text_they_hold(llm):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    text = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    by_parts, by_text = llm.chat([parts, text], ONE_TOKEN)
    assert by_parts.prompt_token_ids == by_text.prompt_token_ids == llm.tokenizer.apply_chat_template(text)


@pytest.mark.parametrize("content", [
    [{"type": "image_url", "image_url": {"url": "http://x"}}],
    [{"type": "text"}],
    [{"type": "text", "text": 5}],
    ["just a string in a list"],
    5,
], ids=["image part", "no text", "text not str", "bare str part", "int"])
def test_a_content_llmlab_cannot_read_is_a_value_error(llm, content):
    with pytest.raises(ValueError, match=r"message content must be a string or a list of "
                                         r"\{\"type\": \"text\", \"text\": \.\.\.\} parts"):
        llm.chat([{"role": "user", "content": content}], ONE_TOKEN)
    assert_all_blocks_free(llm.engine)


def test_the_server_flattens_content_with_the_same_function():
    message = {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert ChatMessage.model_validate(message).as_template_message() == template_message(message) \
        == {"role": "system", "content": "ab"}
