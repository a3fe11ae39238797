"""Engine options: derived from EngineConfig once, the same names and defaults in every command."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields

import pytest

from pdserve.bench.runner import build_parser as bench_parser
from pdserve.cli.main import build_parser as pdserve_parser
from pdserve.engine.config import DEFAULT_TOKEN_BUDGET, EngineConfig, ModelConfig
from pdserve.engine.options import add_engine_arguments, engine_config_from_args, engine_fields, option_flag
from pdserve.sim.cli import build_parser as sim_parser
from pdserve.sim.config import SimConfig

CHANGED = ["--max-num-batched-tokens", "4096", "--max-num-seqs", "8", "--no-chunked-prefill", "--block-size", "32"]


def _parser(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, **kwargs)
    return parser


def test_every_field_is_an_option_with_its_default_and_help():
    parser = _parser()
    by_dest = {a.dest: a for a in parser._actions}
    for f in fields(EngineConfig):
        action = by_dest[f.name]
        assert action.option_strings == [option_flag(f.name)]
        assert action.default == f.default
        assert f.metadata["help"] in action.help
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()


def test_flag_names():
    assert option_flag("max_num_batched_tokens") == "--max-num-batched-tokens"
    assert option_flag("enable_chunked_prefill") == "--no-chunked-prefill"
    assert option_flag("enable_prefix_caching") == "--no-prefix-caching"
    assert option_flag("kv_cache_memory_gb") == "--kv-cache-memory-gb"


def test_parsed_values_reach_the_config():
    args = _parser().parse_args([*CHANGED, "--dtype", "float32", "--num-kv-blocks", "64", "--no-prefix-caching"])
    config = engine_config_from_args(args, model="bench")
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.block_size) == (4096, 8, 32)
    assert not config.enable_chunked_prefill and not config.enable_prefix_caching
    assert (config.dtype, config.num_kv_blocks, config.model) == ("float32", 64, "bench")


def test_excluded_and_unselected_fields_keep_their_defaults_even_if_args_has_the_name():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=7)  # e.g. the workload's seed
    add_engine_arguments(parser, exclude=("seed",))
    assert engine_config_from_args(parser.parse_args(["--seed", "9"])).seed == EngineConfig().seed
    only = _parser(only=("model", "block_size"))
    assert {a.dest for a in only._actions} == {"help", "model", "block_size"}
    assert engine_config_from_args(only.parse_args(["--block-size", "8"])) == EngineConfig(block_size=8)


def test_bad_input():
    with pytest.raises(ValueError, match="not EngineConfig fields: nonsense"):
        _parser(only=("nonsense",))
    with pytest.raises(ValueError, match="no engine options"):
        engine_config_from_args(argparse.Namespace(model="tiny"))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config_from_args(_parser().parse_args(["--max-num-seqs", "0"]))
    with pytest.raises(SystemExit):
        _parser().parse_args(["--dtype", "float64"])


def test_every_command_has_the_same_options_and_defaults():
    serve = pdserve_parser().parse_args(["serve"])
    generate = pdserve_parser().parse_args(["generate", "hi"])
    bench = bench_parser().parse_args([])
    assert engine_config_from_args(serve) == engine_config_from_args(generate) == engine_config_from_args(bench)
    assert engine_config_from_args(serve) == EngineConfig()
    demo = pdserve_parser().parse_args(["demo"])  # the demo answers questions with a trained model by design
    assert (demo.model, demo.bench_model) == ("smollm2", EngineConfig().model)
    assert SimConfig.from_engine_config(engine_config_from_args(sim_parser().parse_args([]))) == SimConfig(
        max_num_batched_tokens=DEFAULT_TOKEN_BUDGET
    )
    changed = [
        engine_config_from_args(pdserve_parser().parse_args(["serve", *CHANGED])),
        engine_config_from_args(pdserve_parser().parse_args(["generate", "hi", *CHANGED])),
        engine_config_from_args(bench_parser().parse_args(CHANGED)),
    ]
    assert changed[0] == changed[1] == changed[2] != EngineConfig()
    sim = SimConfig.from_engine_config(engine_config_from_args(sim_parser().parse_args(CHANGED)))
    assert (sim.max_num_batched_tokens, sim.max_num_seqs, sim.block_size) == (4096, 8, 32)
    assert not sim.enable_chunked_prefill and sim.chunk_size is None


def test_sim_config_defaults_are_the_engines():
    engine, sim = EngineConfig(), SimConfig()
    assert (sim.block_size, sim.max_num_seqs) == (engine.block_size, engine.max_num_seqs)
    assert sim.token_budget(longest_prompt=10) == DEFAULT_TOKEN_BUDGET
    unchunked = SimConfig.from_engine_config(EngineConfig(enable_chunked_prefill=False))
    assert unchunked.token_budget(longest_prompt=5000) == 5000 + unchunked.max_num_seqs  # a whole prompt fits


def test_default_budget_is_one_number_and_holds_a_whole_prompt_without_chunking():
    tiny = ModelConfig.preset("tiny")
    assert EngineConfig().with_model_defaults(tiny).max_num_batched_tokens == DEFAULT_TOKEN_BUDGET == 512
    unchunked = EngineConfig(enable_chunked_prefill=False, max_model_len=1024).with_model_defaults(tiny)
    assert unchunked.max_num_batched_tokens == 1024
    given = EngineConfig(max_num_batched_tokens=64).with_model_defaults(tiny)
    assert given.max_num_batched_tokens == 64
    with pytest.raises(ValueError, match="max_num_batched_tokens"):  # an explicit budget must hold a prompt
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=100, max_model_len=200)


def test_options_load_without_torch():
    code = "import sys, pdserve.engine.options; assert 'torch' not in sys.modules, 'torch loaded'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert set(engine_fields()) == {f.name for f in fields(EngineConfig)}
