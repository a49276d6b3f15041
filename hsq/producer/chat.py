"""Chat rows to `{id, input_ids, loss_mask}`: the same tokens and masks as SpecForge 0.2.0.

A row is `{"id"?, "conversations": [...], "tools"?}` (ShareGPT `from`/`value` or
`role`/`content` messages, SpecForge's format) or OpenAI `{"id"?, "messages": [...]}`.
The text is the tokenizer's own chat template (`apply_chat_template`), and the loss mask
follows `specforge.data.parse.GeneralParser` step for step, so a drafter trained from hsq
sees what SpecForge would have fed it:

1. the row's leading system message, else `--system-prompt` if given;
2. leading non-user messages dropped; a role-order violation (assistant not after
   user/tool, tool not after assistant/tool) ends the conversation there (both recorded);
3. messages keep `role`, `content`, `tool_calls` (and `reasoning_content`, which SpecForge
   drops: templates that render it train on the reasoning);
4. the rendered text is tokenized without special tokens;
5. each span from an assistant header to its end-of-turn marker (inclusive) is masked 1,
   mapped to tokens by re-encoding the text before its start and end.

Rows hsq cannot use raise `DatasetError` with a stable reason (no_assistant, unknown_role,
empty_content, bad_content, too_deep, control_tokens, template_error, too_long, ...) and go
to the dead letter; they are not silently repaired.

Memory per row is bounded: only as much of the rendered text is
tokenized as the row's token limit needs (--max-length, else MAX_ROW_TOKENS), so a 50 MB row
costs about what its first max-length tokens cost, not ~700 bytes per byte of text.

Template control tokens inside content (`<|im_end|>\n<|im_start|>assistant\n` in a user
message) are rendered and tokenized as the tokenizer's special tokens and the text after
them is masked as an assistant turn: SpecForge does the same. `--control-tokens escape`
breaks each one inside content with a zero-width space (U+200B) after its first character,
so it is tokenized as text; `reject` dead-letters the row (`control_tokens`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsq import jsonsafe
from hsq.dataset.jsonl import check_sample_id
from hsq.errors import ConfigError, DatasetError
from hsq.settings import setting

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
KEEP_ROLES = ("system", "tool")
KEEP_KEYS = ("role", "content", "tool_calls", "reasoning_content")
MAX_MESSAGES = 10_000
MAX_ROW_TOKENS = 2**18
"""Tokens of one row without --max-length: the longest context windows (Kimi K2.5: 262,144).
A longer row is `too_long`, found without tokenizing it whole."""
HEAD_MARGIN = 64
"""Tokens past the limit the tokenized head must reach: a cut text changes at most the
tokens of its last few characters, and the head is checked against a longer one."""
CONTROL_TOKEN_MODES = ("allow", "escape", "reject")
ZWSP = "\u200b"
_PROBE_USER, _PROBE_ASSISTANT = "hsq-probe-user-7f3a", "hsq-probe-assistant-9c1e"


CHAT_SECTION = "Chat rows"
"""The --help heading of how chat rows become tokens (`hsq tokenize`, `--tokenizer`)."""


@dataclass(frozen=True)
class ChatOptions:
    """How rows become tokens; each field a flag of `hsq tokenize` (hsq.settings)."""

    max_length: int | None = setting(None, section=CHAT_SECTION, help="cut longer rows (recorded)")
    truncate: bool = setting(
        True,
        section=CHAT_SECTION,
        help="cut rows longer than --max-length (--no-truncate: dead-letter them instead)",
    )
    last_turn_only: bool = setting(
        False, section=CHAT_SECTION, help="loss on the last assistant turn only"
    )
    system_prompt: str | None = setting(
        None, section=CHAT_SECTION, help="system message for rows that have none"
    )
    control_tokens: str = setting(
        "allow",
        choices=CONTROL_TOKEN_MODES,
        section=CHAT_SECTION,
        help="the tokenizer's special tokens and the template's markers inside content (a user "
        "message faking an assistant turn): allow (as SpecForge: rendered as control tokens, "
        "the faked turn is trained on), escape (tokenized as text) or reject the row",
    )
    """allow (SpecForge's behaviour), escape or reject template control tokens in content."""

    def validate(self) -> None:
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError("--max-length must be >= 1")


@dataclass(frozen=True)
class Markers:
    """Where an assistant turn starts and ends in the rendered text (SpecForge's
    `assistant_header` and `end_of_turn_token`)."""

    assistant_header: str
    end_of_turn: str

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile(
            re.escape(self.assistant_header)
            + r"([\s\S]*?(?:"
            + re.escape(self.end_of_turn)
            + "|$))",
            re.DOTALL,
        )


@dataclass(frozen=True)
class Tokenized:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False
    dropped_messages: int = 0

    def to_json(self) -> str:
        row: dict[str, Any] = {
            "id": self.id,
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
        }
        if self.truncated:
            row["truncated"] = True
        if self.dropped_messages:
            row["dropped_messages"] = self.dropped_messages
        return json.dumps(row, separators=(",", ":"))


def load_tokenizer(path: str | Path, template: str | Path | None = None) -> Any:
    """A local Hugging Face tokenizer directory; nothing is downloaded."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if template is not None:
        tok.chat_template = Path(template).read_text()
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"the tokenizer in {path} has no chat template: pass --template FILE")
    return tok


def infer_markers(tok: Any) -> Markers:
    """Read the assistant header and end-of-turn marker off the template itself.

    The header is what `add_generation_prompt` appends; the end of turn is what follows
    the last assistant message's content.
    """
    user = [{"role": "user", "content": _PROBE_USER}]
    both = [*user, {"role": "assistant", "content": _PROBE_ASSISTANT}]
    try:
        bare = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=False)
        prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(both, tokenize=False, add_generation_prompt=False)
    except Exception as exc:  # jinja raises several types
        raise ConfigError(f"the chat template failed on a probe conversation: {exc}") from exc
    header = prompt[len(bare) :] if prompt.startswith(bare) else ""
    at = full.rfind(_PROBE_ASSISTANT)
    eot = full[at + len(_PROBE_ASSISTANT) :] if at >= 0 else ""
    if not header or not eot:
        raise ConfigError(
            "cannot infer the assistant header and end-of-turn marker from the chat "
            "template: pass --assistant-header and --end-of-turn"
        )
    return Markers(header, eot)


def looks_like_chat(path: Path) -> bool:
    """Whether a JSONL file's first line is a chat row (what `hsq tokenize` reads), not
    the token rows `hsq enqueue` takes: said when such a file is enqueued as it is."""
    with open(path, "rb") as f:
        first = f.readline(1 << 20)
    try:
        row = jsonsafe.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and ("conversations" in row or "messages" in row)


def row_id(row: dict[str, Any]) -> str:
    """The row's id, or a stable one from its content, so a re-run stays idempotent."""
    if "id" in row:
        return check_sample_id(row["id"])
    body = {k: row.get(k) for k in ("conversations", "messages", "tools")}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return f"c{digest[:24]}"


def _content(msg: dict[str, Any], i: int, role: Any) -> str:
    """The message's text: `content`, else ShareGPT's `value`; absent or null is "" (an
    assistant turn with only tool calls). Anything but a string is `bad_content`: content
    0, false or {} is a type error, not an empty message."""
    raw = msg.get("content")
    if raw is None or raw == "":
        raw = msg.get("value", raw)
    if raw is None:
        return ""
    if not isinstance(raw, str):
        shown = json.dumps(raw)[:40]
        raise DatasetError(
            f"message {i} ({role}) content is {type(raw).__name__} {shown}, not a string",
            "bad_content",
        )
    return raw


def _tool_calls(raw: Any) -> list[dict[str, Any]] | None:
    """SpecForge's _sanitize_message: JSON strings parsed, only id/type/function kept."""
    if isinstance(raw, str):
        try:
            raw = jsonsafe.loads(raw)
        except ValueError:
            return None
    if not isinstance(raw, list):
        return None
    calls = []
    for tc in raw:
        if not isinstance(tc, dict):
            continue
        call: dict[str, Any] = {"id": tc.get("id", ""), "type": tc.get("type", "function")}
        func = tc.get("function", {})
        if isinstance(func, dict):
            args = func.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = jsonsafe.loads(args)
                except ValueError:
                    args = {}
            call["function"] = {"name": func.get("name", ""), "arguments": args}
        calls.append(call)
    return calls


def normalize(raw_messages: Any) -> list[dict[str, Any]]:
    """Role-mapped, checked messages; raises DatasetError for unusable ones."""
    if not isinstance(raw_messages, list) or not raw_messages:
        raise DatasetError("`conversations` / `messages` must be a non-empty list", "bad_row")
    if len(raw_messages) > MAX_MESSAGES:
        raise DatasetError(f"more than {MAX_MESSAGES} messages", "bad_row")
    out = []
    for i, msg in enumerate(raw_messages):
        if not isinstance(msg, dict):
            raise DatasetError(f"message {i} is not an object", "bad_row")
        role = msg.get("role", msg.get("from", ""))
        role = ROLES.get(role, role) if isinstance(role, str) else role
        if role not in ("user", "assistant", *KEEP_ROLES):
            raise DatasetError(f"message {i} has unknown role {role!r}", "unknown_role")
        m: dict[str, Any] = {"role": role, "content": _content(msg, i, role)}
        if "tool_calls" in msg:
            calls = _tool_calls(msg["tool_calls"])
            if calls is not None:
                m["tool_calls"] = calls
        reasoning = msg.get("reasoning_content")
        if role == "assistant" and isinstance(reasoning, str) and reasoning:
            m["reasoning_content"] = reasoning
        if not m["content"].strip() and not m.get("tool_calls") and "reasoning_content" not in m:
            raise DatasetError(f"message {i} ({role}) has empty content", "empty_content")
        out.append(m)
    return out


def arrange(
    msgs: list[dict[str, Any]], system_prompt: str | None
) -> tuple[list[dict[str, Any]], int]:
    """GeneralParser's ordering rules; returns the messages to render and how many dropped."""
    head: list[dict[str, Any]] = []
    if msgs[0]["role"] == "system":
        head, msgs = [{"role": "system", "content": msgs[0]["content"]}], msgs[1:]
    elif system_prompt:
        head = [{"role": "system", "content": system_prompt}]
    n = len(msgs)
    while msgs and msgs[0]["role"] != "user":
        msgs = msgs[1:]
    kept: list[dict[str, Any]] = []
    for j, m in enumerate(msgs):
        prev = msgs[j - 1]["role"] if j else None
        if (m["role"] == "tool" and prev not in ("assistant", "tool")) or (
            m["role"] == "assistant" and prev not in ("user", "tool")
        ):
            break
        kept.append({k: m[k] for k in KEEP_KEYS if k in m})
    return head + kept, n - len(kept)


class ChatTokenizer:
    CHECKS = 32
    """Boundaries per process computed both ways before the fast way is trusted."""

    def __init__(self, tok: Any, markers: Markers, options: ChatOptions) -> None:
        if options.control_tokens not in CONTROL_TOKEN_MODES:
            raise ConfigError(
                f"--control-tokens must be one of {', '.join(CONTROL_TOKEN_MODES)}, "
                f"not {options.control_tokens!r}"
            )
        self.tok = tok
        self.markers = markers
        self.pattern = markers.pattern
        self.options = options
        # Added tokens the tokenizer splits the text on before anything else, and which
        # match their text exactly (no whitespace stripping, no normalization).
        self.anchors = {
            i
            for i, t in getattr(tok, "added_tokens_decoder", {}).items()
            if not (t.lstrip or t.rstrip or t.normalized)
        }
        self.checks_left = self.CHECKS if getattr(tok, "is_fast", False) else -1
        self.control = control_strings(tok, markers)
        self._control_re = (
            re.compile("|".join(re.escape(c) for c in self.control)) if self.control else None
        )

    def _encode_len(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        enc = self.tok(texts, add_special_tokens=False)["input_ids"]
        return [len(x) for x in enc]

    def _boundaries(
        self, text: str, ids: list[int], offsets: list[Any], chars: list[int]
    ) -> list[int]:
        """len(encode(text[:c])) for each c, as SpecForge computes it.

        Re-encoding every prefix is quadratic in the number of turns. A fast tokenizer
        splits the text at added tokens first and tokenizes the pieces independently,
        so the prefix up to c has the tokens up to the last added token that ends before
        c, plus those of the short text after it. Each process checks this against the
        full re-encoding on its first boundaries and keeps the slow way on any difference.
        """
        if self.checks_left < 0:
            return self._encode_len([text[:c] for c in chars])
        anchors: list[tuple[int, int]] = [(0, 0)]  # (char end, tokens up to it)
        for j, tid in enumerate(ids):
            if tid in self.anchors:
                anchors.append((offsets[j][1], j + 1))
        cut: list[tuple[int, int]] = []
        for c in chars:
            k = bisect.bisect_right(anchors, (c, len(ids) + 1)) - 1
            cut.append(anchors[k])
        tails = self._encode_len([text[a:c] for (a, _), c in zip(cut, chars, strict=True)])
        fast = [k0 + n for (_, k0), n in zip(cut, tails, strict=True)]
        if self.checks_left > 0:
            self.checks_left = max(0, self.checks_left - len(chars))
            if fast != self._encode_len([text[:c] for c in chars]):
                self.checks_left = -1
                return self._encode_len([text[:c] for c in chars])
        return fast

    def _encode(self, text: str) -> tuple[list[int], list[Any]]:
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=self.checks_left >= 0)
        return enc["input_ids"], enc.get("offset_mapping", [])

    def _head(self, text: str, limit: int) -> tuple[list[int], list[Any], int]:
        """(ids, offsets, chars): the tokens of text[:chars], which either is the whole text
        or has more than `limit` tokens whose first `limit` are those of the whole text.

        Bounded memory: the head grows geometrically from a few characters per
        token, so a huge row costs a few times its `limit` tokens, never its whole text.
        A head is trusted once a head half as long again starts with the same `limit`
        tokens (a cut changes only the tokens of its last few characters)."""
        n = len(text)
        chars = max(4096, 8 * (limit + HEAD_MARGIN))
        if n <= 2 * chars:  # two heads would cost more than the whole text
            chars = n
        while True:
            ids, offsets = self._encode(text[:chars])
            if chars >= n:
                return ids, offsets, n
            if len(ids) > limit + HEAD_MARGIN:
                longer = min(n, chars + chars // 2)
                more, _ = self._encode(text[:longer])
                if more[:limit] == ids[:limit]:
                    return ids, offsets, chars
                chars = longer
            else:
                chars = min(n, chars * 2)

    def _guard(self, msgs: list[dict[str, Any]], tools: Any) -> tuple[list[dict[str, Any]], Any]:
        """--control-tokens: reject a row whose content holds a template control token, or
        escape each one (U+200B after its first character, so it tokenizes as text)."""
        mode, pattern = self.options.control_tokens, self._control_re
        if mode == "allow" or pattern is None:
            return msgs, tools
        where: list[str] = []

        def fix(value: Any, path: str) -> Any:
            if isinstance(value, str):
                if mode == "reject":
                    if m := pattern.search(value):
                        where.append(f"{path} holds the template control token {m.group()!r}")
                    return value
                return pattern.sub(lambda m: m.group()[0] + ZWSP + m.group()[1:], value)
            if isinstance(value, list):
                return [fix(v, f"{path}[{i}]") for i, v in enumerate(value)]
            if isinstance(value, dict):
                return {k: fix(v, f"{path}.{k}") for k, v in value.items()}
            return value

        msgs = [
            {
                k: v if k == "role" else fix(v, f"message {i} ({m['role']}) {k}")
                for k, v in m.items()
            }
            for i, m in enumerate(msgs)
        ]
        tools = fix(tools, "tools")
        if where:
            raise DatasetError(
                "; ".join(where[:3]) + " (--control-tokens reject)", "control_tokens"
            )
        return msgs, tools

    def __call__(self, row: Any) -> Tokenized:
        if not isinstance(row, dict):
            raise DatasetError("a row must be a JSON object", "bad_row")
        if jsonsafe.too_deep(row):  # templates and json.dumps recurse over what they render
            raise DatasetError(f"row nested deeper than {jsonsafe.MAX_DEPTH} levels", "too_deep")
        sid = row_id(row)
        key = "conversations" if "conversations" in row else "messages"
        msgs, dropped = arrange(normalize(row.get(key)), self.options.system_prompt)
        if not any(m["role"] == "assistant" for m in msgs):
            raise DatasetError("no assistant turn (after a user turn)", "no_assistant")
        tools = row.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise DatasetError("`tools` must be a list", "bad_row")
        msgs, tools = self._guard(msgs, tools)
        try:
            text = self.tok.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=False, tools=tools
            )
        except Exception as exc:  # jinja's TemplateError, raise_exception(), bad types
            raise DatasetError(f"chat template failed: {exc}", "template_error") from exc
        if not isinstance(text, str):
            raise DatasetError("chat template did not return text", "template_error")
        limit = self.options.max_length or MAX_ROW_TOKENS
        ids, offsets, head = self._head(text, limit)
        spans = list(self.pattern.finditer(text))
        if self.options.last_turn_only and spans:
            spans = spans[-1:]
        if not spans:
            raise DatasetError(
                f"no assistant span ({self.markers.assistant_header!r}) in the rendered text",
                "template_error",
            )
        chars = [s.start(1) for s in spans] + [s.end(1) for s in spans]
        # A boundary past the tokenized head lies past the limit: as good as the end.
        inside = [c for c in chars if c <= head]
        known = dict(zip(inside, self._boundaries(text, ids, offsets, inside), strict=True))
        bounds = [known.get(c, len(ids)) for c in chars]
        mask = [0] * len(ids)
        for start, end in zip(bounds[: len(spans)], bounds[len(spans) :], strict=True):
            mask[start : min(end, len(ids))] = [1] * max(0, min(end, len(ids)) - start)
        truncated = False
        if len(ids) > limit:
            if not self.options.truncate or self.options.max_length is None:
                more = "more than " if head < len(text) else ""
                flag = (
                    f"--max-length {limit}"
                    if self.options.max_length
                    else (f"the {limit} tokens a row may have (pass --max-length to cut rows)")
                )
                raise DatasetError(f"{more}{len(ids)} tokens, more than {flag}", "too_long")
            ids, mask, truncated = ids[:limit], mask[:limit], True
        if not any(mask):
            raise DatasetError("no assistant token left after truncation", "no_loss_tokens")
        return Tokenized(sid, ids, mask, truncated, dropped)


def control_strings(tok: Any, markers: Markers) -> list[str]:
    """What content must not hold under --control-tokens: the tokenizer's special tokens
    and the template's own markers (plain text in some templates), longest first."""
    found = {str(t) for t in getattr(tok, "all_special_tokens", [])}
    for t in getattr(tok, "added_tokens_decoder", {}).values():
        if getattr(t, "special", False):
            found.add(str(t.content))
    found |= {markers.assistant_header.strip(), markers.end_of_turn.strip()}
    return sorted((c for c in found if len(c) >= 2), key=len, reverse=True)
