"""Tool-call formats (hermes, llama3_json, mistral) without a server: each parser whole and
streamed in any chunking, each grammar against text in its format, the format chosen from chat
templates, markers that are special tokens kept in the response text."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tool_cases import ADD, WEATHER

from ngramspec.server.state import ServerSettings
from ngramspec.server.text import TextAssembler
from ngramspec.server.tool_calls import (
    FORMATS,
    MarkerText,
    chat_tools,
    render_messages,
    select_format,
    template_knows_tools,
    tool_call_grammar,
)
from ngramspec.server.tool_calls.llama3_json import PYTHON_TAG
from ngramspec.server.tool_calls.mistral import TOOL_CALLS
from ngramspec.structured.grammar import GrammarCompiler
from ngramspec.structured.params import StructuredOutputsParams

TOOLS = [WEATHER, ADD]
NAMES = {"get_weather", "add"}


@pytest.fixture(scope="module")
def tokenizer():
    from ngramspec.models.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def marker_tokenizer(tokenizer):
    """SmolLM2's tokenizer with Mistral's and Llama 3's markers added as special tokens."""
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [TOOL_CALLS, PYTHON_TAG]})
    return tok


def parse(fmt: str, chunks: list[str]) -> tuple[str, list[tuple[str, dict]], list[str]]:
    """(content, [(name, arguments)], ids) from feeding `chunks` to a fresh parser."""
    parser = FORMATS[fmt].parser(set(NAMES))
    content, calls = "", []
    for chunk in chunks:
        text, found = parser.push(chunk)
        content, calls = content + text, calls + found
    text, found = parser.finish()
    content, calls = content + text, calls + found
    assert parser.calls == calls
    return content, [(c.name, json.loads(c.arguments)) for c in calls], [c.id for c in calls]


def chunked(text: str, sizes: list[int]) -> list[str]:
    out, pos = [], 0
    for size in sizes:
        out.append(text[pos:pos + size])
        pos += size
    return out + [text[pos:]]


# ---- parsers: examples ----------------------------------------------------------------------

ADD_12 = ("add", {"a": 1, "b": 2})
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
HERMES_TWO = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
              '"celsius"}}\n</tool_call>')
MISTRAL_TWO = ('Sure [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
               '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]')
EXAMPLES: list[tuple[str, str, str, list[tuple[str, dict]]]] = [
    # (format, generated text, content, calls)
    ("hermes", 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Sure.", [ADD_12]),
    ("hermes", HERMES_TWO, "\n", [ADD_12, PARIS]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [ADD_12]),
    ("hermes", '<tool_call>{"name": "rm", "arguments": {}}</tool_call> ok',
     '<tool_call>{"name": "rm", "arguments": {}}</tool_call> ok', []),
    ("hermes", "a < b, <tool_c", "a < b, <tool_c", []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [ADD_12]),
    ("llama3_json", ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                     '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'),
     "", [ADD_12, PARIS]),
    ("llama3_json", ' \n{"name": "add", "parameters": {"a": 1, "b": 2}}\n\nDone.', "\n\nDone.",
     [ADD_12]),
    ("llama3_json", 'Let me add.<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}',
     "Let me add.", [ADD_12]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "}{; \\"x", "unit": "c"}}',
     "", [("get_weather", {"city": '}{; "x', "unit": "c"})]),
    ("llama3_json", 'The answer is {"a": 1}.', 'The answer is {"a": 1}.', []),
    ("llama3_json", '{"a": 1} and {"name": "add", "parameters": {}}',
     '{"a": 1} and {"name": "add", "parameters": {}}', []),
    ("llama3_json", '{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}',
     []),
    ("llama3_json", '{"name": "add", "param', '{"name": "add", "param', []),
    ("llama3_json", '<|python_tag|>print(1)', "<|python_tag|>print(1)", []),
    ("mistral", MISTRAL_TWO, "Sure ", [ADD_12, PARIS]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "abc"}]\nok',
     "\nok", [ADD_12]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "[]]", "unit": "c"}}',
     "", [("get_weather", {"city": "[]]", "unit": "c"})]),
    ("mistral", "[TOOL_CALLS] not a list", "[TOOL_CALLS] not a list", []),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, oops',
     ", oops", [ADD_12]),
    ("mistral", '[TOOL_CALLS] [{"name": "rm", "arguments": {}}]',
     '[TOOL_CALLS] [{"name": "rm", "arguments": {}}]', []),
    ("mistral", "no calls [TOOL_CA", "no calls [TOOL_CA", []),
]


