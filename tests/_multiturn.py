"""A multi-turn workload for prefix caching (shared by the vLLM test and the prefix-cache benchmark).

Conversations of the bundled model's token ids (prompts.json / greedy.json prompts, repeated): each turn is
the conversation so far plus new text, 64 greedy tokens per turn. With vLLM's 256-token blocks for this
model, the workload is made so that

- every prompt ends inside a block, and every conversation's second turn decodes across the 512-token
  boundary at a different offset (so with MTP the boundary falls inside a draft window at different
  positions); vLLM drops the last matched block of a hit with MTP (its draft needs the hidden state of the
  last hit token), so the fourth turn (prompts past 768 tokens) resumes from that block, filled during
  decoding, and the third from the 256-token block filled by a prompt chunk;
- the four conversations share a 300-token system prompt in every batch, and conversation 4 repeats
  conversation 0's third prompt in the fourth turn.

``offset`` starts the workload's texts that many tokens into the pool: the same lengths and boundaries
over other text (the prefix-cache benchmark's larger bf16 sample runs several offsets).
"""

from __future__ import annotations

import json
from typing import Any

from atom_core import testing

MAX_TOKENS = 64
SYSTEM_LEN = 300
TURN2_LENGTHS = (455, 470, 490, 505)  # + 64 decoded tokens: the 512 boundary falls at output 57, 42, 22, 7
TURN3_NEW = 230
TURN4_NEW = 40


def token_pool() -> list[int]:
    """The bundled model's prompt ids (prompts.json, then greedy.json), four times over. Read here rather
    than through ``_vllm`` (which needs pytest), so that scripts outside the test session can build the
    workload."""
    prompts = json.loads(testing.reference_file("prompts.json").read_text())["prompts"]
    cases = json.loads(testing.reference_file("greedy.json").read_text())["cases"]
    ids = [t for p in prompts for t in p["prompt_token_ids"]] + [t for c in cases for t in c["prompt_ids"]]
    return ids * 4


def conversation_turns(offset: int = 0) -> list[list[list[int]]]:
    """``turns[t][j]``: the new ids of conversation ``j`` in turn ``t`` (empty: not in that turn), the texts
    taken from the pool from position ``offset`` on."""
    pool = token_pool()[offset:]
    cursor = SYSTEM_LEN

    def take(n: int) -> list[int]:
        nonlocal cursor
        out = pool[cursor : cursor + n]
        cursor += n
        if len(out) != n:
            raise ValueError("the token pool of the workload is too short")
        return out

    system = pool[:SYSTEM_LEN]
    first = [system + take(20 + 10 * j) for j in range(4)]
    lens = [len(p) + MAX_TOKENS for p in first]
    turn2 = [take(t - n) for t, n in zip(TURN2_LENGTHS, lens)]
    turn3 = [take(TURN3_NEW) for _ in range(4)]
    turn4 = [take(TURN4_NEW) for _ in range(4)]
    return [first + [[]], turn2 + [[]], turn3 + [[]], turn4 + [None]]


def conversation_job(name: str = "conversation", offset: int = 0) -> dict[str, Any]:
    """The workload as a ``_harness`` conversation job; conversation 4's only turn (the fourth) repeats
    conversation 0's third prompt, which the harness builds from that conversation's history
    (``{"repeat": 0, "turn": 2}``)."""
    turns = conversation_turns(offset)
    turns[3][4] = {"repeat": 0, "turn": 2}
    return {"name": name, "turns": turns, "max_tokens": MAX_TOKENS}
