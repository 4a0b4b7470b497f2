"""The tree-of-thought example runs end to end (tiny-llama here; `make demo` runs SmolLM2)."""

from __future__ import annotations

from dask_kvstate.bench import tree_of_thought


def test_tree_of_thought_table(client):
    m = tree_of_thought.run(client, branches=4, lines=10, new_tokens=8)
    assert tree_of_thought.identical(m)
    assert m["kvstate"]["prefill_tokens"] < m["replay"]["prefill_tokens"]
    assert m["compiler"]["prefill_tokens"] < m["replay"]["prefill_tokens"]
    assert all(g.reused_tokens > 0 for g in m["compiler"]["results"])
    text = tree_of_thought.table(m)
    assert "token-identical outputs: all" in text and text.count("| yes") == 4
