"""Several choices in one request: split into router requests, merged back (pure parts)."""

from __future__ import annotations

import pytest

from pyllmrouter.server.errors import ApiError
from pyllmrouter.server.fanout import merge, split


def test_prompts_times_n_in_choice_order_with_distinct_seeds():
    subs = split("complete", {"prompt": ["a", [7, 8]], "seed": 5, "max_tokens": 2}, 2)
    assert [(s["prompt"], s["seed"]) for s in subs] == [("a", 5), ("a", 6), ([7, 8], 5), ([7, 8], 6)]
    assert all(s["max_tokens"] == 2 for s in subs)
    assert split("complete", {"prompt": [7, 8, 9]}, 1) == [{"prompt": [7, 8, 9]}]  # token ids: one prompt
    assert split("chat", {"messages": [], "temperature": 1.0}, 3) == [{"messages": [], "temperature": 1.0}] * 3
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ApiError, match="'n' must be a positive integer"):
            split("chat", {"messages": []}, bad)
    with pytest.raises(ApiError, match="exceed the limit"):
        split("complete", {"prompt": ["a"] * 9}, 8)


def test_merge_renumbers_choices_and_sums_usage():
    one = {"id": "x", "choices": [{"index": 0, "text": "a"}],
           "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    two = {"id": "y", "choices": [{"index": 0, "text": "b"}],
           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    out = merge([one, two])
    assert out["id"] == "x" and [(c["index"], c["text"]) for c in out["choices"]] == [(0, "a"), (1, "b")]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert one["choices"][0]["index"] == 0 and two["choices"][0]["index"] == 0  # inputs untouched
