"""Chat rows to tokens: parity with SpecForge 0.2.0's GeneralParser, ids, and bad rows."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from hsq.errors import ConfigError, DatasetError
from hsq.producer.chat import ChatOptions, ChatTokenizer, infer_markers, load_tokenizer, row_id
from hsq.producer.settings import TokenizeSettings
from hsq.producer.tokenize import read_rejects, rejects_path, tokenize_file
from tests.support.toytok import build_chatml_tokenizer

try:
    from specforge.data.parse import GeneralParser
    from specforge.data.template import ChatTemplate
except ImportError as exc:  # `make setup` installs it; say why if it is missing
    GeneralParser = None
    SPECFORGE_MISSING = f"specforge==0.2.0 not importable ({exc}); run `make setup`"
else:
    SPECFORGE_MISSING = ""
if SPECFORGE_MISSING and os.environ.get("CI"):  # CI must run these checks, not skip them
    raise RuntimeError(SPECFORGE_MISSING)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chatml_tokenizer(tmp_path_factory.mktemp("tok") / "chatml")


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Any:
    return load_tokenizer(tok_dir)


def chat(tok: Any, **opts: Any) -> ChatTokenizer:
    return ChatTokenizer(tok, infer_markers(tok), ChatOptions(**opts))


U = {"from": "human", "value": "What is the capital of France?"}
A = {"from": "gpt", "value": "The capital of France is Paris."}
CONVERSATIONS: list[dict[str, Any]] = [
    {"conversations": [U, A]},
    {
        "conversations": [
            U,
            A,
            {"from": "human", "value": "And Italy?"},
            {"from": "gpt", "value": "Rome."},
        ]
    },
    {
        "conversations": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello.\n\nHow can I help?"},
        ]
    },
    # leading assistant turn is dropped, as SpecForge does
    {"conversations": [{"from": "gpt", "value": "Welcome!"}, U, A]},
    # an assistant after an assistant ends the conversation there, as SpecForge does
    {"conversations": [U, A, {"from": "gpt", "value": "More."}, U, A]},
    {
        "conversations": [
            {"role": "user", "content": "Ünïcödé → 東京? 🙂"},
            {"role": "assistant", "content": "はい 🙂"},
        ]
    },
    {
        "conversations": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "content": "18C, sunny"},
            {"role": "assistant", "content": "It is 18C and sunny."},
        ],
        "tools": [
            {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
        ],
    },
]
OPTIONS: list[dict[str, Any]] = [
    {},
    {"last_turn_only": True},
    {"system_prompt": "You are a helpful assistant."},
    {"max_length": 24},
]


@pytest.mark.skipif(GeneralParser is None, reason=SPECFORGE_MISSING)
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "fast-path-only"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "default")
def test_matches_specforge_general_parser(tok: Any, opts: dict[str, Any], checked: bool) -> None:
    markers = infer_markers(tok)
    template = ChatTemplate(
        assistant_header=markers.assistant_header,
        user_header="<|im_start|>user\n",
        system_prompt=opts.get("system_prompt"),
        end_of_turn_token=markers.end_of_turn,
    )
    parser = GeneralParser(tok, template)
    ours = chat(tok, **opts)
    assert ours.checks_left > 0
    if not checked:  # skip the start-up cross-check: the fast boundaries alone must match
        ours.checks_left = 0
    max_length = opts.get("max_length", 2048)
    for row in CONVERSATIONS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SpecForge warns on each rule it applies
            ids, mask = parser.parse(
                row["conversations"],
                max_length,
                train_only_last_turn=opts.get("last_turn_only", False),
                tool=row.get("tools", []),
            )
        if not mask.any():  # truncation cut every assistant token: hsq refuses the row
            with pytest.raises(DatasetError, match="no assistant token"):
                ours(row)
            continue
        got = ours(row)
        assert got.input_ids == ids.tolist(), row
        assert got.loss_mask == mask.tolist(), row
        assert got.truncated == (len(ids) == max_length and "max_length" in opts)
    assert ours.checks_left >= 0, "the fast boundaries differed from re-encoding"


def test_mask_covers_assistant_turns_and_their_end_of_turn(tok: Any) -> None:
    got = chat(tok)({"id": "x", "conversations": [U, A]})
    pieces = tok.convert_ids_to_tokens(
        [t for t, m in zip(got.input_ids, got.loss_mask, strict=True) if m]
    )
    text = tok.convert_tokens_to_string(pieces)
    assert text == "The capital of France is Paris.<|im_end|>\n"


def test_openai_messages_and_sharegpt_give_the_same_tokens(tok: Any) -> None:
    c = chat(tok)
    share = c({"id": "a", "conversations": [U, A]})
    openai = c(
        {
            "id": "a",
            "messages": [
                {"role": "user", "content": U["value"]},
                {"role": "assistant", "content": A["value"]},
            ],
        }
    )
    assert (share.input_ids, share.loss_mask) == (openai.input_ids, openai.loss_mask)


def test_reasoning_content_is_rendered_and_trained_on(tok: Any) -> None:
    row = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        ]
    }
    got = chat(tok)(row)
    masked = tok.decode([t for t, m in zip(got.input_ids, got.loss_mask, strict=True) if m])
    assert masked == "<think>\nadd them\n</think>\n4<|im_end|>\n"


def test_ids_are_stable_and_content_derived(tok: Any) -> None:
    row = {"conversations": [U, A]}
    assert row_id(row) == row_id(json.loads(json.dumps(row)))
    assert row_id(row) != row_id({"conversations": [U, {"from": "gpt", "value": "Lyon."}]})
    assert chat(tok)({"id": 7, **row}).id == "7"


def test_truncation_is_recorded(tok: Any) -> None:
    got = chat(tok, max_length=20)({"conversations": [U, A]})
    assert got.truncated and len(got.input_ids) == 20
    assert '"truncated":true' in got.to_json()


BAD_ROWS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("no_assistant", {"conversations": [U]}, {}),
    ("no_assistant", {"conversations": [A, A]}, {}),
    ("unknown_role", {"conversations": [U, {"from": "bot", "value": "hi"}]}, {}),
    ("empty_content", {"conversations": [U, {"from": "gpt", "value": "  "}]}, {}),
    (
        "template_error",
        {"conversations": [U, A, {"role": "system", "content": "late system"}, U, A]},
        {},
    ),
    ("too_long", {"conversations": [U, A]}, {"max_length": 10, "truncate": False}),
    ("no_loss_tokens", {"conversations": [U, A]}, {"max_length": 10}),
    ("unsafe_id", {"id": "../etc/passwd", "conversations": [U, A]}, {}),
    ("bad_row", {"conversations": "hello"}, {}),
    ("bad_content", {"conversations": [U, {"role": "assistant", "content": [1]}]}, {}),
]


@pytest.mark.parametrize(("reason", "row", "opts"), BAD_ROWS, ids=[r[0] for r in BAD_ROWS])
def test_bad_row_reasons(tok: Any, reason: str, row: dict[str, Any], opts: dict[str, Any]) -> None:
    with pytest.raises(DatasetError) as err:
        chat(tok, **opts)(row)
    assert err.value.reason == reason


def test_tokenize_file_keeps_order_rejects_bad_rows_and_goes_on(
    tok_dir: Path, tmp_path: Path
) -> None:
    good = [
        {"id": f"g{i}", "conversations": [U, {"from": "gpt", "value": f"Answer {i}."}]}
        for i in range(40)
    ]
    lines = [json.dumps(r) for r in good[:20]]
    lines += [json.dumps(row) for _, row, opts in BAD_ROWS if not opts]
    lines += ["{not json", ""]
    lines += [json.dumps(r) for r in good[20:]]
    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join(lines) + "\n")
    dst = tmp_path / "tokens.jsonl"
    report, rejects = tokenize_file(
        src, dst, TokenizeSettings(tokenizer=str(tok_dir), jobs=2), progress=False
    )
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["id"] for r in out] == [r["id"] for r in good]
    assert report.written == 40 and report.rows == len(lines) - 1
    reasons = {r.reason for r in rejects}
    assert reasons == {reason for reason, _, opts in BAD_ROWS if not opts} | {"malformed_json"}
    assert read_rejects(rejects_path(dst)) == rejects
    assert all(r.key.startswith("line:") and r.message for r in rejects)


LLAMA3_STYLE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.mark.skipif(GeneralParser is None, reason=SPECFORGE_MISSING)
def test_template_file_markers_are_read_off_it_and_still_match_specforge(
    tok_dir: Path, tmp_path: Path
) -> None:
    # Markers that are plain text to this tokenizer (not added tokens): the fast
    # boundaries have no anchors to lean on and must still equal re-encoding.
    (tmp_path / "t.jinja").write_text(LLAMA3_STYLE)
    tok = load_tokenizer(tok_dir, template=tmp_path / "t.jinja")
    markers = infer_markers(tok)
    assert markers.assistant_header == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert markers.end_of_turn == "<|eot_id|>"
    template = ChatTemplate(
        assistant_header=markers.assistant_header,
        user_header="<|start_header_id|>user<|end_header_id|>\n\n",
        end_of_turn_token=markers.end_of_turn,
    )
    parser, ours = GeneralParser(tok, template), chat(tok)
    ours.checks_left = 0
    for row in CONVERSATIONS[:6]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ids, mask = parser.parse(row["conversations"], 2048)
        got = ours(row)
        assert (got.input_ids, got.loss_mask) == (ids.tolist(), mask.tolist())


def test_a_tokenizer_without_a_template_is_a_usage_error(tok_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(tok_dir, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)  # 4.50 keeps it in the config only
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="--template"):
        load_tokenizer(bare)