@pytest.mark.parametrize("fmt, text, content, calls", EXAMPLES)
def test_parsers_find_the_calls_and_keep_the_rest_as_content(fmt, text, content, calls) -> None:
    assert parse(fmt, [text])[:2] == (content, calls)
    # one character at a time, as a slow stream gives it
    assert parse(fmt, list(text))[:2] == (content, calls)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(EXAMPLES), sizes=st.lists(st.integers(1, 12), max_size=30))
def test_any_chunking_gives_the_whole_texts_result(case, sizes) -> None:
    fmt, text, content, calls = case
    assert parse(fmt, chunked(text, sizes))[:2] == (content, calls)


def test_call_ids_suit_the_format() -> None:
    """OpenAI-style ids; Mistral's templates take back only 9 alphanumeric characters."""
    _, _, ids = parse("hermes", [HERMES_TWO])
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    _, _, ids = parse("mistral", [MISTRAL_TWO])
    assert all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in ids) and len(set(ids)) == 2


# ---- parsers: generated texts ---------------------------------------------------------------

_PLAIN = st.text(st.sampled_from(list("ab <>|{}[];,:\"\n\\é🙂")), max_size=30)
_ARGS = st.dictionaries(st.text(st.sampled_from(list("xyz_")), min_size=1, max_size=4),
                        st.one_of(st.integers(-5, 5), st.text(st.sampled_from(
                            list("ab {}[];,:\"\\\né🙂")), max_size=10),
                                  st.lists(st.integers(0, 3), max_size=3)), max_size=3)
_CALLS = st.lists(st.tuples(st.sampled_from(sorted(NAMES)), _ARGS), min_size=1, max_size=3)


def compose(fmt: str, prefix: str, calls: list[tuple[str, Any]], suffix: str) -> tuple[str, str]:
    """A reply in `fmt` with content around the calls (written as our rendering writes them):
    (text, the content a parser should give)."""
    written = FORMATS[fmt].format_calls(calls)
    if fmt == "hermes":
        return prefix + written + suffix, prefix + "\n" * (len(calls) - 1) + suffix
    if fmt == "llama3_json":  # calls open the reply (after any whitespace), or follow the tag
        if not prefix.strip():
            return prefix + written + suffix, suffix
        return prefix + PYTHON_TAG + written + suffix, prefix + suffix
    return prefix + written + suffix, prefix + suffix


@settings(max_examples=300, deadline=None)
@given(fmt=st.sampled_from(sorted(FORMATS)), prefix=_PLAIN, calls=_CALLS,
       suffix=_PLAIN.map(lambda s: "Ok" + s), sizes=st.lists(st.integers(1, 9), max_size=40))
def test_generated_replies_round_trip_in_any_chunking(fmt, prefix, calls, suffix, sizes) -> None:
    """Calls written in the format come back with their arguments, the text around them as
    content, however the text is chunked."""
    assume(not any(m in prefix + suffix for m in ("<tool_call>", TOOL_CALLS, PYTHON_TAG)))
    # a Llama 3 reply that opens with `{` is a call (or content if it is not one)
    assume(fmt != "llama3_json" or not prefix.lstrip().startswith("{"))
    text, content = compose(fmt, prefix, calls, suffix)
    assert parse(fmt, [text])[:2] == (content, calls)
    assert parse(fmt, chunked(text, sizes))[:2] == (content, calls)


@settings(max_examples=300, deadline=None)
@given(fmt=st.sampled_from(sorted(FORMATS)),
       pieces=st.lists(st.one_of(_PLAIN, st.sampled_from(
           ["<tool_call>", "</tool_call>", TOOL_CALLS, PYTHON_TAG, '{"name": "add", ',
            '"arguments": {"a": 1}}', '"parameters": {}}', "[", "]", ", ", "; ", "\n"])),
           max_size=12),
       sizes=st.lists(st.integers(1, 9), max_size=40))
def test_arbitrary_text_parses_the_same_in_any_chunking(fmt, pieces, sizes) -> None:
    """Malformed, partial and interleaved markers included: streamed == whole, and no text
    is lost or invented (content plus the calls' text accounts for every character)."""
    text = "".join(pieces)
    whole = parse(fmt, [text])
    assert parse(fmt, chunked(text, sizes))[:2] == whole[:2]
    if not whole[1]:
        assert whole[0] == text


# ---- grammars -------------------------------------------------------------------------------

