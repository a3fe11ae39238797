"""Engine options: derived from EngineConfig once, the same names and defaults in every command."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields

import pytest

from pdserve.bench.runner import build_parser as bench_parser
from pdserve.cli.main import build_parser as pdserve_parser
from pdserve.cli.sim import build_parser as sim_parser
from pdserve.engine.config import DEFAULT_TOKEN_BUDGET, EngineConfig, ModelConfig
from pdserve.options import add_config_arguments, config_from_args, option_fields
from pdserve.options import option_flag as config_option_flag
from pdserve.sim.config import SimConfig

CHANGED = ["--max-num-batched-tokens", "4096", "--max-num-seqs", "8", "--no-chunked-prefill", "--block-size", "32"]


def _parser(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig, **kwargs)
    return parser


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    return config_from_args(EngineConfig, args, **overrides)


def option_flag(name: str) -> str:
    return config_option_flag(EngineConfig, name)


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
    add_config_arguments(parser, EngineConfig, exclude=("seed",))
    assert engine_config_from_args(parser.parse_args(["--seed", "9"])).seed == EngineConfig().seed
    only = _parser(only=("model", "block_size"))
    assert {a.dest for a in only._actions} == {"help", "model", "block_size"}
    assert engine_config_from_args(only.parse_args(["--block-size", "8"])) == EngineConfig(block_size=8)


def test_bad_input():
    with pytest.raises(ValueError, match="not EngineConfig options: nonsense"):
        _parser(only=("nonsense",))
    with pytest.raises(ValueError, match="no EngineConfig options"):
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
    code = "import sys, pdserve.engine.config; assert 'torch' not in sys.modules, 'torch loaded'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert set(option_fields(EngineConfig)) == {f.name for f in fields(EngineConfig)}  # every field an option


# ---- one declaration per setting, in every command --------------------------------------------------------

COMMANDS = ("generate", "serve", "status", "demo")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every pdserve subcommand's parser, by name."""
    main = pdserve_parser()
    sub = next(a for a in main._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {name: sub.choices[name] for name in COMMANDS}
    return {**parsers, "bench": bench_parser(), "sim": sim_parser()}


def _declared() -> list[tuple[type, str]]:
    from pdserve.deployment_config import DeploymentConfig
    from pdserve.options import option_fields
    from pdserve.router.config import RouterConfig
    from pdserve.sim.api import SimSettings

    return [
        (cls, name)
        for cls in (EngineConfig, DeploymentConfig, RouterConfig, SimSettings)
        for name in option_fields(cls)
    ]


def test_every_command_takes_a_setting_by_its_one_declared_flag_and_default():
    from pdserve import options

    parsers = _parsers()
    seen: dict[tuple[type, str], set[str]] = {}
    for command, parser in parsers.items():
        by_dest = {a.dest: a for a in parser._actions}
        for cls, name in _declared():
            if name not in options.offered(parser, cls):
                continue
            action = by_dest[name]
            seen.setdefault((cls, name), set()).add(command)
            f = {f.name: f for f in fields(cls)}[name]
            assert action.option_strings == [options.option_flag(cls, name)], (command, name)
            expected = 50051 if (command, name) == ("serve", "port") else f.default
            assert action.default == expected, (command, name, action.default)
            assert tuple(action.choices or ()) == tuple(f.metadata.get("choices", ())), (command, name)
    assert seen[(EngineConfig, "block_size")] >= {"generate", "serve", "bench", "sim"}
    from pdserve.deployment_config import DeploymentConfig
    from pdserve.router.config import RouterConfig

    assert seen[(DeploymentConfig, "num_prefill_workers")] == {"serve", "bench", "sim"}
    assert seen[(DeploymentConfig, "num_decode_workers")] == {"serve", "bench", "sim"}
    assert seen[(DeploymentConfig, "transport")] == {"serve", "bench", "demo"}
    assert seen[(RouterConfig, "auto_min_remote_tokens")] == {"serve", "bench", "sim"}


def test_no_command_has_another_name_for_the_worker_counts():
    for command, parser in _parsers().items():
        flags = {s for a in parser._actions for s in a.option_strings}
        assert not flags & {"--workers", "--prefill", "--decode", "--instances"}, command
        transport = [a for a in parser._actions if "--transport" in a.option_strings]
        assert all(tuple(a.choices) == ("nixl", "grpc") for a in transport), command


def test_the_hand_off_deadlines_have_one_default_everywhere():
    import inspect

    from pdserve.decode_node.worker import DecodeWorker
    from pdserve.deployment_config import DeploymentConfig
    from pdserve.prefill_node.worker import PrefillWorker
    from pdserve.router.config import RouterConfig
    from pdserve.transport_config import GrpcConfig

    config = DeploymentConfig()
    push = {
        config.push_timeout_s,
        GrpcConfig().push_timeout_s,
        inspect.signature(PrefillWorker.__init__).parameters["push_timeout_s"].default,
    }
    ttl = {
        config.reservation_ttl_s,
        RouterConfig().abort_fence_s,
        inspect.signature(DecodeWorker.__init__).parameters["reservation_ttl_s"].default,
    }
    assert len(push) == 1 and len(ttl) == 1, (push, ttl)
    changed = DeploymentConfig(reservation_ttl_s=30.0, push_timeout_s=5.0)
    assert changed.router_config().abort_fence_s == 30.0
    with pytest.raises(ValueError, match="push_timeout_s"):
        DeploymentConfig(reservation_ttl_s=10.0, push_timeout_s=9.0)
    with pytest.raises(ValueError, match="transport"):
        DeploymentConfig(transport="carrier-pigeon")


def test_serve_options_reach_the_deployment_config():
    from pdserve.cli.main import deployment_config_from_args

    argv = ["serve", "--mode", "auto", "--decode-workers", "2", "--transport", "grpc", "--push-timeout-s", "5"]
    argv += ["--reservation-ttl-s", "30", "--auto-min-remote-tokens", "8", "--routers", "2", "--no-prefix-caching"]
    config = deployment_config_from_args(pdserve_parser().parse_args(argv))
    assert (config.mode, config.num_prefill_workers, config.num_decode_workers) == ("auto", 1, 2)
    assert (config.transport, config.push_timeout_s, config.reservation_ttl_s) == ("grpc", 5.0, 30.0)
    assert config.num_routers == 2 and config.port == 50051 and not config.engine.enable_prefix_caching
    router = config.router_config()
    assert (router.auto_min_remote_tokens, router.abort_fence_s, router.default_mode) == (8, 30.0, "auto")
    colocated = deployment_config_from_args(pdserve_parser().parse_args(["serve"]))
    assert (colocated.num_prefill_workers, colocated.num_decode_workers) == (0, 1)


def _help_entries(text: str) -> list[str]:
    """One string per option of a --help text (its flag line and the lines that continue it)."""
    entries: list[str] = []
    for line in text.splitlines():
        if line.startswith("  -"):
            entries.append(line.strip())
        elif entries and line.startswith("        ") and line.strip():
            entries[-1] += " " + line.strip()
        elif not line.strip() or not line.startswith(" "):
            entries.append("")  # a new section: nothing continues across it
    return [e for e in entries if e]


@pytest.mark.parametrize("command", [*COMMANDS, "bench", "sim"])
def test_help_shows_each_default_once_and_no_markup(command: str):
    parser = _parsers()[command]
    text = parser.format_help()
    assert "``" not in text and "::" not in text
    entries = _help_entries(text)
    assert len(entries) > 3
    for entry in entries:
        assert "(default: True)" not in entry and "(default: False)" not in entry, entry
        assert "(default: None)" not in entry and "(default: )" not in entry, entry
        assert entry.count("default:") <= 1, entry  # a flag may be named --default-x
    switches = [e for e in entries if e.startswith("--no-")]
    if command in ("generate", "serve", "bench", "sim"):
        assert any(" ".join(e.split()).startswith("--no-chunked-prefill turn off") for e in switches), switches


def test_main_help_lists_every_subcommand():
    text = pdserve_parser().format_help()
    for name in (*COMMANDS, "bench", "sim"):
        assert f"\n    {name} " in text, name
    assert "``" not in text
