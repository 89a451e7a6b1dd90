"""Model output -> (reasoning, content): the parser for thinking between `<think>` and `</think>`
(Qwen3, Qwen3-MoE, QwQ, DeepSeek-R1 distills), whole and streamed.

A reasoning model's thinking goes to the response's `reasoning_content` (the non-streamed
message field and the streamed delta field, as vLLM's reasoning parsers return it); the rest is
`content`, which the tool-call parser then reads. Where the thinking starts is decided by the
prompt, not guessed from the output:
- the rendered prompt ends inside an open `<think>` (Qwen3-Thinking-2507's template writes
  `<think>\\n` after the generation prompt): the output starts as reasoning, up to `</think>`;
- otherwise output that starts (after whitespace) with `<think>` is reasoning up to `</think>`,
  and output that does not is all content (Qwen3 with `enable_thinking: false`: its template
  writes an empty `<think>\\n\\n</think>\\n\\n` into the prompt, the model answers directly).
Thinking that never closes (max_tokens ran out) stays reasoning. The text is kept as the model
wrote it (the newlines around the tags included), as vLLM does.

Streamed, text that may still become a tag is held back until the next piece settles it, so a
tag split over tokens never leaks. Pure: text in, text out; it must not know about HTTP.
"""
from __future__ import annotations

from gateway.toolparse import holdback

START, END = "<think>", "</think>"


def opened_in(prompt: str) -> bool:
    """Whether the prompt ends inside an open `<think>` block (its last `<think>` is not closed)."""
    return prompt.rfind(START) > prompt.rfind(END)


class ThinkTags:
    """One choice's output, fed in pieces: `feed(text) -> (reasoning, content)`."""

    name = "qwen3"

    def __init__(self, in_reasoning: bool = False) -> None:
        self._state = "reasoning" if in_reasoning else "start"  # "start" | "reasoning" | "content"
        self._held = ""

    def feed(self, new: str) -> tuple[str, str]:
        text, self._held = self._held + new, ""
        reasoning = ""
        if self._state == "start":
            head = text.lstrip()
            if head.startswith(START):
                self._state, text = "reasoning", head[len(START):]
            elif START.startswith(head):  # only whitespace, or a tag cut short: wait
                self._held = text
                return "", ""
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = text.find(END)
            if end < 0:
                keep = holdback(text, (END,))
                self._held = text[len(text) - keep:]
                return text[: len(text) - keep], ""
            reasoning, text, self._state = text[:end], text[end + len(END):], "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What is still held once the output has ended."""
        held, self._held = self._held, ""
        return (held, "") if self._state == "reasoning" else ("", held)


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str | None, str | None]:
    """A whole output -> (reasoning or None, content or None)."""
    p = ThinkTags(in_reasoning)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2) or None, (c1 + c2) or None