def _accepts(compiler: GrammarCompiler, grammar: str, token_ids: list[int]) -> bool:
    matcher = compiler.matcher(StructuredOutputsParams(grammar=grammar))
    if matcher.validate_tokens(token_ids) != len(token_ids):
        return False
    matcher.consume_tokens(token_ids)
    return matcher.is_accepting()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_grammars_accept_calls_in_their_format_only(compiler, tokenizer, fmt: str) -> None:
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    one, two = [PARIS], [ADD_12, PARIS]
    written = FORMATS[fmt].format_calls
    required = tool_call_grammar(TOOLS, None, True, FORMATS[fmt])
    assert _accepts(compiler, required, ids(written(one)))
    assert _accepts(compiler, required, ids(written(two)))
    # one call only without parallel calls, the named tool only, the arguments' schema holds
    single = tool_call_grammar(TOOLS, None, False, FORMATS[fmt])
    assert _accepts(compiler, single, ids(written(one)))
    assert not _accepts(compiler, single, ids(written(two)))
    named = tool_call_grammar(TOOLS, "add", True, FORMATS[fmt])
    assert _accepts(compiler, named, ids(written([ADD_12])))
    assert not _accepts(compiler, named, ids(written(one)))
    assert not _accepts(compiler, required, ids(written([("add", {"a": "one", "b": 2})])))
    # nor another format's text
    for other in set(FORMATS) - {fmt}:
        assert not _accepts(compiler, required, ids(FORMATS[other].format_calls(one)))


def test_a_special_token_marker_is_forced_as_that_token(marker_tokenizer) -> None:
    """Mistral's `[TOOL_CALLS]` is one special token: the grammar takes that token, not the
    marker spelt out in ordinary tokens, and the response text keeps it for the parser."""
    tok = marker_tokenizer
    setup = chat_tools(FORMATS["mistral"], TOOLS, tok)
    marker_id = tok.convert_tokens_to_ids(TOOL_CALLS)
    assert setup.special == {TOOL_CALLS: marker_id}
    compiler = GrammarCompiler(tok, len(tok), (tok.eos_token_id,))
    grammar = setup.grammar(TOOLS, None, True)
    body = ' [{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    as_token = [marker_id] + tok.encode(body, add_special_tokens=False)
    assert _accepts(compiler, grammar, as_token)
    spelt = tok.encode(TOOL_CALLS + body, add_special_tokens=False, split_special_tokens=True)
    assert not _accepts(compiler, grammar, spelt)
    # decoded as responses are (special tokens skipped), the marker stays and the call parses
    plain = TextAssembler(tok, [])
    assert TOOL_CALLS not in plain.finish(as_token, None)
    text = setup.text(TextAssembler(tok, []))
    assert isinstance(text, MarkerText)
    streamed = "".join(text.push([t]) for t in as_token) + text.finish([], None)
    assert streamed.startswith(TOOL_CALLS)
    parser = setup.parser()
    content, calls = parser.push(streamed)
    assert content + parser.finish()[0] == "" and [c.name for c in calls] == ["add"]
    # where the request keeps special tokens, the text needs no help
    assert setup.text(TextAssembler(tok, [], skip_special_tokens=False)).__class__ \
        is TextAssembler


@pytest.mark.parametrize("stop", ["Done", "arguments", "Sure"])
def test_marker_text_cuts_where_the_stop_string_is(marker_tokenizer, stop: str) -> None:
    """The engine's stop offset is into text without the kept tokens; the cut lands before the
    same stop string in the text with them."""
    tok = marker_tokenizer
    marker_id = tok.convert_tokens_to_ids(TOOL_CALLS)
    ids = (tok.encode("Sure thing", add_special_tokens=False) + [marker_id]
           + tok.encode(' [{"name": "add", "arguments": {"a": 1}}]', add_special_tokens=False)
           + [marker_id] + tok.encode(" Done now", add_special_tokens=False))
    plain_cut = tok.decode(ids, skip_special_tokens=True).find(stop)
    text = MarkerText(TextAssembler(tok, [stop]), {marker_id: TOOL_CALLS})
    kept = MarkerText(TextAssembler(tok, []), {marker_id: TOOL_CALLS}).finish(ids, None)
    assert kept.count(TOOL_CALLS) == 2
    assert text.finish(ids, plain_cut) == kept[:kept.find(stop)]


# ---- choosing the format --------------------------------------------------------------------

