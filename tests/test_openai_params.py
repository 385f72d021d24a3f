"""Request parameters are checked and normalized before anything is leased or loaded."""

from __future__ import annotations

import pytest

from pyllmrouter import BadRequest
from pyllmrouter.openai_params import check_tokens, normalize

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("method, kwargs, param, fragment", [
    ("complete", {"prompt": "x", "temperature": "hot"}, "temperature", "must be a number, not 'hot'"),
    ("complete", {"prompt": "x", "temperature": float("nan")}, "temperature", "must be a number"),
    ("complete", {"prompt": "x", "top_p": 1.5}, "top_p", "between 0 and 1"),
    ("complete", {"prompt": "x", "min_p": -0.1}, "min_p", "between 0 and 1"),
    ("complete", {"prompt": "x", "top_k": 2.5}, "top_k", "must be an integer, not 2.5"),
    ("complete", {"prompt": "x", "seed": "a"}, "seed", "must be an integer"),
    ("complete", {"prompt": "x", "max_tokens": True}, "max_tokens", "must be an integer"),
    ("complete", {"prompt": "x", "mirostat_mode": 3}, "mirostat_mode", "between 0 and 2"),
    ("complete", {"prompt": "x", "stop": 5}, "stop", "a string or a list of strings"),
    ("complete", {"prompt": "x", "stop": ["a", 1]}, "stop", "a string or a list of strings"),
    ("complete", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias", "'x' is not one"),
    ("complete", {"prompt": "x", "logit_bias": {"-3": 1}}, "logit_bias", "negative"),
    ("complete", {"prompt": "x", "logit_bias": {"3": "up"}}, "logit_bias", "must be a number"),
    ("complete", {"prompt": "x", "logit_bias": [1]}, "logit_bias", "map token ids"),
    ("complete", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format", "'json_schema'"),
    ("complete", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format", "json_schema.schema' must be an object"),
    ("complete", {"prompt": "x", "logprobs": -1}, "logprobs", "at least 0"),
    ("complete", {"prompt": "x", "echo": "yes"}, "echo", "boolean"),
    ("complete", {"prompt": 5}, "prompt", "a string or a list of token ids"),
    ("complete", {"prompt": [1, "a"]}, "prompt", "a string or a list of token ids"),
    ("complete", {"prompt": [1, -2]}, "prompt", "must not be negative"),
    ("complete", {"prompt": ["a", "b"]}, "prompt", "one prompt per request is supported; this one has 2"),
    ("complete", {"prompt": [[1], [2]]}, "prompt", "this one has 2"),
    ("complete", {}, "prompt", "a string or a list of token ids"),
    ("chat", {}, "messages", "non-empty list"),
    ("chat", {"messages": []}, "messages", "non-empty list"),
    ("chat", {"messages": "hi"}, "messages", "non-empty list"),
    ("chat", {"messages": ["hi"]}, "messages", "messages[0] must be an object"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages", "messages[0].role must be one of"),
    ("chat", {"messages": HI + [{"role": "user", "content": 3}]}, "messages", "messages[1].content must be"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "read text only, not 'image_url'"),
    ("chat", {"messages": HI, "logprobs": 2}, "logprobs", "true or false"),
    ("chat", {"messages": HI, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ("embed", {"input": 3}, "input", "a string or a non-empty list of strings"),
    ("embed", {"input": []}, "input", "non-empty"),
    ("embed", {"input": ["a", 1]}, "input", "list of strings"),
])
def test_a_bad_parameter_is_named(method, kwargs, param, fragment):
    with pytest.raises(BadRequest) as e:
        normalize(method, kwargs)
    assert e.value.param == param
    assert fragment in str(e.value)


@pytest.mark.parametrize("prompt, expected", [
    ("hello", "hello"),
    ("", ""),
    ([5, 9], [5, 9]),
    ([], ""),  # no tokens: the start-of-text token alone, as an empty string
    (["hello"], "hello"),
    ([[5, 9]], [5, 9]),
    ([[]], ""),
])
def test_one_prompt_in_any_openai_shape(prompt, expected):
    assert normalize("complete", {"prompt": prompt})["prompt"] == expected


def test_values_are_normalized_for_both_serving_paths():
    out = normalize("complete", {"prompt": "x", "stop": "\n", "logit_bias": {"7": -100, 8: 2}, "top_k": 40.0,
                                 "temperature": 0, "seed": None, "response_format": {"type": "text"}})
    assert out == {"prompt": "x", "stop": ["\n"], "logit_bias": {7: -100.0, 8: 2.0}, "top_k": 40,
                   "temperature": 0.0, "max_tokens": None}
    assert type(out["top_k"]) is int
    assert normalize("chat", {"messages": HI, "stop": ["", "END"]})["stop"] == ["END"]
    # completions without max_tokens run to the end of text, as llama-server's do (llama_cpp's default is 16)
    assert normalize("complete", {"prompt": "x", "max_tokens": 7})["max_tokens"] == 7
    assert "max_tokens" not in normalize("chat", {"messages": HI})


def test_json_schema_becomes_llama_cpps_json_object_with_that_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    assert normalize("chat", {"messages": HI, "response_format": fmt})["response_format"] == \
        {"type": "json_object", "schema": schema}
    plain = {"type": "json_object"}
    assert normalize("complete", {"prompt": "x", "response_format": plain})["response_format"] == plain


def test_text_parts_are_joined_and_the_callers_messages_untouched():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts},
                {"role": "assistant", "content": None, "tool_calls": []}]
    out = normalize("chat", {"messages": messages})["messages"]
    assert out == [messages[0], {"role": "user", "content": "one\ntwo"}, messages[2]]
    assert messages[1]["content"] is parts


def test_token_ids_are_checked_against_the_vocabulary():
    assert check_tokens([0, 5, 9], 10) == [0, 5, 9]
    with pytest.raises(BadRequest, match="token id 10 is not in the model's vocabulary of 10 tokens"):
        check_tokens([1, 10], 10)
