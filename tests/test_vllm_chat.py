"""``/v1/chat/completions`` on the bundled model: vLLM's OpenAI server with the ATOM plugin and MTP.

The bundled tokenizer config carries the Qwen3 chat template (``<|im_start|>role\\n...<|im_end|>\\n`` turns,
``<|im_start|>assistant\\n`` as the generation prompt, the Qwen3 tool-call format). The bundled vocabulary
(4096 byte-level BPE tokens, ``<|endoftext|>`` its only special token) has no ``<|im_start|>`` /
``<|im_end|>`` tokens, so the markers are tokenized as ordinary text (7 tokens each); the model was trained
on Python sources, not on chats, so what it answers is Python-like text, not a dialogue. The server test
starts one server (float32, k = 2) and checks that a chat request is a 200 whose prompt is the template's
rendering of the messages and whose answer is the float32 greedy continuation of that prompt.
"""

from __future__ import annotations

import pytest
from _reference import consistency
from _vllm import model_dir, plugin_server, requires_vllm

K = 2
MAX_GAP = 0.01  # float32 vs transformers' float32: only near-ties may differ
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sort a list of numbers."},
    {"role": "assistant", "content": "sorted(xs)"},
    {"role": "user", "content": "Now in reverse order."},
]
RENDERED = (
    "<|im_start|>system\nYou write Python.<|im_end|>\n"
    "<|im_start|>user\nSort a list of numbers.<|im_end|>\n"
    "<|im_start|>assistant\nsorted(xs)<|im_end|>\n"
    "<|im_start|>user\nNow in reverse order.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _tokenizer():
    from atom_core import testing

    transformers = testing.import_oracle("transformers", "transformers (renders the chat template)")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir()))


def test_chat_template_renders_qwen3_turns() -> None:
    tok = _tokenizer()
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == RENDERED
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with_tools = [
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3"},
    ]  # fmt: skip
    text = tok.apply_chat_template(with_tools, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "add"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        in text
    )
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_markers_are_plain_text_in_the_bundled_vocabulary() -> None:
    """No token ids beyond the model's 4096-entry embedding: the markers are ordinary byte-level BPE text."""
    tok = _tokenizer()
    assert len(tok) == 4096 and tok.convert_tokens_to_ids("<|im_start|>") in (None, tok.unk_token_id)
    ids = tok.encode("<|im_start|>", add_special_tokens=False)
    assert len(ids) > 1 and max(ids) < 4096 and tok.decode(ids) == "<|im_start|>"


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    args = [
        "--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
        "--max-num-seqs", "8", "--speculative-config", f'{{"method": "mtp", "num_speculative_tokens": {K}}}',
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("chat_server") / "server.log"
    with plugin_server(args, log, timeout=600) as srv:
        yield srv


@requires_vllm
@pytest.mark.slow
def test_chat_completion_is_served_with_mtp(chat_server) -> None:
    import httpx

    base = chat_server.base
    body = {
        "model": "tiny", "messages": MESSAGES, "max_tokens": 48, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, f"{r.status_code}: {r.text[:2000]}"
    out = r.json()
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert out["usage"]["completion_tokens"] == 48
    tok = _tokenizer()
    want_prompt = tok.encode(RENDERED, add_special_tokens=False)
    assert out["prompt_token_ids"] == want_prompt, "the server did not apply the bundled chat template"
    tokens = choice["token_ids"]
    assert len(tokens) == 48 and tok.decode(tokens) == choice["message"]["content"]
    c = consistency(str(model_dir()), [want_prompt], [tokens])
    print(f"\nchat completion: {choice['message']['content']!r}; {c}")
    assert c.max_gap <= MAX_GAP, f"a chat token is far from the float32 argmax: {c}"
    # the plugin served it, with MTP drafts accepted
    assert "ATOM vLLM plugin active" in chat_server.log_text()
    accepted = chat_server.metric("vllm:spec_decode_num_accepted_tokens_total")
    assert accepted > 0, "no MTP draft token was accepted"