# Small templates that render tools as Llama 3.1's and Mistral 7B v0.3's do.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools is not none %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Environment: ipython\n{# built-in tools answer after <|python_tag|> #}"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}. Do not use variables.\n\n"
    "{%- for t in tools %}{{ t | tojson }}\n\n{% endfor %}<|eot_id|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for tc in message.tool_calls %}"
    '{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}'
    "{%- endfor %}<|eot_id|>"
    "{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- endif %}")
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{%- endif %}[INST] {{ message.content }}[/INST]"
    "{%- elif message.tool_calls %}[TOOL_CALLS] ["
    "{%- for tc in message.tool_calls %}"
    "{%- if tc.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{%- endif %}"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, '
    '"id": "{{ tc.id }}"}{{ ", " if not loop.last }}'
    "{%- endfor %}]{{ eos_token }}"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS] "
    '{"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}'
    "[/TOOL_RESULTS]"
    "{%- else %}{{ message.content }}{{ eos_token }}{%- endif %}"
    "{%- endfor %}")
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    '</tools>\nReturn <tool_call>{"name": ..., "arguments": ...}</tool_call> (see "parameters")'
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")


def test_the_format_follows_the_flag_or_the_chat_template(tokenizer) -> None:
    assert select_format(None, LLAMA31_TEMPLATE).name == "llama3_json"
    assert select_format(None, "{{ '<|python_tag|>' }}").name == "llama3_json"
    assert select_format(None, MISTRAL_TEMPLATE).name == "mistral"
    assert select_format(None, QWEN_LIKE_TEMPLATE).name == "hermes"
    assert select_format(None, tokenizer.chat_template).name == "hermes"  # SmolLM2: no tools
    assert select_format(None, None).name == "hermes"
    assert select_format("mistral", LLAMA31_TEMPLATE).name == "mistral"
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        select_format("llama3", None)


def test_the_settings_name_the_allowed_parsers() -> None:
    for name in FORMATS:
        assert ServerSettings(tool_call_parser=name).tool_call_parser == name
    with pytest.raises(ValueError, match=r"tool_call_parser='pythonic'.*hermes, llama3_json, "
                                         "mistral"):
        ServerSettings(tool_call_parser="pythonic")


CONVERSATION = [
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "aB3dE5gH9", "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "aB3dE5gH9", "content": "5"},
    {"role": "user", "content": "And the weather in Paris?"},
]


def _prompt(tokenizer, template: str | None, parser: str | None = None) -> str:
    """The prompt text the server builds for CONVERSATION with TOOLS (see
    completions.create_chat_completion)."""
    tok = copy.deepcopy(tokenizer)
    if template is not None:
        tok.chat_template = template
    knows = template_knows_tools(tok.chat_template)
    fmt = select_format(parser, tok.chat_template)
    messages = render_messages(CONVERSATION, TOOLS, knows, fmt)
    return tok.apply_chat_template(messages, tools=TOOLS if knows else None, tokenize=False,
                                   add_generation_prompt=True)


@pytest.mark.parametrize("template, call", [
    (LLAMA31_TEMPLATE, '{"name": "add", "parameters": {"a": 2, "b": 3}}'),
    (MISTRAL_TEMPLATE, ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, '
                        '"id": "aB3dE5gH9"}]')),
])
def test_a_template_that_knows_tools_renders_them_itself(tokenizer, template, call) -> None:
    text = _prompt(tokenizer, template)
    assert json.dumps(WEATHER) in text and call in text
    assert "<tools>" not in text and "<tool_response>" not in text  # not our fallback


@pytest.mark.parametrize("parser, system, call", [
    (None, "<tools>", ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                       "</tool_call>")),
    ("llama3_json", '"parameters": dictionary', '{"name": "add", "parameters": {"a": 2, "b": 3}}'),
    ("mistral", "followed by a JSON list",
     '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}}]'),
])
def test_other_templates_get_our_rendering_in_the_chosen_format(tokenizer, parser, system,
                                                                call) -> None:
    text = _prompt(tokenizer, None, parser)  # SmolLM2's template, which has no tools
    assert system in text and call in text and "<tool_response>\n5\n</tool_response>" in text
    assert json.dumps(WEATHER) in text


def test_mistral_call_ids_go_back_through_mistrals_template(tokenizer) -> None:
    """The ids a Mistral reply gets are ones its template takes back."""
    _, _, ids = parse("mistral", [MISTRAL_TWO])
    conversation = CONVERSATION[:1] + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": ids[0], "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}]
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = MISTRAL_TEMPLATE
    text = tok.apply_chat_template(render_messages(conversation, TOOLS, True), tools=TOOLS,
                                   tokenize=False)
    assert f'"id": "{ids[0]}"' in text
    with pytest.raises(Exception, match="length 9"):
        tok.apply_chat_template(render_messages(CONVERSATION[:1] + [{
            **conversation[1], "tool_calls": [{**conversation[1]["tool_calls"][0],
                                               "id": "call_0123456789"}]}], TOOLS, True),
            tools=TOOLS, tokenize=False)
